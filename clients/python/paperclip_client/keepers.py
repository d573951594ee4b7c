"""Lease keepers: hold a runtime lease or a controller lease for as long as a `with` block runs.

A keeper claims on entry, renews in a background thread at a fraction of the TTL the server
granted (measured from when the granting request was sent, so a slow answer shortens the
local deadline, never lengthens it), and releases on exit. It marks itself **lost**, calls
`on_lost(reason)` once and stops renewing when:

- the server refuses a renew (another owner holds the lease, the run or issue ended, the
  generation moved on), or
- renews keep failing (server unreachable) until the local deadline, after which someone else
  may legitimately have reclaimed the lease.

Keepers that hold leases for one piece of work renew them together: `renew_with=other` joins
a keeper to another's group, and from then on every renew of either sends one
`POST /api/leases/renew` carrying both leases (each answered on its own: a refused lease marks
only its keeper lost). `paperclip-agent` holds its runtime and controller leases this way.

A lost keeper never writes again: `ensure_held()` raises `LeaseLost`. Callers that write
(fenced operations, checkpoints, results) call `ensure_held()` first: it renews now, so a
process that was paused for a long time learns it lost the lease before it writes anything.
A write a moment after a renew need not wait for another: `ensure_held(recent=S)` skips the
request when a grant sent less than S seconds ago (at most a tenth of its TTL) was confirmed.
The lease cannot have expired since, and the server fences each write all the same (its
generation and fence; a run that ended is refused), so a pause longer than S still renews
first, and a lease lost by other means within S is refused by the write itself.
`paperclip-agent run` writes this way (`RECENT_RENEW_SECONDS`): its steps after the command
(the operation, the snapshot, the result) come within a second of each other.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from paperclip_client._lazy import LazyModule
from paperclip_client.client import Client
from paperclip_client.errors import (
    ApiError,
    ConflictError,
    OutcomeUnknown,
    PaperclipError,
    ServerUnreachable,
    WorkspaceRuntimeLeaseConflict,
)

if TYPE_CHECKING:
    from paperclip_client import models
    from paperclip_client.models import ControllerLease, LeaseClaim, LeaseRenewal, RuntimeLease
else:  # imported at the first answer read, not at the CLI's start (_lazy.py says why)
    models = LazyModule("paperclip_client.models")


# How recent a confirmed renew makes another before a write unneeded (`ensure_held(recent=)`).
RECENT_RENEW_SECONDS = 2.0


class LeaseLost(PaperclipError):
    """The keeper's lease is gone; stop working on what it protected."""


class _Keeper:
    """The renew thread, the deadline and the lost state shared by both keepers."""

    kind = "lease"

    def __init__(
        self,
        *,
        ttl_seconds: int,
        on_lost: Callable[[str], None] | None,
        renew_fraction: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < renew_fraction < 1:
            raise ValueError("renew_fraction must be between 0 and 1")
        self.ttl_seconds = ttl_seconds
        self.on_lost = on_lost
        self.renew_fraction = renew_fraction
        self._clock = clock
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._granted_ttl = float(ttl_seconds)
        self._confirmed_at = 0.0  # local monotonic time the last grant's request was sent
        self.lost_reason: str | None = None
        self.renewals = 0
        self._abandoned = False
        self._group: list[_Keeper] = [self]  # keepers renewed in one request (renew_with)

    # subclass hooks ---------------------------------------------------------------------------

    def _acquire(self) -> float:
        """First claim; returns the granted TTL in seconds."""
        raise NotImplementedError

    def _renew(self) -> float:
        """Renew; returns the granted TTL; raises LeaseLost when the server refuses."""
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    def _client(self) -> Client:
        raise NotImplementedError

    def _renew_item(self) -> dict[str, Any]:
        """This lease's item of a batch renew (`Client.leases_renew`)."""
        raise NotImplementedError

    def _renewed(self, renewal: LeaseRenewal) -> float:
        """Take this lease's answer of a batch renew: the granted TTL; raises LeaseLost when
        the server refused it, or the error itself when it is worth a retry."""
        raise NotImplementedError

    # public -----------------------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        return self.lost_reason is not None

    @property
    def deadline(self) -> float:
        """Local monotonic time after which the lease may have expired on the server."""
        return self._confirmed_at + self._granted_ttl

    def __enter__(self) -> Any:
        sent = self._clock()
        granted = self._acquire()
        self._confirmed(sent, granted)
        self._thread = threading.Thread(target=self._loop, name=f"{self.kind}-keeper", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if isinstance(exc, LeaseLost):
            self._abandoned = True  # some lease is lost: write nothing more, not even a release
        self.stop()
        if not self.lost and not self._abandoned:
            # A failed release is harmless: the lease expires by itself.
            with contextlib.suppress(PaperclipError):
                self._release()

    def stop(self) -> None:
        """Stop renewing (without releasing)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def abandon(self) -> None:
        """Stop renewing and never release: after another lease was lost, write nothing."""
        self._abandoned = True
        self.stop()

    def renew_with(self, other: _Keeper) -> None:
        """Renew this lease and `other`'s (and its group's) in one request from now on. Call
        before entering this keeper; the group shares one lock, so a renew of one waits for a
        renew of another instead of racing it."""
        if self._thread is not None:
            raise RuntimeError("renew_with() before the keeper is entered")
        if other._client() is not self._client():
            raise ValueError("keepers renewed together must share one Client")
        other._group.append(self)
        self._group = other._group
        self._lock = other._lock

    def wake(self) -> None:
        """Renew now, from the background thread (e.g. after SIGCONT)."""
        self._wake.set()

    def ensure_held(self, *, recent: float = 0.0) -> None:
        """Renew now, synchronously; raise LeaseLost if the lease is (or turns out) lost.
        A renew that fails without an answer still counts while the local deadline holds.
        With `recent`, no request when the last grant confirmed was sent less than `recent`
        seconds ago (and less than a tenth of its TTL): see the module's docstring."""
        with self._lock:
            if self.lost:
                raise LeaseLost(self.lost_reason or "lost")
            age = self._clock() - self._confirmed_at
            if self._thread is not None and 0 <= age < min(recent, self._granted_ttl / 10):
                return
            self._renew_once()
            if self.lost:
                raise LeaseLost(self.lost_reason or "lost")

    def mark_lost(self, reason: str) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost_reason = reason
        self._stop.set()
        self._wake.set()
        if self.on_lost is not None:
            self.on_lost(reason)

    # internals --------------------------------------------------------------------------------

    def _confirmed(self, sent: float, granted: float) -> None:
        self._confirmed_at = sent
        self._granted_ttl = max(1.0, granted)

    def _joined(self) -> bool:
        """Renewed by a partner's batch: entered, still held and renewing."""
        return (
            self._thread is not None
            and not self.lost
            and not self._abandoned
            and not self._stop.is_set()
        )

    def _renew_once(self) -> bool:
        """One renew attempt; True on success. Marks lost on refusal or past the deadline."""
        partners = [k for k in self._group if k is not self and k._joined()]
        if partners:
            return self._renew_together([self, *partners])
        sent = self._clock()
        try:
            granted = self._renew()
        except LeaseLost as exc:
            self.mark_lost(str(exc))
            return False
        except (ServerUnreachable, OutcomeUnknown, ApiError) as exc:
            if self._clock() >= self.deadline:
                self.mark_lost(f"could not renew the {self.kind} before it expired: {exc}")
            return False
        self._confirmed(sent, granted)
        self.renewals += 1
        return True

    def _renew_together(self, keepers: list[_Keeper]) -> bool:
        """Renew every keeper of `keepers` in one request; True when this one's renewed. Each
        answer is taken by its own keeper: a refusal marks only that keeper lost."""
        sent = self._clock()
        try:
            renewals = self._client().leases_renew([k._renew_item() for k in keepers])
        except (ServerUnreachable, OutcomeUnknown, ApiError) as exc:
            for keeper in keepers:
                if keeper._clock() >= keeper.deadline:
                    keeper.mark_lost(f"could not renew the {keeper.kind} before it expired: {exc}")
            return False
        renewed_self = False
        for keeper, renewal in zip(keepers, renewals, strict=True):
            try:
                granted = keeper._renewed(renewal)
            except LeaseLost as exc:
                keeper.mark_lost(str(exc))
                continue
            except ApiError as exc:  # busy or contended: retried, until the deadline
                if keeper._clock() >= keeper.deadline:
                    keeper.mark_lost(f"could not renew the {keeper.kind} before it expired: {exc}")
                continue
            keeper._confirmed(sent, granted)
            keeper.renewals += 1
            renewed_self = renewed_self or keeper is self
        return renewed_self

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            interval = self._granted_ttl * self.renew_fraction
            if failures:
                interval = min(interval, 0.5 * 2 ** min(failures, 5))
            due = (self._confirmed_at if not failures else self._clock()) + interval
            woken = self._wake.wait(timeout=max(0.0, due - self._clock()))
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                if self.lost:
                    return
                next_due = self._confirmed_at + self._granted_ttl * self.renew_fraction
                if not woken and not failures and next_due > self._clock():
                    continue  # a partner's request renewed this lease meanwhile
                failures = 0 if self._renew_once() else failures + 1


def _granted(renewed_at: datetime, expires_at: datetime) -> float:
    return (expires_at - renewed_at).total_seconds()


class RuntimeLeaseKeeper(_Keeper):
    """Hold an execution workspace's runtime lease.

    The owner is `run:<run_id>` when only `run_id` is given (each run fences the others),
    `issue:<issue_id>` when `issue_id` is. With `wait=True` a conflict on entry is waited
    out (polling every `poll_seconds` until the holder turns stale, calling `on_wait` with
    the conflict each time); otherwise it is raised.
    """

    kind = "runtime lease"

    def __init__(
        self,
        client: Client,
        workspace_id: str,
        *,
        run_id: str | None = None,
        issue_id: str | None = None,
        action: str = "start",
        ttl_seconds: int = 300,
        on_lost: Callable[[str], None] | None = None,
        renew_fraction: float = 1 / 3,
        wait: bool = False,
        poll_seconds: float = 2.0,
        on_wait: Callable[[WorkspaceRuntimeLeaseConflict], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            ttl_seconds=ttl_seconds, on_lost=on_lost, renew_fraction=renew_fraction, clock=clock
        )
        self.client = client
        self.workspace_id = workspace_id
        self.run_id = run_id
        self.issue_id = issue_id
        self.action = action
        self.wait = wait
        self.poll_seconds = poll_seconds
        self.on_wait = on_wait
        self.claim: LeaseClaim | None = None
        self.lease: RuntimeLease | None = None

    @property
    def generation(self) -> int:
        if self.lease is None:
            raise LeaseLost("not claimed")
        return self.lease.generation

    @property
    def fence(self) -> int | None:
        """The grant's fence, for outside systems that must order writers (None: the server
        hands out none)."""
        if self.lease is None:
            raise LeaseLost("not claimed")
        return self.lease.fence

    def _claim(self) -> LeaseClaim:
        return self.client.runtime_lease_claim(
            self.workspace_id,
            action=self.action,
            issue_id=self.issue_id,
            run_id=self.run_id,
            ttl_seconds=self.ttl_seconds,
        )

    def _acquire(self) -> float:
        while True:
            try:
                claim = self._claim()
                break
            except WorkspaceRuntimeLeaseConflict as conflict:
                if not self.wait:
                    raise
                if self.on_wait is not None:
                    self.on_wait(conflict)
                time.sleep(self.poll_seconds)
        if claim.lease is None:
            raise LeaseLost(f"the claim was {claim.outcome} without a lease (a board actor?)")
        self.claim, self.lease = claim, claim.lease
        return _granted(claim.lease.renewed_at, claim.lease.expires_at)

    def _renew(self) -> float:
        try:
            claim = self._claim()
        except ConflictError as exc:
            if exc.code in ("resource_busy", "workspace_runtime_lease_contended"):
                raise
            raise LeaseLost(f"the {self.kind} was refused: {exc.code}") from exc
        if claim.lease is None or claim.lease.generation != self.generation:
            got = None if claim.lease is None else claim.lease.generation
            raise LeaseLost(f"the {self.kind} generation moved from {self.generation} to {got}")
        self.lease = claim.lease
        return _granted(claim.lease.renewed_at, claim.lease.expires_at)

    def _client(self) -> Client:
        return self.client

    def _renew_item(self) -> dict[str, Any]:
        if self.lease is None:
            raise LeaseLost("not claimed")
        return {
            "kind": "runtime",
            "execution_workspace_id": self.workspace_id,
            "issue_id": self.issue_id,
            "run_id": self.run_id,
            "generation": self.lease.generation,
            "fence": self.lease.fence,
            "ttl_seconds": self.ttl_seconds,
        }

    def _renewed(self, renewal: LeaseRenewal) -> float:
        error = renewal.error
        if error is not None:
            if error.code in ("resource_busy", "workspace_runtime_lease_contended"):
                raise error
            raise LeaseLost(f"the {self.kind} was refused: {error.code}")
        lease = renewal.lease
        if not isinstance(lease, models.RuntimeLease) or lease.generation != self.generation:
            raise LeaseLost(f"the {self.kind} generation moved from {self.generation}")
        self.lease = lease
        return _granted(lease.renewed_at, lease.expires_at)

    def _release(self) -> None:
        self.client.runtime_lease_release(
            self.workspace_id, issue_id=self.issue_id, run_id=self.run_id
        )

    def operation(
        self,
        *,
        phase: str,
        status: str,
        command: str | None = None,
        exit_code: int | None = None,
        recent: float = 0.0,
    ) -> None:
        """Record a fenced workspace operation at the current generation (after a renew, or
        one confirmed within `recent` seconds: `ensure_held`). A refusal marks the keeper lost
        and raises LeaseLost."""
        self.ensure_held(recent=recent)
        try:
            self.client.workspace_operation_create(
                self.workspace_id,
                generation=self.generation,
                phase=phase,
                status=status,
                issue_id=self.issue_id,
                run_id=self.run_id,
                command=command,
                exit_code=exit_code,
            )
        except ConflictError as exc:
            if exc.code.startswith("workspace_runtime_lease_"):
                self.mark_lost(f"the fenced write was refused: {exc.code}")
                raise LeaseLost(self.lost_reason or exc.code) from exc
            raise


class ControllerLeaseKeeper(_Keeper):
    """Hold a run's controller lease (the fence of its checkpoint writes)."""

    kind = "controller lease"

    def __init__(
        self,
        client: Client,
        run_id: str,
        *,
        boot_id: str | None = None,
        ttl_seconds: int = 60,
        on_lost: Callable[[str], None] | None = None,
        renew_fraction: float = 1 / 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            ttl_seconds=ttl_seconds, on_lost=on_lost, renew_fraction=renew_fraction, clock=clock
        )
        self.client = client
        self.run_id = run_id
        if not boot_id:
            import uuid  # with platform, not on the way to the CLI's first request (issue #42)

            boot_id = str(uuid.uuid4())
        self.boot_id = boot_id
        self.lease: ControllerLease | None = None
        self._sent_at: datetime | None = None

    @property
    def generation(self) -> int:
        if self.lease is None:
            raise LeaseLost("not acquired")
        return self.lease.generation

    def owner(self) -> dict[str, Any]:
        """The `owner` object of a checkpoint write."""
        if self.lease is None:
            raise LeaseLost("not acquired")
        return {
            "boot_id": self.boot_id,
            "lease_owner": self.lease.lease_owner,
            "generation": self.lease.generation,
        }

    def _acquire(self) -> float:
        self.lease = self.client.controller_lease_acquire(
            self.run_id, boot_id=self.boot_id, ttl_seconds=self.ttl_seconds
        )
        return float(self.ttl_seconds)

    def _renew(self) -> float:
        owner = self.owner()["lease_owner"]
        try:
            lease = self.client.controller_lease_acquire(
                self.run_id,
                boot_id=self.boot_id,
                lease_owner=owner,
                ttl_seconds=self.ttl_seconds,
            )
        except ConflictError as exc:
            if exc.code == "resource_busy":
                raise
            raise LeaseLost(f"the {self.kind} was refused: {exc.code}") from exc
        if lease.lease_owner != owner or lease.generation != self.generation:
            raise LeaseLost(f"the {self.kind} expired and was minted anew")
        self.lease = lease
        return float(self.ttl_seconds)

    def _client(self) -> Client:
        return self.client

    def _renew_item(self) -> dict[str, Any]:
        return {
            "kind": "controller",
            "run_id": self.run_id,
            "boot_id": self.boot_id,
            "lease_owner": self.owner()["lease_owner"],
            "ttl_seconds": self.ttl_seconds,
        }

    def _renewed(self, renewal: LeaseRenewal) -> float:
        error = renewal.error
        if error is not None:
            if error.code == "resource_busy":
                raise error
            raise LeaseLost(f"the {self.kind} was refused: {error.code}")
        lease = renewal.lease
        if not isinstance(lease, models.ControllerLease) or lease.generation != self.generation:
            raise LeaseLost(f"the {self.kind} expired and was minted anew")
        self.lease = lease
        return float(self.ttl_seconds)

    def _release(self) -> None:
        self.client.controller_lease_expire(
            self.run_id, boot_id=self.boot_id, lease_owner=self.owner()["lease_owner"]
        )
