"""sweep_runtime_leases: batches, dry run, audit, and races with renewals."""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.models.functions import Now

import leases.services.sweep
from leases import services
from leases.models import WorkspaceRuntimeLease
from leases.selectors import runtime_lease_stale_page
from leases.services import runtime_lease_sweep_batch
from paperclip.models import ActivityEvent, HeartbeatRun, Issue
from tests.leases.factories import claim, expire
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
)

EVENT_TIMEOUT = 10


def sweep(*args: str) -> str:
    out = io.StringIO()
    call_command("sweep_runtime_leases", *args, stdout=out)
    return out.getvalue()


def seed(company):
    """Two live leases and five stale ones (three reasons)."""
    agent = AgentFactory(company=company)
    live = [claim(ExecutionWorkspaceFactory(company=company), agent).lease]
    issue = IssueFactory(company=company)
    live.append(claim(ExecutionWorkspaceFactory(company=company), agent, issue_id=issue.pk).lease)
    stale = []
    for _ in range(2):
        ws = ExecutionWorkspaceFactory(company=company)
        stale.append(claim(ws, agent).lease)
        expire(ws)
    for _ in range(2):
        run = HeartbeatRunFactory(company=company, agent=agent)
        stale.append(claim(ExecutionWorkspaceFactory(company=company), agent, run_id=run.pk).lease)
        HeartbeatRun.objects.filter(pk=run.pk).update(status="timed_out")
    done = IssueFactory(company=company)
    stale.append(claim(ExecutionWorkspaceFactory(company=company), agent, issue_id=done.pk).lease)
    Issue.objects.filter(pk=done.pk).update(status="done")
    return live, stale


@pytest.mark.django_db
def test_sweep_deletes_stale_leases_in_batches_and_audits_each(company):
    live, stale = seed(company)

    output = sweep("--batch-size", "2")

    remaining = set(WorkspaceRuntimeLease.objects.values_list("pk", flat=True))
    assert remaining == {lease.id for lease in live}
    lines = output.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["batch 1", "batch 2", "batch 3"]
    assert "deleted 5 stale runtime lease(s) in 3 batch(es)" in output
    assert "  lease_expired: 2" in lines
    assert "  owner_run_terminal: 2" in lines
    assert "  owner_issue_terminal: 1" in lines
    events = ActivityEvent.objects.filter(action="runtime_lease.swept")
    assert events.count() == 5
    assert {(e.actor_type, e.actor_id) for e in events} == {("system", "sweep_runtime_leases")}
    assert {e.details["lease_id"] for e in events} == {str(lease.id) for lease in stale}


def all_lease_rows() -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM execution_workspace_runtime_leases ORDER BY id")
        return cursor.fetchall()


@pytest.mark.django_db
def test_dry_run_changes_nothing(company):
    seed(company)
    before, events_before = all_lease_rows(), ActivityEvent.objects.count()
    output = sweep("--dry-run", "--batch-size", "2")
    assert all_lease_rows() == before  # not one column of one row
    assert ActivityEvent.objects.count() == events_before
    assert [line.split(":")[0] for line in output.splitlines()[:3]] == [
        "batch 1",
        "batch 2",
        "batch 3",
    ]
    assert "Dry run: would delete 5" in output
    assert "  lease_expired: 2" in output.splitlines()


@pytest.mark.django_db
def test_a_swept_workspace_never_gets_an_old_generation_back(company):
    agent = AgentFactory(company=company)
    ws = ExecutionWorkspaceFactory(company=company)
    claim(ws, agent)
    expire(ws)
    assert claim(ws, AgentFactory(company=company)).lease.generation == 2  # reclaim
    expire(ws)
    sweep()
    assert not WorkspaceRuntimeLease.objects.exists()
    assert claim(ws, agent).lease.generation == 3


@pytest.mark.django_db
def test_nothing_to_sweep(company):
    assert "deleted 0 stale runtime lease(s) in 0 batch(es)" in sweep()


@pytest.mark.django_db
def test_bad_batch_size_is_a_command_error():
    with pytest.raises(CommandError):
        sweep("--batch-size", "0")


@pytest.mark.django_db
def test_a_lease_renewed_after_listing_survives_the_recheck(company):
    agent = AgentFactory(company=company)
    ws = ExecutionWorkspaceFactory(company=company)
    claim(ws, agent)
    expire(ws)
    listed = runtime_lease_stale_page(after_id=None, limit=10)
    assert [reason for _, reason in listed] == ["lease_expired"]

    assert claim(ws, agent).outcome == "renewed"
    batch = runtime_lease_sweep_batch(lease_ids=[lease_id for lease_id, _ in listed])

    assert batch.deleted == ()
    assert batch.survived == 1
    assert WorkspaceRuntimeLease.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_sweep_racing_a_real_renew_between_listing_and_locking(monkeypatch):
    """Interleaving: the sweeper lists the expired lease, then the owner renews (and commits)
    through the real service, then the sweeper locks and re-checks: the lease survives."""
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    ws = ExecutionWorkspaceFactory(company=company)
    claim(ws, agent)
    expire(ws)
    listed, renewed = threading.Event(), threading.Event()
    real_page = leases.services.sweep.runtime_lease_stale_page

    def page_then_pause(**kwargs):
        page = real_page(**kwargs)
        if page:
            listed.set()
            assert renewed.wait(EVENT_TIMEOUT)
        return page

    monkeypatch.setattr(leases.services.sweep, "runtime_lease_stale_page", page_then_pause)

    def run_sweep():
        try:
            return services.runtime_lease_sweep(batch_size=10)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(run_sweep)
        assert listed.wait(EVENT_TIMEOUT)
        assert claim(ws, agent).outcome == "renewed"
        renewed.set()
        report = future.result(timeout=EVENT_TIMEOUT)

    assert report.deleted == 0
    assert report.survived == 1
    assert WorkspaceRuntimeLease.objects.filter(execution_workspace=ws).exists()


@pytest.mark.django_db(transaction=True)
def test_sweep_skips_a_lease_whose_renewal_holds_the_row_lock():
    """Interleaving: a renewal transaction has the row locked (not yet committed) while the
    sweep runs: SKIP LOCKED leaves it alone, and after the commit it is live."""
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    ws = ExecutionWorkspaceFactory(company=company)
    claim(ws, agent)
    expire(ws)
    locked, swept = threading.Event(), threading.Event()

    def renew_slowly():
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute(
                        "UPDATE execution_workspace_runtime_leases"
                        " SET expires_at = now() + interval '30 minutes', renewed_at = now()"
                        " WHERE execution_workspace_id = %s",
                        [ws.pk],
                    )
                locked.set()
                assert swept.wait(EVENT_TIMEOUT)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(renew_slowly)
        assert locked.wait(EVENT_TIMEOUT)
        report = services.runtime_lease_sweep(batch_size=10)
        swept.set()
        future.result(timeout=EVENT_TIMEOUT)

    assert report.deleted == 0
    assert report.skipped_locked == 1
    lease = WorkspaceRuntimeLease.objects.get(execution_workspace=ws)
    assert services.runtime_lease_evaluate_stale(lease_id=lease.id) is None


@pytest.mark.django_db
def test_every_owner_stale_lease_is_listed_not_only_the_expired_ones(company):
    """The sweep's listing judges only candidates (`stale_candidate_ids`); every way an
    unexpired lease's owner can be stale must still make it one: a hidden issue, and an owner
    key naming a live issue or run of another company. The live leases beside them are not
    listed."""
    agent = AgentFactory(company=company)
    other = CompanyFactory()

    def held(**owner) -> WorkspaceRuntimeLease:
        lease = claim(ExecutionWorkspaceFactory(company=company), agent, **owner).lease
        return WorkspaceRuntimeLease.objects.get(pk=lease.id)

    held(issue_id=IssueFactory(company=company).pk)
    held(run_id=HeartbeatRunFactory(company=company, agent=agent).pk)
    hidden_issue = IssueFactory(company=company)
    hidden = held(issue_id=hidden_issue.pk)
    Issue.objects.filter(pk=hidden_issue.pk).update(hidden_at=Now())
    foreign_issue = IssueFactory(company=other)
    foreign_run = HeartbeatRunFactory(company=other, agent=AgentFactory(company=other))
    of_foreign_issue = held(issue_id=IssueFactory(company=company).pk)
    of_foreign_run = held(run_id=HeartbeatRunFactory(company=company, agent=agent).pk)
    WorkspaceRuntimeLease.objects.filter(pk=of_foreign_issue.pk).update(
        owner_issue_id=foreign_issue.pk, owner_key=f"issue:{foreign_issue.pk}"
    )
    WorkspaceRuntimeLease.objects.filter(pk=of_foreign_run.pk).update(
        owner_run_id=foreign_run.pk, owner_key=f"run:{foreign_run.pk}"
    )

    assert dict(runtime_lease_stale_page(after_id=None, limit=100)) == {
        hidden.pk: "owner_issue_hidden",
        of_foreign_issue.pk: "owner_issue_missing",
        of_foreign_run.pk: "owner_run_missing",
    }
