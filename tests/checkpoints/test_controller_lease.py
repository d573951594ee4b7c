"""The controller lease: acquire, renew, held, takeover, failure hook."""

from __future__ import annotations

import pytest

from checkpoints.errors import (
    ControllerLeaseHeld,
    ControllerLeaseRunNotNative,
    ControllerLeaseRunTerminal,
)
from checkpoints.services import controller_lease_acquire, controller_lease_expire_on_failure
from paperclip.errors import InvalidRequest, PermissionDenied
from paperclip.models import ActivityEvent, HeartbeatRun, NativeRunFinalization
from tests.checkpoints.factories import coordinator, expire_lease, lease
from tests.paperclip.factories import (
    AgentFactory,
    HeartbeatRunFactory,
    NativeRunFactory,
    NativeRunResultFactory,
)

pytestmark = pytest.mark.django_db


def audit_actions(run_id: object) -> list[str]:
    return list(
        ActivityEvent.objects.filter(run_id=run_id)
        .order_by("created_at")
        .values_list("action", flat=True)
    )


def test_first_acquire_mints_generation_one_owner_and_audits() -> None:
    fin = coordinator()
    grant = lease(fin.run, boot_id="boot-a")
    assert grant.outcome == "acquired"
    assert grant.generation == 1
    boot, gen, token = grant.lease_owner.split(":")
    assert (boot, gen) == ("boot-a", "1")
    assert len(token) == 36
    fin.refresh_from_db()
    assert fin.lease_owner == grant.lease_owner
    assert fin.controller_boot_id == "boot-a"
    assert fin.controller_generation == 1
    assert fin.lease_expires_at == grant.lease_expires_at
    assert audit_actions(fin.run_id) == ["controller_lease.acquired"]


def test_renew_by_current_owner_keeps_generation_extends_expiry_and_is_not_audited() -> None:
    fin = coordinator()
    first = lease(fin.run, ttl_seconds=10)
    renewed = controller_lease_acquire(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        boot_id="boot-a",
        lease_owner=first.lease_owner,
        ttl_seconds=600,
    )
    assert renewed.outcome == "renewed"
    assert (renewed.lease_owner, renewed.generation) == (first.lease_owner, first.generation)
    assert renewed.lease_expires_at > first.lease_expires_at
    assert audit_actions(fin.run_id) == ["controller_lease.acquired"]


@pytest.mark.parametrize("presented", ["none", "wrong_owner", "other_boot_same_owner"])
def test_unexpired_lease_is_held_against_everyone_else(presented: str) -> None:
    fin = coordinator()
    first = lease(fin.run)
    boot, owner = {
        "none": ("boot-b", None),
        "wrong_owner": ("boot-a", "boot-a:1:not-the-token"),
        "other_boot_same_owner": ("boot-b", first.lease_owner),
    }[presented]
    with pytest.raises(ControllerLeaseHeld) as exc:
        controller_lease_acquire(
            run_id=fin.run_id, agent_id=fin.run.agent_id, boot_id=boot, lease_owner=owner
        )
    assert exc.value.details["generation"] == 1
    assert "lease_owner" not in exc.value.details  # the fencing token never leaks
    fin.refresh_from_db()
    assert fin.lease_owner == first.lease_owner


def test_expired_lease_is_taken_over_with_next_generation_even_by_its_old_owner() -> None:
    fin = coordinator()
    first = lease(fin.run, boot_id="boot-a")
    expire_lease(fin.run_id)
    # Presenting the expired token does not renew it: the lease lapsed, so a new owner is minted.
    again = controller_lease_acquire(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        boot_id="boot-a",
        lease_owner=first.lease_owner,
    )
    assert again.outcome == "taken_over"
    assert again.generation == 2
    assert again.lease_owner != first.lease_owner
    expire_lease(fin.run_id)
    third = lease(fin.run, boot_id="boot-b")
    assert (third.generation, third.controller_boot_id) == (3, "boot-b")
    assert third.lease_owner.startswith("boot-b:3:")
    assert audit_actions(fin.run_id) == [
        "controller_lease.acquired",
        "controller_lease.taken_over",
        "controller_lease.taken_over",
    ]


def test_missing_coordinator_is_created_for_a_native_run() -> None:
    run = NativeRunFactory()
    assert not NativeRunFinalization.objects.filter(run=run).exists()
    grant = lease(run)
    fin = NativeRunFinalization.objects.get(run=run)
    assert fin.phase == "observed"
    assert (fin.company_id, fin.issue_id) == (run.company_id, run.native_issue_id)
    assert fin.lease_owner == grant.lease_owner
    event = ActivityEvent.objects.get(run=run)
    assert event.details["coordinatorCreated"] is True


def test_legacy_run_has_no_controller_lease() -> None:
    run = HeartbeatRunFactory()
    with pytest.raises(ControllerLeaseRunNotNative):
        lease(run)
    assert not NativeRunFinalization.objects.filter(run=run).exists()
    assert not ActivityEvent.objects.filter(run=run).exists()


def test_terminal_run_cannot_be_leased_and_nothing_is_created() -> None:
    run = NativeRunFactory(status=HeartbeatRun.Status.SUCCEEDED)
    with pytest.raises(ControllerLeaseRunTerminal):
        lease(run)
    assert not NativeRunFinalization.objects.filter(run=run).exists()


def test_only_the_runs_agent_may_lease_it() -> None:
    fin = coordinator()
    stranger = AgentFactory(company=fin.company)
    with pytest.raises(PermissionDenied):
        controller_lease_acquire(run_id=fin.run_id, agent_id=stranger.pk, boot_id="boot-x")


@pytest.mark.parametrize("ttl", [9, 3601])
def test_ttl_bounds(ttl: int) -> None:
    fin = coordinator()
    with pytest.raises(InvalidRequest):
        lease(fin.run, ttl_seconds=ttl)


def test_failure_hook_expires_only_the_same_boot_and_owner_without_result() -> None:
    fin = coordinator()
    grant = lease(fin.run, boot_id="boot-a")
    agent_id = fin.run.agent_id
    # Wrong owner or wrong boot: nothing happens.
    assert not controller_lease_expire_on_failure(
        run_id=fin.run_id, agent_id=agent_id, boot_id="boot-a", lease_owner="boot-a:1:other"
    )
    assert not controller_lease_expire_on_failure(
        run_id=fin.run_id, agent_id=agent_id, boot_id="boot-b", lease_owner=grant.lease_owner
    )
    fin.refresh_from_db()
    before = fin.lease_expires_at
    assert fin.lease_owner == grant.lease_owner
    # The holder: the lease ends now, so the next acquire is a takeover.
    assert controller_lease_expire_on_failure(
        run_id=fin.run_id, agent_id=agent_id, boot_id="boot-a", lease_owner=grant.lease_owner
    )
    fin.refresh_from_db()
    assert fin.lease_expires_at < before
    assert "controller_lease.expired_on_failure" in audit_actions(fin.run_id)
    # Already expired: a second hook changes nothing.
    assert not controller_lease_expire_on_failure(
        run_id=fin.run_id, agent_id=agent_id, boot_id="boot-a", lease_owner=grant.lease_owner
    )
    assert lease(fin.run, boot_id="boot-b").outcome == "taken_over"


def test_failure_hook_leaves_a_run_with_a_result_alone() -> None:
    fin = coordinator()
    grant = lease(fin.run)
    fin.result = NativeRunResultFactory(run=fin.run)
    fin.save(update_fields=["result"])
    assert not controller_lease_expire_on_failure(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        boot_id="boot-a",
        lease_owner=grant.lease_owner,
    )
    fin.refresh_from_db()
    assert fin.lease_expires_at == grant.lease_expires_at


def test_a_late_failure_hook_from_the_old_controller_does_not_cut_its_successors_lease() -> None:
    fin = coordinator()
    old = lease(fin.run, boot_id="boot-a")
    expire_lease(fin.run_id)
    new = lease(fin.run, boot_id="boot-b")
    assert not controller_lease_expire_on_failure(
        run_id=fin.run_id, agent_id=fin.run.agent_id, boot_id="boot-a", lease_owner=old.lease_owner
    )
    fin.refresh_from_db()
    assert fin.lease_owner == new.lease_owner
    assert fin.lease_expires_at == new.lease_expires_at
