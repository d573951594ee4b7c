"""Transaction guards and bounded lock waits: the one mechanism every app uses.

- `require_transaction()` starts every helper that must run inside its caller's
  transaction (the `*_in_tx` helpers); it never opens one.
- `bounded_lock_wait(**details)` bounds the row-lock waits of the rest of the current
  transaction (`SET LOCAL lock_timeout`) and turns an expired wait into the retryable
  `ResourceBusy` (409 `resource_busy`) with `details`.
- `busy_on_lock_timeout(**details)` is the translation alone, for a caller that sets the
  timeout itself (in the same statement as its first read, to save a round trip) or wraps a
  whole `transaction.atomic()` block.

Lock order and which path takes which lock: docs/locking.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

from django.db import DEFAULT_DB_ALIAS, OperationalError, connections, transaction

from paperclip.errors import ResourceBusy

# SQLSTATE 55P03: raised when `lock_timeout` expires (or NOWAIT finds the row locked).
LOCK_NOT_AVAILABLE: Final = "55P03"
# How long a request waits for a row another request holds before answering resource_busy.
HOT_PATH_LOCK_TIMEOUT: Final = "5s"


def require_transaction() -> None:
    """Private helpers that must run inside their caller's transaction start with this."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("this helper must run inside the caller's transaction.atomic()")


def set_local_lock_timeout(timeout: str | None = None, *, using: str = DEFAULT_DB_ALIAS) -> None:
    """Bound this transaction's lock waits (default `HOT_PATH_LOCK_TIMEOUT`, read at call time
    so tests can shorten it); a timeout surfaces as `OperationalError` 55P03."""
    if not connections[using].in_atomic_block:
        # Outside atomic() the setting would vanish with the statement's implicit transaction.
        raise RuntimeError("set_local_lock_timeout() needs an open transaction.atomic()")
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT set_config('lock_timeout', %s, true)", [timeout or HOT_PATH_LOCK_TIMEOUT]
        )


def is_lock_timeout(exc: BaseException) -> bool:
    """True when `exc` is PostgreSQL's "lock not available" (an expired `lock_timeout`)."""
    return getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE


@contextmanager
def busy_on_lock_timeout(message: str | None = None, **details: Any) -> Iterator[None]:
    """Turn "lock not available" raised inside the block into `ResourceBusy(message, **details)`.

    Around a whole `transaction.atomic()` block (outermost), the aborted transaction has
    been rolled back before the domain error is raised; inside one, the error leaves the
    block and `atomic()` rolls back as for any exception.
    """
    try:
        yield
    except OperationalError as exc:
        if is_lock_timeout(exc):
            raise ResourceBusy(message, **details) from exc
        raise


@contextmanager
def bounded_lock_wait(
    timeout: str | None = None, *, message: str | None = None, **details: Any
) -> Iterator[None]:
    """Inside a transaction: bound the lock waits of the rest of it to `timeout` and turn an
    expired wait in the block into `ResourceBusy(message, **details)`."""
    set_local_lock_timeout(timeout)
    with busy_on_lock_timeout(message, **details):
        yield
