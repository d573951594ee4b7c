"""runtime_lease_claim: every outcome, every stale reason, the conflict details, generations."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from leases.errors import RuntimeLeaseConflict
from leases.models import WorkspaceRuntimeLease
from leases.services import (
    RuntimeLeaseOwner,
    runtime_lease_claim,
    runtime_lease_evaluate_stale,
    runtime_lease_force_release,
    runtime_lease_get,
    runtime_lease_release,
)
from paperclip.errors import DomainError
from paperclip.models import ActivityEvent, ExecutionWorkspace, HeartbeatRun, Issue
from tests.leases.factories import claim, expire, lease_row
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
    UserFactory,
)

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def actions(workspace: ExecutionWorkspace) -> list[str]:
    return list(
        ActivityEvent.objects.filter(entity_id=str(workspace.pk))
        .order_by("created_at", "id")
        .values_list("action", flat=True)
    )


def test_first_claim_creates_the_lease_with_generation_1(workspace, agent):
    issue = IssueFactory(company=workspace.company)

    result = claim(workspace, agent, issue_id=issue.pk, action="start", ttl_seconds=120)

    assert result.outcome == "created"
    assert result.owner_key == f"issue:{issue.pk}"
    assert result.reclaimed_from is None
    lease = result.lease
    assert lease is not None
    assert lease.generation == 1
    assert lease.owner_issue_id == issue.pk
    assert lease.owner_agent_id == agent.pk
    assert lease.owner_run_id is None
    assert lease.last_action == "start"
    assert lease.claimed_at == lease.renewed_at
    assert lease.expires_at - lease.claimed_at == timedelta(seconds=120)
    workspace.refresh_from_db()
    assert workspace.runtime_lease_generation == 1
    assert WorkspaceRuntimeLease.objects.count() == 1
    event = ActivityEvent.objects.get(action="runtime_lease.created")
    assert event.actor_type == "agent"
    assert event.actor_id == str(agent.pk)
    assert event.details["generation"] == 1


def test_default_ttl_comes_from_settings(workspace, agent, settings):
    # Not the shipped default (1800), so a hard-coded 30 minutes would fail here.
    settings.PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS = 420
    lease = claim(workspace, agent).lease
    assert lease.expires_at - lease.claimed_at == timedelta(seconds=420)
    renewed = claim(workspace, agent).lease  # the renew fast path uses it too
    assert renewed.expires_at - renewed.renewed_at == timedelta(seconds=420)


def test_owner_key_prefers_issue_then_run_then_agent(workspace, agent):
    issue = IssueFactory(company=workspace.company)
    run = HeartbeatRunFactory(company=workspace.company, agent=agent)
    owner = RuntimeLeaseOwner.for_agent
    assert owner(agent.pk, run_id=run.pk, issue_id=issue.pk).owner_key == f"issue:{issue.pk}"
    assert owner(agent.pk, run_id=run.pk).owner_key == f"run:{run.pk}"
    assert owner(agent.pk).owner_key == f"agent:{agent.pk}"
    assert RuntimeLeaseOwner("agent", "x").owner_key is None


def test_same_owner_renews_keeping_claimed_at_and_generation(workspace, agent):
    issue = IssueFactory(company=workspace.company)
    first_run = HeartbeatRunFactory(company=workspace.company, agent=agent)
    second_run = HeartbeatRunFactory(company=workspace.company, agent=agent)
    created = claim(workspace, agent, issue_id=issue.pk, run_id=first_run.pk, ttl_seconds=60)
    expire(workspace)  # even an expired lease is renewed by its own owner

    renewed = claim(
        workspace, agent, issue_id=issue.pk, run_id=second_run.pk, action="restart", ttl_seconds=600
    )

    assert renewed.outcome == "renewed"
    assert renewed.lease.id == created.lease.id
    assert renewed.lease.generation == created.lease.generation == 1
    assert renewed.lease.claimed_at == created.lease.claimed_at
    assert renewed.lease.owner_run_id == second_run.pk  # owner columns follow the new run
    assert renewed.lease.last_action == "restart"
    assert renewed.lease.expires_at > timezone.now() + timedelta(seconds=500)
    assert actions(workspace) == ["runtime_lease.created"]  # renews are not audited


def test_live_owner_gets_conflict_with_full_details_and_row_untouched(workspace, agent):
    issue = IssueFactory(company=workspace.company)
    run = HeartbeatRunFactory(company=workspace.company, agent=agent)
    claim(workspace, agent, issue_id=issue.pk, run_id=run.pk)
    before = lease_row(workspace)
    rival = AgentFactory(company=workspace.company)
    rival_issue = IssueFactory(company=workspace.company)

    with pytest.raises(RuntimeLeaseConflict) as caught:
        claim(workspace, rival, issue_id=rival_issue.pk, action="repair")

    lease = runtime_lease_get(execution_workspace_id=workspace.pk).lease
    iso = lambda dt: dt.astimezone(timezone.UTC).isoformat().replace("+00:00", "Z")  # noqa: E731
    assert caught.value.code == "workspace_runtime_lease_conflict"
    assert caught.value.details == {
        "execution_workspace_id": str(workspace.pk),
        "requested_action": "repair",
        "requested_owner_key": f"issue:{rival_issue.pk}",
        "owner_key": f"issue:{issue.pk}",
        "owner_issue_id": str(issue.pk),
        "owner_run_id": str(run.pk),
        "owner_agent_id": str(agent.pk),
        "last_action": "start",
        "claimed_at": iso(lease.claimed_at),
        "renewed_at": iso(lease.renewed_at),
        "expires_at": iso(lease.expires_at),
        "generation": 1,
    }
    assert caught.value.remediation_text
    assert lease_row(workspace) == before
    workspace.refresh_from_db()
    assert workspace.runtime_lease_generation == 1


def test_agent_only_owner_is_recovered_only_by_ttl(workspace, agent):
    claim(workspace, agent)  # owner key agent:<id>
    rival = AgentFactory(company=workspace.company)
    with pytest.raises(RuntimeLeaseConflict):
        claim(workspace, rival)
    lease = runtime_lease_get(execution_workspace_id=workspace.pk)
    assert lease.stale_reason is None

    expire(workspace)
    result = claim(workspace, rival)

    assert result.outcome == "reclaimed"
    assert result.reclaimed_from.reason == "lease_expired"
    assert result.reclaimed_from.owner_key == f"agent:{agent.pk}"


@pytest.mark.parametrize(
    ("reason", "stale"),
    [
        (
            "owner_issue_hidden",
            lambda issue: Issue.objects.filter(pk=issue.pk).update(hidden_at=timezone.now()),
        ),
        (
            "owner_issue_terminal",
            lambda issue: Issue.objects.filter(pk=issue.pk).update(status="done"),
        ),
        (
            "owner_issue_terminal",
            lambda issue: Issue.objects.filter(pk=issue.pk).update(status="cancelled"),
        ),
        ("owner_issue_missing", lambda issue: Issue.objects.filter(pk=issue.pk).delete()),
    ],
)
def test_stale_issue_owner_is_reclaimed_in_place(workspace, agent, reason, stale):
    issue = IssueFactory(company=workspace.company)
    created = claim(workspace, agent, issue_id=issue.pk)
    stale(issue)
    if reason == "owner_issue_missing":
        # The FK was nulled by the delete; the owner key still names the issue.
        row = lease_row(workspace)
        assert row["owner_issue_id"] is None
        assert row["owner_key"] == f"issue:{issue.pk}"
    assert runtime_lease_get(execution_workspace_id=workspace.pk).stale_reason == reason
    rival = AgentFactory(company=workspace.company)

    result = claim(workspace, rival, action="repair")

    assert result.outcome == "reclaimed"
    assert result.owner_key == f"agent:{rival.pk}"
    assert result.reclaimed_from.owner_key == f"issue:{issue.pk}"
    assert result.reclaimed_from.reason == reason
    lease = result.lease
    assert lease.id == created.lease.id  # updated in place
    assert lease.generation == 2
    assert lease.claimed_at >= created.lease.claimed_at
    assert lease.owner_agent_id == rival.pk
    assert lease.owner_issue_id is None
    assert lease.last_action == "repair"
    assert lease.metadata["reclaimedFromOwnerKey"] == f"issue:{issue.pk}"
    assert lease.metadata["reclaimReason"] == reason
    assert lease.metadata["reclaimedAt"].endswith("Z")
    event = ActivityEvent.objects.get(action="runtime_lease.reclaimed")
    assert event.details["reason"] == reason
    assert event.details["reclaimed_from_generation"] == 1
    assert event.actor_id == str(rival.pk)


@pytest.mark.parametrize(
    ("reason", "stale"),
    [
        (
            "owner_run_terminal",
            lambda run: HeartbeatRun.objects.filter(pk=run.pk).update(status="failed"),
        ),
        (
            "owner_run_terminal",
            lambda run: HeartbeatRun.objects.filter(pk=run.pk).update(status="interrupted"),
        ),
        ("owner_run_missing", lambda run: HeartbeatRun.objects.filter(pk=run.pk).delete()),
    ],
)
def test_stale_run_owner_is_reclaimed(workspace, agent, reason, stale):
    run = HeartbeatRunFactory(company=workspace.company, agent=agent)
    claim(workspace, agent, run_id=run.pk)
    stale(run)
    rival = AgentFactory(company=workspace.company)

    result = claim(workspace, rival)

    assert result.outcome == "reclaimed"
    assert result.reclaimed_from.reason == reason
    assert result.reclaimed_from.owner_key == f"run:{run.pk}"
    assert result.lease.generation == 2


def test_expiry_is_checked_before_the_owner_lifecycle(workspace, agent):
    issue = IssueFactory(company=workspace.company)
    claim(workspace, agent, issue_id=issue.pk)
    Issue.objects.filter(pk=issue.pk).update(status="done")
    expire(workspace)
    assert runtime_lease_get(execution_workspace_id=workspace.pk).stale_reason == "lease_expired"


def test_live_run_and_issue_owners_are_not_stale(workspace, agent):
    run = HeartbeatRunFactory(company=workspace.company, agent=agent, status="queued")
    created = claim(workspace, agent, run_id=run.pk)
    assert runtime_lease_evaluate_stale(lease_id=created.lease.id) is None
    for status in ("backlog", "todo", "in_progress", "in_review", "blocked"):
        other = ExecutionWorkspaceFactory(company=workspace.company)
        issue = IssueFactory(company=workspace.company, status=status)
        lease = claim(other, agent, issue_id=issue.pk).lease
        assert runtime_lease_evaluate_stale(lease_id=lease.id) is None, status


def test_owner_is_looked_up_inside_the_lease_company(workspace, agent, other_company):
    # A lease naming an issue or run id that exists only in another company reads as missing
    # (the foreign rows are live, so a lookup that ignored the company would say "not stale").
    foreign_issue = IssueFactory(company=other_company, status="in_progress")
    foreign_run = HeartbeatRunFactory(company=other_company, status="running")
    lease = claim(workspace, agent).lease
    WorkspaceRuntimeLease.objects.filter(pk=lease.id).update(owner_key=f"issue:{foreign_issue.pk}")
    assert runtime_lease_evaluate_stale(lease_id=lease.id) == "owner_issue_missing"
    WorkspaceRuntimeLease.objects.filter(pk=lease.id).update(owner_key=f"run:{foreign_run.pk}")
    assert runtime_lease_evaluate_stale(lease_id=lease.id) == "owner_run_missing"


def test_malformed_owner_key_reads_as_missing_owner_not_an_error(workspace, agent):
    lease = claim(workspace, agent).lease
    WorkspaceRuntimeLease.objects.filter(pk=lease.id).update(owner_key="issue:not-a-uuid")
    assert runtime_lease_evaluate_stale(lease_id=lease.id) == "owner_issue_missing"
    WorkspaceRuntimeLease.objects.filter(pk=lease.id).update(owner_key="weird")
    assert runtime_lease_evaluate_stale(lease_id=lease.id) is None  # TTL only


def test_board_claim_is_bypassed_and_audited(workspace, agent):
    claim(workspace, agent)
    user = UserFactory()

    result = runtime_lease_claim(
        company_id=workspace.company_id,
        execution_workspace_id=workspace.pk,
        action="stop",
        owner=RuntimeLeaseOwner.for_board(user.pk),
    )

    assert result.outcome == "bypassed"
    assert result.owner_key is None
    assert result.lease is None
    assert result.reclaimed_from is None
    assert runtime_lease_get(execution_workspace_id=workspace.pk).lease.owner_key == (
        f"agent:{agent.pk}"
    )
    event = ActivityEvent.objects.get(action="runtime_lease.bypassed")
    assert (event.actor_type, event.actor_id) == ("user", str(user.pk))


def test_owner_without_any_id_is_bypassed(workspace):
    result = runtime_lease_claim(
        company_id=workspace.company_id,
        execution_workspace_id=workspace.pk,
        action="start",
        owner=RuntimeLeaseOwner("agent", "keyless"),
    )
    assert result.outcome == "bypassed"
    assert WorkspaceRuntimeLease.objects.count() == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"action": "destroy"}, "action"),
        ({"ttl_seconds": 59}, "ttl_seconds"),
        ({"ttl_seconds": 86_401}, "ttl_seconds"),
        ({"ttl_seconds": True}, "ttl_seconds"),
    ],
)
def test_invalid_input_is_rejected_and_changes_nothing(workspace, agent, kwargs, field):
    with pytest.raises(DomainError) as caught:
        claim(workspace, agent, **kwargs)
    assert caught.value.code == "invalid_request"
    assert field in caught.value.details["fields"]
    assert WorkspaceRuntimeLease.objects.count() == 0
    assert ActivityEvent.objects.count() == 0


def test_ttl_bounds_are_inclusive(workspace, agent):
    assert claim(workspace, agent, ttl_seconds=60).outcome == "created"
    assert claim(workspace, agent, ttl_seconds=86_400).outcome == "renewed"


def test_foreign_references_are_not_found_or_forbidden(workspace, agent, other_company):
    other_agent = AgentFactory(company=workspace.company)
    cases = [
        ({"issue_id": IssueFactory(company=other_company).pk}, "not_found"),
        ({"issue_id": uuid.uuid4()}, "not_found"),
        ({"run_id": HeartbeatRunFactory(company=other_company).pk}, "not_found"),
        (
            {"run_id": HeartbeatRunFactory(company=workspace.company, agent=other_agent).pk},
            "permission_denied",
        ),
    ]
    for kwargs, code in cases:
        with pytest.raises(DomainError) as caught:
            claim(workspace, agent, **kwargs)
        assert caught.value.code == code, kwargs
    foreign_ws = ExecutionWorkspaceFactory(company=other_company)
    with pytest.raises(DomainError) as caught:
        runtime_lease_claim(
            company_id=workspace.company_id,
            execution_workspace_id=foreign_ws.pk,
            action="start",
            owner=RuntimeLeaseOwner.for_agent(agent.pk),
        )
    assert caught.value.code == "not_found"
    assert WorkspaceRuntimeLease.objects.count() == 0


def test_generation_is_monotonic_across_create_reclaim_release_and_recreate(workspace, agent):
    rival = AgentFactory(company=workspace.company)
    assert claim(workspace, agent).lease.generation == 1
    assert claim(workspace, agent).lease.generation == 1  # renew keeps it
    expire(workspace)
    assert claim(workspace, rival).lease.generation == 2  # reclaim
    owner = RuntimeLeaseOwner.for_agent(rival.pk)
    released = runtime_lease_release(
        company_id=workspace.company_id, execution_workspace_id=workspace.pk, owner=owner
    )
    assert released.released
    assert claim(workspace, agent).lease.generation == 3  # re-create never reuses 1 or 2
    runtime_lease_force_release(
        company_id=workspace.company_id,
        execution_workspace_id=workspace.pk,
        actor_type="user",
        actor_id="op",
        reason="wedged",
    )
    assert claim(workspace, rival).lease.generation == 4
    workspace.refresh_from_db()
    assert workspace.runtime_lease_generation == 4


def test_generation_counter_is_per_workspace(company, agent):
    first, second = ExecutionWorkspaceFactory.create_batch(2, company=company)
    claim(first, agent)
    expire(first)
    claim(first, AgentFactory(company=company))
    assert claim(second, agent).lease.generation == 1


def test_database_clock_sets_expiry(workspace, agent):
    lease = claim(workspace, agent, ttl_seconds=300).lease
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (db_now,) = cursor.fetchone()
    # In a test the whole test is one transaction, so now() is the claim's own now().
    assert lease.claimed_at == db_now
    assert lease.expires_at == db_now + timedelta(seconds=300)


def test_claim_refuses_to_join_a_callers_transaction(workspace, agent):
    from django.db import transaction

    with (
        pytest.raises(RuntimeError, match="must not run inside another transaction"),
        transaction.atomic(),
    ):
        claim(workspace, agent)
    assert WorkspaceRuntimeLease.objects.count() == 0


def test_a_lease_is_stale_from_the_very_instant_it_expires(workspace, agent, monkeypatch):
    """The boundary of the expiry rule, on the database clock. Django's Now() is the
    statement's time; here it is the transaction's (CURRENT_TIMESTAMP), and the whole test is
    one transaction, so the clock stands still and `expires_at = now()` is exactly the
    boundary."""
    from django.db.models.functions import Now

    from leases.selectors import runtime_lease_evaluate_stale

    monkeypatch.setattr(
        Now,
        "as_postgresql",
        lambda self, compiler, conn, **extra: self.as_sql(
            compiler, conn, template="CURRENT_TIMESTAMP", **extra
        ),
    )
    issue = IssueFactory(company=workspace.company)
    claim(workspace, agent, issue_id=issue.pk)
    lease = WorkspaceRuntimeLease.objects.get()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE execution_workspace_runtime_leases"
            " SET expires_at = now() + interval '1 microsecond' WHERE id = %s",
            [lease.pk],
        )
    assert runtime_lease_evaluate_stale(lease_id=lease.pk) is None  # live until that instant
    expire(workspace, seconds_ago=0)  # expires_at = now(), the transaction's time
    assert runtime_lease_evaluate_stale(lease_id=lease.pk) == "lease_expired"


# --- found by `make mutate` (docs/testing.md) ------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_renew_in_a_later_transaction_moves_renewed_at_and_keeps_claimed_at():
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    agent = AgentFactory(company=company)
    created = claim(workspace, agent).lease
    renewed = claim(workspace, agent)  # a later transaction: a later now()
    assert renewed.outcome == "renewed"
    assert renewed.lease.claimed_at == created.claimed_at
    assert renewed.lease.renewed_at > created.renewed_at


def test_the_lease_read_back_is_the_lease_the_reclaim_answered(workspace, company):
    first = AgentFactory(company=company)
    claim(workspace, first)
    expire(workspace)
    rival = AgentFactory(company=company)
    run = HeartbeatRunFactory(company=company, agent=rival, status="running")
    reclaimed = claim(workspace, rival, run_id=run.pk)
    assert reclaimed.outcome == "reclaimed"
    assert reclaimed.lease.owner_run_id == run.pk
    assert reclaimed.lease.metadata["reclaimedFromOwnerKey"] == f"agent:{first.pk}"
    assert runtime_lease_get(execution_workspace_id=workspace.pk).lease == reclaimed.lease


def test_another_agent_presenting_the_holders_run_does_not_renew_its_lease(workspace, company):
    holder, other = AgentFactory.create_batch(2, company=company)
    run = HeartbeatRunFactory(company=company, agent=holder, status="running")
    held = claim(workspace, holder, run_id=run.pk).lease
    with pytest.raises(DomainError) as caught:
        claim(workspace, other, run_id=run.pk)
    assert caught.value.code == "permission_denied"
    row = lease_row(workspace)
    assert row is not None
    assert (row["owner_agent_id"], row["renewed_at"]) == (holder.pk, held.renewed_at)


def test_a_free_workspace_reads_as_no_lease_and_no_verdict(workspace):
    view = runtime_lease_get(execution_workspace_id=workspace.pk)
    assert (view.lease, view.stale_reason) == (None, None)
