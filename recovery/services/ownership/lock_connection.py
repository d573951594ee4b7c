"""The finalization lock's dedicated connection (kept alive for the whole action) and the
`FinalizationOwnership` handle the action gets, whose `assert_held()` rechecks the lock,
the receipt and the task."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections

from paperclip.receipts import OWNER_KEY
from recovery.errors import FinalizationOwnershipLost

# Keepalive cadence: well inside the server's idle-in-transaction timeout.
_KEEPALIVE_FRACTION = 3
_KEEPALIVE_MIN_SECONDS = 0.02
_KEEPALIVE_MAX_SECONDS = 30.0


class LockSession:
    """The dedicated lock connection. psycopg connections are not for concurrent use, so the
    keepalive thread and `assert_held` share it under a mutex."""

    def __init__(self, conn: psycopg.Connection[Any], idle_timeout_ms: int | None) -> None:
        self._conn = conn
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        self.backend_pid = conn.info.backend_pid
        self.interval: float | None = None
        if idle_timeout_ms:
            seconds = idle_timeout_ms / 1000 / _KEEPALIVE_FRACTION
            self.interval = min(max(seconds, _KEEPALIVE_MIN_SECONDS), _KEEPALIVE_MAX_SECONDS)

    def ping(self) -> None:
        with self._mutex:
            self._conn.execute("SELECT 1").fetchone()

    def _keepalive_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.ping()
            except Exception as exc:  # the next assert_held reports it
                self.failure = exc
                return

    @contextmanager
    def keepalive(self) -> Iterator[None]:
        thread = None
        if self.interval is not None:
            thread = threading.Thread(
                target=self._keepalive_loop,
                args=(self.interval,),
                name="finalization-lock-keepalive",
                daemon=True,
            )
            thread.start()
        try:
            yield
        finally:
            self._stop.set()
            if thread is not None:
                thread.join(timeout=5)

    def end(self) -> None:
        """Roll back the lock transaction, releasing the advisory lock."""
        # A dead connection has already lost the lock; nothing to roll back then.
        with self._mutex, contextlib.suppress(psycopg.Error):
            self._conn.rollback()


class FinalizationOwnership:
    """The handle passed to the action. `assert_held()` rechecks the lock connection, our
    receipt and (after a platform-proof takeover) the recovery result."""

    def __init__(
        self,
        *,
        company_id: UUID,
        run_id: UUID,
        token: str,
        session: LockSession,
        binding_current: Callable[[], bool] | None,
        using: str,
    ) -> None:
        self.company_id = company_id
        self.run_id = run_id
        self.token = token
        self._session = session
        # After a platform-proof takeover: is the task we resumed still the current one?
        self._binding_current = binding_current
        self._using = using

    @property
    def lock_backend_pid(self) -> int:
        return self._session.backend_pid

    def assert_held(self) -> None:
        """Raise FinalizationOwnershipLost unless we still hold the lock and the receipt."""
        try:
            if self._session.failure is not None:
                raise FinalizationOwnershipLost("lock_connection_lost") from self._session.failure
            # A failed lock transaction is never reconnected: it would be a new, unlocked one.
            self._session.ping()
        except FinalizationOwnershipLost:
            raise
        except Exception as exc:
            raise FinalizationOwnershipLost("lock_connection_lost") from exc
        try:
            still_owner = receipt_is_ours(
                company_id=self.company_id, run_id=self.run_id, token=self.token, using=self._using
            )
            recheck = self._binding_current
            task_current = recheck() if recheck is not None and still_owner else True
        except Exception as exc:
            raise FinalizationOwnershipLost("database_unavailable") from exc
        if not still_owner:
            raise FinalizationOwnershipLost("owner_replaced")
        if not task_current:
            raise FinalizationOwnershipLost("task_replaced")


def receipt_is_ours(
    *, company_id: UUID, run_id: UUID, token: str, using: str = DEFAULT_DB_ALIAS
) -> bool:
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM heartbeat_runs WHERE id = %s AND company_id = %s"
            " AND runner_profile_json -> %s ->> 'token' = %s",
            [run_id, company_id, OWNER_KEY, token],
        )
        return cursor.fetchone() is not None
