"""The owner-stale marker (`WorkspaceRuntimeLease.owner_stale`) that set-wide stale reads list
their candidates by: the database keeps it equal to the live verdict's owner part for every
status of every owner, whatever writes the owner or the lease, and a lease written while its
owner ends is marked whichever of the two commits first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now

from leases.errors import RuntimeLeaseOwnerIneligible
from leases.models import WorkspaceRuntimeLease
from leases.selectors import ELIGIBLE_ISSUE_STATUSES, STALE, stale_candidate_ids
from leases.selectors import with_stale_reason as judged
from leases.services import runtime_lease_sweep
from paperclip.models import HeartbeatRun, Issue
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.leases.factories import claim
from tests.paperclip.factories import (
    AgentFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
)


def marked(lease_id: Any) -> bool:
    return WorkspaceRuntimeLease.objects.values_list("owner_stale", flat=True).get(pk=lease_id)


def owner_verdict(lease_id: Any) -> str | None:
    reason = judged(WorkspaceRuntimeLease.objects.filter(pk=lease_id)).values_list(
        "stale_reason", flat=True
    )[0]
    return None if reason == "lease_expired" else reason


def held(company: Any, agent: Any, **owner: Any) -> Any:
    return claim(ExecutionWorkspaceFactory(company=company), agent, **owner).lease.id


@pytest.mark.django_db
@pytest.mark.parametrize("hidden", [False, True], ids=["shown", "hidden"])
@pytest.mark.parametrize("status", Issue.Status.values)
def test_an_issue_owned_lease_is_marked_exactly_when_its_issue_is_stale(company, status, hidden):
    """Every issue status, shown or hidden: the marker follows the issue there and back, and
    agrees with the live verdict (this pins the trigger's copy of the eligible statuses)."""
    agent = AgentFactory(company=company)
    issue = IssueFactory(company=company)
    lease_id = held(company, agent, issue_id=issue.pk)
    assert marked(lease_id) is False

    Issue.objects.filter(pk=issue.pk).update(status=status, hidden_at=Now() if hidden else None)
    assert marked(lease_id) is (owner_verdict(lease_id) is not None)
    assert marked(lease_id) is (hidden or status not in ELIGIBLE_ISSUE_STATUSES)

    Issue.objects.filter(pk=issue.pk).update(status=Issue.Status.TODO, hidden_at=None)
    assert marked(lease_id) is False


@pytest.mark.django_db
@pytest.mark.parametrize("status", HeartbeatRun.Status.values)
def test_a_run_owned_lease_is_marked_exactly_when_its_run_is_stale(company, status):
    agent = AgentFactory(company=company)
    run = HeartbeatRunFactory(company=company, agent=agent)
    lease_id = held(company, agent, run_id=run.pk)
    assert marked(lease_id) is False

    HeartbeatRun.objects.filter(pk=run.pk).update(status=status)
    assert marked(lease_id) is (owner_verdict(lease_id) is not None)
    assert marked(lease_id) is (status in HeartbeatRun.TERMINAL_STATUSES)


@pytest.mark.django_db
def test_a_deleted_owner_marks_its_leases_and_an_agent_owner_never_does(company):
    agent = AgentFactory(company=company)
    issue = IssueFactory(company=company)
    run = HeartbeatRunFactory(company=company, agent=agent)
    of_issue = held(company, agent, issue_id=issue.pk)
    of_run = held(company, agent, run_id=run.pk)
    of_agent = held(company, agent)

    Issue.objects.filter(pk=issue.pk).delete()  # Django nulls the FK first; the key stays
    HeartbeatRun.objects.filter(pk=run.pk).delete()

    assert (marked(of_issue), marked(of_run), marked(of_agent)) == (True, True, False)
    assert owner_verdict(of_issue) == "owner_issue_missing"
    assert owner_verdict(of_run) == "owner_run_missing"


@pytest.mark.django_db
def test_the_marker_cannot_be_written_by_hand(company):
    """Any write of the column is recomputed: a stale Python instance saved back, or an
    update naming the column, leaves the truth."""
    agent = AgentFactory(company=company)
    live_issue, done_issue = IssueFactory(company=company), IssueFactory(company=company)
    live = held(company, agent, issue_id=live_issue.pk)
    stale = held(company, agent, issue_id=done_issue.pk)
    instance = WorkspaceRuntimeLease.objects.get(pk=stale)  # loaded while live: False
    Issue.objects.filter(pk=done_issue.pk).update(status=Issue.Status.DONE)

    WorkspaceRuntimeLease.objects.filter(pk=live).update(owner_stale=True)
    instance.save()
    WorkspaceRuntimeLease.objects.filter(pk=stale).update(owner_stale=False)

    assert (marked(live), marked(stale)) == (False, True)


@pytest.mark.django_db
def test_a_reclaim_and_a_renew_with_a_new_run_keep_the_marker_right(company):
    agent = AgentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)
    ended = HeartbeatRunFactory(company=company, agent=agent)
    lease_id = claim(workspace, agent, run_id=ended.pk).lease.id
    HeartbeatRun.objects.filter(pk=ended.pk).update(status="failed")
    assert marked(lease_id) is True

    issue = IssueFactory(company=company)
    reclaimed = claim(workspace, agent, issue_id=issue.pk)
    assert reclaimed.outcome == "reclaimed"
    assert marked(lease_id) is False
    renewed = claim(
        workspace,
        agent,
        issue_id=issue.pk,
        run_id=HeartbeatRunFactory(company=company, agent=agent).pk,
    )
    assert renewed.outcome == "renewed"
    assert marked(lease_id) is False


def _insert_lease(conn: Any, *, company_id: Any, workspace_id: Any, issue_id: Any) -> None:
    conn.execute(
        "INSERT INTO execution_workspace_runtime_leases (id, company_id, execution_workspace_id,"
        " owner_key, owner_issue_id, last_action, generation, claimed_at, renewed_at,"
        " expires_at, created_at, updated_at) VALUES (gen_random_uuid(), %s, %s, %s, %s,"
        " 'start', 1, now(), now(), now() + interval '10 minutes', now(), now())",
        [company_id, workspace_id, f"issue:{issue_id}", issue_id],
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["lease", "issue"])
def test_a_lease_written_while_its_issue_ends_is_marked_whichever_commits_first(company, first):
    """Two connections: one inserts a lease of issue X, the other moves X to done; the
    first to write holds its transaction open while the second writes. Without the lease
    trigger's FOR SHARE on X, neither side sees the other's row (the insert judged X live,
    the issue's trigger did not see the uncommitted lease) and the lease stays unmarked:
    stale, yet no sweep or dashboard would list it."""
    issue = IssueFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)

    def write_lease(conn: Any) -> None:
        _insert_lease(conn, company_id=company.pk, workspace_id=workspace.pk, issue_id=issue.pk)

    def end_issue(conn: Any) -> None:
        conn.execute("UPDATE issues SET status = 'done' WHERE id = %s", [issue.pk])

    writes = {"lease": write_lease, "issue": end_issue}
    second = "issue" if first == "lease" else "lease"
    with (
        raw_connection(autocommit=False) as holder,
        raw_connection() as contender,
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        writes[first](holder)
        written = pool.submit(writes[second], contender)
        # Either the second write queues behind the first (the lock works) or it finished.
        wait_for_lock_waiters(until=written.done)
        holder.commit()
        written.result(timeout=30)
    lease = WorkspaceRuntimeLease.objects.get(execution_workspace=workspace)
    assert owner_verdict(lease.pk) == "owner_issue_terminal"
    assert lease.owner_stale is True
    assert lease.pk in set(stale_candidate_ids())


@pytest.mark.django_db(transaction=True)
def test_claims_racing_their_issue_to_done_are_all_swept(company):
    """Eight claims of one issue's workspaces through the real service while the board's move
    of the issue to done is written but not yet committed (a separate connection holds it):
    each claim's eligibility check still reads the issue as live, so only the lease trigger's
    FOR SHARE on the issue row orders the claim after the board. Every claim is seen queued
    behind the board's row lock; once the board commits, every lease that exists is stale by
    the verdict, marked, and swept. Without the FOR SHARE the claims do not queue and their
    leases stay unmarked: the test fails on every run, not by luck."""
    agent = AgentFactory(company=company)
    issue = IssueFactory(company=company)
    workspaces = [ExecutionWorkspaceFactory(company=company) for _ in range(8)]

    def claimant(workspace: Any) -> str:
        try:
            claim(workspace, agent, issue_id=issue.pk)
            return "claimed"
        except RuntimeLeaseOwnerIneligible:
            return "refused"  # refused once the issue is done: fine
        finally:
            connection.close()

    with (
        raw_connection(autocommit=False) as board,
        ThreadPoolExecutor(max_workers=len(workspaces)) as pool,
    ):
        board.execute("UPDATE issues SET status = 'done' WHERE id = %s", [issue.pk])
        futures = [pool.submit(claimant, workspace) for workspace in workspaces]
        queued = wait_for_lock_waiters(
            len(workspaces),
            until=lambda: any(f.done() for f in futures),
            holder=board,
            table="issues",
        )
        board.commit()
        outcomes = [future.result(timeout=60) for future in futures]  # re-raises
    assert queued, f"a claim went past the board's uncommitted change: {outcomes}"

    leases = set(WorkspaceRuntimeLease.objects.values_list("pk", flat=True))
    assert len(leases) == outcomes.count("claimed")
    stale = judged(WorkspaceRuntimeLease.objects.all()).filter(**STALE)
    assert set(stale.values_list("pk", flat=True)) == leases
    marked_ids = WorkspaceRuntimeLease.objects.filter(owner_stale=True).values_list("pk", flat=True)
    assert set(marked_ids) == leases
    assert runtime_lease_sweep().deleted == len(leases)
