"""The expiry floor (leases/migrations/0005_expiry_floor.py, docs/data-model.md#expiry-floor):
a renew is an in-place (HOT) update that writes none of the lease table's indexes; the floor
never rises above `expires_at`, whoever writes the row; the sweep moves live leases' floors up
without waiting for a row a renew holds; and the expired leases are still all found."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Now

from leases.models import WorkspaceRuntimeLease
from leases.selectors import stale_candidate_ids
from leases.services import runtime_lease_sweep
from leases.services.batch_renew import RuntimeRenewItem, runtime_leases_renew
from leases.services.sweep import runtime_lease_floors_raise
from paperclip.models import Agent, Company
from tests.leases.factories import claim, expire
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory

TABLE = "execution_workspace_runtime_leases"


def updates_in_this_transaction() -> tuple[int, int]:
    """(rows updated, of them in place) in the lease table by this transaction so far."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_stat_get_xact_tuples_updated(%s::regclass),"
            " pg_stat_get_xact_tuples_hot_updated(%s::regclass)",
            [TABLE, TABLE],
        )
        updated, hot = cursor.fetchone()
    return int(updated), int(hot)


def floors() -> dict[Any, tuple[Any, Any]]:
    return {
        row[0]: (row[1], row[2])
        for row in WorkspaceRuntimeLease.objects.values_list(
            "execution_workspace_id", "expiry_floor", "expires_at"
        )
    }


def raise_floor_without_triggers(lease_id: Any) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute(
            f"UPDATE {TABLE} SET expiry_floor = expires_at + interval '1 second'"  # noqa: S608
            " WHERE id = %s",
            [lease_id],
        )


def leases(company: Company, agent: Agent, count: int, ttl: int | None = None) -> list[Any]:
    return [
        claim(ExecutionWorkspaceFactory(company=company), agent, ttl_seconds=ttl).lease
        for _ in range(count)
    ]


@pytest.mark.django_db
def test_a_renew_is_an_in_place_update_and_leaves_the_floor(company: Company) -> None:
    agent = AgentFactory(company=company)
    held = leases(company, agent, 5, ttl=600)
    before = floors()
    updated, hot = updates_in_this_transaction()

    workspace = ExecutionWorkspaceFactory.build(pk=held[0].execution_workspace_id, company=company)
    # A longer TTL than the claim's: `now()` is the test transaction's start, so the same
    # TTL would write the same expiry, and an unchanged indexed value allows HOT anyway.
    assert claim(workspace, agent, ttl_seconds=900).outcome == "renewed"
    answers = runtime_leases_renew(
        company_id=company.pk,
        agent_id=agent.pk,
        items=[
            RuntimeRenewItem(lease.execution_workspace_id, generation=1, ttl_seconds=900)
            for lease in held
        ],
    )
    assert all(isinstance(answer, str) for answer in answers)

    # Six rows renewed (one, then five in a batch), every one of them in place: no index of
    # the table got a new entry.
    assert updates_in_this_transaction() == (updated + 6, hot + 6)
    after = floors()
    for workspace_id, (floor, expires_at) in after.items():
        assert floor == before[workspace_id][0]  # the renew left the floor alone
        assert expires_at == before[workspace_id][1] + timedelta(seconds=300)


@pytest.mark.django_db
def test_the_floor_never_rises_above_the_expiry(company: Company) -> None:
    agent = AgentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)
    lease = claim(workspace, agent, ttl_seconds=600).lease
    row = WorkspaceRuntimeLease.objects.get(pk=lease.id)
    assert row.expiry_floor == row.expires_at  # an insert starts the floor at the expiry

    claim(workspace, agent, ttl_seconds=120)  # a renew with a shorter TTL
    row.refresh_from_db()
    assert row.expiry_floor == row.expires_at

    expire(workspace, seconds_ago=30)  # SQL by hand pushing the expiry into the past
    row.refresh_from_db()
    assert row.expiry_floor == row.expires_at < row.renewed_at

    # Raising the floor above the expiry by hand brings it back to the expiry.
    WorkspaceRuntimeLease.objects.filter(pk=lease.id).update(expiry_floor=Now() + timedelta(days=1))
    row.refresh_from_db()
    assert row.expiry_floor == row.expires_at

    # And the CHECK holds even for a writer that disables the triggers' work.
    with pytest.raises(IntegrityError):
        raise_floor_without_triggers(lease.id)


@pytest.mark.django_db
def test_the_sweep_raises_live_floors_and_finds_every_expired_lease(company: Company) -> None:
    agent = AgentFactory(company=company)
    live, expired = leases(company, agent, 3), leases(company, agent, 2)
    for lease in expired:
        expire(ExecutionWorkspaceFactory.build(pk=lease.execution_workspace_id, company=company))
    # Floors that have passed while their leases were renewed (as after a long quiet time).
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {TABLE} SET expiry_floor = now() - interval '1 hour'"  # noqa: S608
            " WHERE id = ANY(%s)",
            [[lease.id for lease in live]],
        )
    assert set(stale_candidate_ids()) == {lease.id for lease in expired}

    report = runtime_lease_sweep()
    assert report.floors_raised == 3
    assert report.deleted == 2
    for floor, expires_at in floors().values():
        assert floor == expires_at
    assert runtime_lease_floors_raise() == 0  # nothing left to move: a repeat writes nothing


@pytest.mark.django_db(transaction=True)
def test_raising_floors_skips_a_row_a_renew_holds(company: Company) -> None:
    """A renew holding its row is never waited for: its floor moves at the next sweep."""
    agent = AgentFactory(company=company)
    held, _free = leases(company, agent, 2)
    WorkspaceRuntimeLease.objects.update(expiry_floor=Now() - timedelta(hours=1))
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic():
                WorkspaceRuntimeLease.objects.select_for_update(no_key=True).get(pk=held.id)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        assert runtime_lease_floors_raise() == 1  # the free one; the held one skipped at once
    finally:
        release.set()
        holder.join()
    assert runtime_lease_floors_raise() == 1  # the held one, now free
