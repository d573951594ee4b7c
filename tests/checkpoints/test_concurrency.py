"""Racing controllers on separate connections: only the lease holder's writes land."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection

import paperclip.db.locking
from checkpoints.errors import CheckpointOwnerLost, ControllerLeaseHeld
from checkpoints.selectors import checkpoint_load, runner_run_get
from checkpoints.services import (
    CheckpointOwner,
    checkpoint_write,
    controller_lease_acquire,
    controller_leases_expire,
)
from paperclip.db.advisory import dedicated_connection
from paperclip.errors import ResourceBusy
from paperclip.models import ActivityEvent, NativeRunFinalization
from tests.checkpoints.factories import coordinator, expire_lease, lease, owner_of
from tests.helpers import raw_connection, wait_for_lock_waiters

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]


def _write(fin: NativeRunFinalization, owner: CheckpointOwner, changed: dict[str, str]) -> None:
    checkpoint_write(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        owner=owner,
        reset=False,
        changed=changed,
        removed=[],
        work_command_ids=[],
        predecessor=None,
    )


def test_two_controllers_race_for_the_lease_and_only_the_holders_writes_land() -> None:
    """Four controllers acquire at once, forced: a separate connection holds the coordinator
    row (the lock the acquire decides under), all four are seen queued for it, then it lets
    go. One wins; the losers, even presenting the winner's boot and generation, write
    nothing."""
    fin = coordinator()
    boots = [f"boot-{i}" for i in range(4)]

    def controller(boot: str) -> tuple[str, str]:
        try:
            try:
                grant = controller_lease_acquire(
                    run_id=fin.run_id, agent_id=fin.run.agent_id, boot_id=boot
                )
            except ControllerLeaseHeld as held:
                # A loser that presents the holder's boot and generation (the 409 tells it
                # both) with a guessed lease_owner still cannot write: only the token fences.
                holder_boot = str(held.details["controller_boot_id"])
                guess = CheckpointOwner(
                    boot_id=holder_boot,
                    lease_owner=f"{holder_boot}:{held.details['generation']}:guess",
                    generation=int(held.details["generation"]),
                )
                try:
                    _write(fin, guess, {"state": boot})
                except CheckpointOwnerLost:
                    return boot, "lost"
                return boot, "WROTE WITHOUT LEASE"
            _write(fin, owner_of(grant), {"state": boot})
            return boot, "won"
        finally:
            connection.close()

    with raw_connection(autocommit=False) as gate:
        gate.execute(
            "SELECT 1 FROM native_run_finalizations WHERE run_id = %s FOR NO KEY UPDATE",
            [fin.run_id],
        )
        with ThreadPoolExecutor(max_workers=len(boots)) as pool:
            futures = [pool.submit(controller, boot) for boot in boots]
            all_waiting = wait_for_lock_waiters(
                len(boots),
                until=lambda: any(f.done() for f in futures),
                holder=gate,
                table="native_run_finalizations",
            )
            gate.rollback()
            outcomes = dict(f.result(timeout=30) for f in futures)
    assert all_waiting, f"an acquire went past the held coordinator row: {outcomes}"
    winners = [b for b, o in outcomes.items() if o == "won"]
    assert sorted(outcomes.values()) == ["lost"] * 3 + ["won"], outcomes
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_load(binding=binding) == {"state": winners[0]}
    fin.refresh_from_db()
    assert fin.controller_boot_id == winners[0]
    assert fin.controller_generation == 1
    audited = ActivityEvent.objects.filter(run_id=fin.run_id, action="controller_lease.acquired")
    assert audited.count() == 1


def test_a_takeover_fences_the_old_controller_mid_stream() -> None:
    """The old controller keeps writing while a new one takes over: every old write either
    committed before the takeover's or was rejected, so the new controller's value stands."""
    fin = coordinator()
    old = owner_of(lease(fin.run, boot_id="boot-old"))
    _write(fin, old, {"seq": "old-0"})
    started = threading.Event()
    taken_over = threading.Event()

    def old_controller() -> tuple[int, int]:
        """Write until one attempt has been made after the takeover committed."""
        try:
            landed = after_takeover = 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and after_takeover < 3:
                late = taken_over.is_set()
                try:
                    _write(fin, old, {"seq": f"old-{landed}"})
                    landed += 1
                except CheckpointOwnerLost:
                    pass
                after_takeover += late
                started.set()
            return landed, after_takeover
        finally:
            connection.close()

    def new_controller() -> str:
        try:
            assert started.wait(timeout=10)
            expire_lease(fin.run_id)
            new = owner_of(lease(fin.run, boot_id="boot-new"))
            _write(fin, new, {"seq": "new"})
            taken_over.set()
            return new.lease_owner
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        old_f = pool.submit(old_controller)
        new_f = pool.submit(new_controller)
        new_f.result(timeout=30)
        landed, after_takeover = old_f.result(timeout=30)
    assert landed >= 1
    assert after_takeover == 3  # the old controller really kept trying after the takeover
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_load(binding=binding) == {"seq": "new"}


def test_a_writer_blocked_on_the_coordinator_lock_gets_resource_busy(monkeypatch: Any) -> None:
    monkeypatch.setattr(paperclip.db.locking, "HOT_PATH_LOCK_TIMEOUT", "200ms")
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    with dedicated_connection() as other, other.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM native_run_finalizations WHERE run_id = %s FOR UPDATE", [fin.run_id]
        )
        with pytest.raises(ResourceBusy):
            _write(fin, owner, {"a": "1"})
        other.rollback()
    _write(fin, owner, {"a": "2"})
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_load(binding=binding) == {"a": "2"}


def _poll(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_the_fence_samples_the_clock_after_the_lock_wait() -> None:
    """A lease that lapses while the writer waits for the coordinator lock must count as
    lapsed: the time is sampled after the lock is granted, not when the statement started."""
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    with dedicated_connection(autocommit=True) as observer, dedicated_connection() as holder:
        holder.execute(
            "UPDATE native_run_finalizations "
            "SET lease_expires_at = clock_timestamp() + interval '1500 milliseconds' "
            "WHERE run_id = %s",
            [fin.run_id],
        )
        holder.commit()
        holder.execute(
            "SELECT 1 FROM native_run_finalizations WHERE run_id = %s FOR UPDATE", [fin.run_id]
        )
        holder_pid = holder.info.backend_pid
        outcome: list[BaseException | None] = []

        def writer() -> None:
            try:
                _write(fin, owner, {"a": "written while the lease lapsed"})
                outcome.append(None)
            except BaseException as exc:  # handed to the main thread
                outcome.append(exc)
            finally:
                connection.close()

        thread = threading.Thread(target=writer)
        thread.start()

        def writer_waits() -> bool:
            row = observer.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND pid <> %s "
                "AND query LIKE '%%native_run_finalizations%%'",
                [holder_pid],
            ).fetchone()
            return bool(row and row[0])

        assert _poll(writer_waits), "the writer never blocked on the coordinator lock"
        still_live = observer.execute(
            "SELECT lease_expires_at > clock_timestamp() FROM native_run_finalizations "
            "WHERE run_id = %s",
            [fin.run_id],
        ).fetchone()
        assert still_live == (True,), "the lease lapsed before the writer started waiting"

        def lapsed() -> bool:
            row = observer.execute(
                "SELECT lease_expires_at < clock_timestamp() FROM native_run_finalizations "
                "WHERE run_id = %s",
                [fin.run_id],
            ).fetchone()
            return row == (True,)

        assert _poll(lapsed)
        holder.rollback()
        thread.join(timeout=10)
    assert len(outcome) == 1
    assert isinstance(outcome[0], CheckpointOwnerLost), outcome
    assert outcome[0].details["reason"] == "lease_not_held"
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_load(binding=binding) == {}


def test_the_expiry_sweep_skips_a_coordinator_another_transaction_holds() -> None:
    """A sweeper must not queue behind a live writer: a coordinator another transaction holds
    is skipped (a later sweep expires it), the rest of the batch is expired. A sweep that
    waited instead would hit this session's lock timeout and fail."""
    held, free = coordinator(), coordinator()
    for fin in (held, free):
        _write(fin, owner_of(lease(fin.run)), {"a": "1"})
        expire_lease(fin.run_id)
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '5s'")
    try:
        with raw_connection(autocommit=False) as holder:
            holder.execute(
                "SELECT 1 FROM native_run_finalizations WHERE run_id = %s FOR NO KEY UPDATE",
                [held.run_id],
            )
            first = controller_leases_expire(run_ids=[held.run_id, free.run_id])
            holder.rollback()
        second = controller_leases_expire(run_ids=[held.run_id])
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
    assert (first.expired, first.skipped) == ([free.run_id], [held.run_id])
    assert (second.expired, second.skipped) == ([held.run_id], [])
    expired = ActivityEvent.objects.filter(action="controller_lease.expired")
    assert sorted(e.run_id for e in expired) == sorted([held.run_id, free.run_id])
