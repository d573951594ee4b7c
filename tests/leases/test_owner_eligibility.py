"""A stale owner is refused: it neither creates, renews nor reclaims a lease, nor writes under
one (`workspace_runtime_lease_owner_ineligible`), and changes nothing; a lease it still holds
stays as it is and another owner reclaims it at once (docs/leases.md#owner-eligibility)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from leases.errors import RuntimeLeaseOwnerIneligible, RuntimeLeaseSuperseded
from leases.models import WorkspaceRuntimeLease
from leases.services import (
    RuntimeLeaseOwner,
    runtime_lease_get,
    runtime_lease_release,
    workspace_operation_create_fenced,
)
from leases.services.claim import _claim_fast_renew
from paperclip.errors import DomainError
from paperclip.models import (
    ActivityEvent,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    WorkspaceOperation,
)
from tests.helpers import assert_error
from tests.leases.factories import claim, expire, lease_row
from tests.paperclip.factories import AgentFactory, HeartbeatRunFactory, IssueFactory

pytestmark = pytest.mark.django_db

Stale = Callable[[Issue, HeartbeatRun], Any]


def issue_status(status: str) -> Stale:
    return lambda issue, run: Issue.objects.filter(pk=issue.pk).update(status=status)


def issue_hidden(issue: Issue, run: HeartbeatRun) -> Any:
    return Issue.objects.filter(pk=issue.pk).update(hidden_at=timezone.now())


def run_status(status: str) -> Stale:
    return lambda issue, run: HeartbeatRun.objects.filter(pk=run.pk).update(status=status)


# (owner kind, what turns it stale, the reason). An issue owner names its (live) run too.
CASES = [
    pytest.param("issue", issue_status("done"), "owner_issue_terminal", id="issue-done"),
    pytest.param("issue", issue_status("cancelled"), "owner_issue_terminal", id="issue-cancelled"),
    pytest.param("issue", issue_hidden, "owner_issue_hidden", id="issue-hidden"),
    *(
        pytest.param("run", run_status(status), "owner_run_terminal", id=f"run-{status}")
        for status in HeartbeatRun.TERMINAL_STATUS_VALUES
    ),
]


class Owner:
    """An agent with an issue and a live run in the workspace's company."""

    def __init__(self, workspace: ExecutionWorkspace, kind: str) -> None:
        self.workspace = workspace
        self.agent = AgentFactory(company=workspace.company)
        self.issue = IssueFactory(company=workspace.company, status="in_progress")
        self.run = HeartbeatRunFactory(company=workspace.company, agent=self.agent)
        self.kind = kind

    @property
    def ids(self) -> dict[str, uuid.UUID]:
        if self.kind == "issue":
            return {"issue_id": self.issue.pk, "run_id": self.run.pk}
        return {"run_id": self.run.pk}

    @property
    def key(self) -> str:
        return f"issue:{self.issue.pk}" if self.kind == "issue" else f"run:{self.run.pk}"

    @property
    def service_owner(self) -> RuntimeLeaseOwner:
        return RuntimeLeaseOwner.for_agent(self.agent.pk, **self.ids)

    def claim(self, **kwargs: Any) -> Any:
        return claim(self.workspace, self.agent, **self.ids, **kwargs)

    def write(self, generation: int) -> Any:
        return workspace_operation_create_fenced(
            company_id=self.workspace.company_id,
            execution_workspace_id=self.workspace.pk,
            owner=self.service_owner,
            generation=generation,
            phase="runtime_restart",
            status="running",
        )


def backdate(workspace: ExecutionWorkspace) -> None:
    """Move the lease's timestamps (not its expiry) an hour back: inside one test transaction
    now() never moves, so without this a renew or an updated_at bump would be invisible."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE execution_workspace_runtime_leases SET claimed_at = claimed_at - interval"
            " '1 hour', renewed_at = renewed_at - interval '1 hour', updated_at = updated_at -"
            " interval '1 hour' WHERE execution_workspace_id = %s",
            [workspace.pk],
        )


def snapshot(workspace: ExecutionWorkspace) -> tuple[Any, ...]:
    """Everything a claim or write could change: the lease row, the generation counter, the
    audit rows and the operations."""
    workspace.refresh_from_db()
    return (
        lease_row(workspace),
        workspace.runtime_lease_generation,
        list(ActivityEvent.objects.order_by("id").values_list("id", flat=True)),
        WorkspaceOperation.objects.count(),
    )


def assert_ineligible(
    caught: pytest.ExceptionInfo[RuntimeLeaseOwnerIneligible], owner: Owner, reason: str
) -> None:
    assert caught.value.code == "workspace_runtime_lease_owner_ineligible"
    assert caught.value.status_code == 409
    assert caught.value.details == {
        "execution_workspace_id": str(owner.workspace.pk),
        "owner_key": owner.key,
        "reason": reason,
    }
    assert caught.value.remediation_text


# --- claim --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "stale", "reason"), CASES)
def test_a_stale_owner_creates_no_lease_and_writes_nothing(workspace, kind, stale, reason):
    owner = Owner(workspace, kind)
    stale(owner.issue, owner.run)
    before = snapshot(workspace)

    with pytest.raises(RuntimeLeaseOwnerIneligible) as caught:
        owner.claim()

    assert_ineligible(caught, owner, reason)
    assert snapshot(workspace) == before
    assert not WorkspaceRuntimeLease.objects.exists()
    assert not ActivityEvent.objects.exists()


@pytest.mark.parametrize(("kind", "stale", "reason"), CASES)
def test_a_stale_holder_cannot_renew_and_its_lease_is_reclaimable_at_once(
    workspace, kind, stale, reason
):
    owner = Owner(workspace, kind)
    created = owner.claim(action="start", ttl_seconds=120).lease
    backdate(workspace)
    stale(owner.issue, owner.run)
    before = snapshot(workspace)

    with pytest.raises(RuntimeLeaseOwnerIneligible) as caught:
        owner.claim(action="repair", ttl_seconds=3600)

    assert_ineligible(caught, owner, reason)
    assert snapshot(workspace) == before  # not renewed: no updated_at bump, no audit row
    # The stale verdict says the same thing about the lease it still holds.
    assert runtime_lease_get(execution_workspace_id=workspace.pk).stale_reason == reason
    rival = AgentFactory(company=workspace.company)
    reclaimed = claim(workspace, rival)
    assert reclaimed.outcome == "reclaimed"
    assert reclaimed.reclaimed_from.owner_key == owner.key
    assert reclaimed.reclaimed_from.reason == reason
    assert reclaimed.lease.id == created.id
    assert reclaimed.lease.generation == 2


@pytest.mark.parametrize(("kind", "stale", "reason"), CASES)
def test_the_fast_renew_statement_itself_refuses_a_stale_owner(workspace, kind, stale, reason):
    owner = Owner(workspace, kind)
    owner.claim()
    backdate(workspace)
    stale(owner.issue, owner.run)
    before = lease_row(workspace)

    with CaptureQueriesContext(connection) as queries:
        renewed = _claim_fast_renew(
            company_id=workspace.company_id,
            execution_workspace_id=workspace.pk,
            action="repair",
            owner=owner.service_owner,
            owner_key=owner.key,
            ttl=3600,
        )

    assert renewed is None
    assert len(queries) == 1
    assert lease_row(workspace) == before


@pytest.mark.parametrize("kind", ["issue", "run"])
def test_an_eligible_owner_still_renews_in_one_statement(workspace, kind):
    owner = Owner(workspace, kind)
    owner.claim()
    with CaptureQueriesContext(connection) as queries:
        result = owner.claim(action="restart")
    assert result.outcome == "renewed"
    assert len(queries) == 1, [q["sql"] for q in queries]


def test_the_fast_renew_still_refuses_another_agents_run(workspace):
    # The run-owner renew checks "the run is the agent's" in the same lookup that judges it.
    owner = Owner(workspace, "run")
    owner.claim()
    backdate(workspace)
    before = snapshot(workspace)
    other = AgentFactory(company=workspace.company)

    with pytest.raises(DomainError) as caught:
        claim(workspace, other, run_id=owner.run.pk)

    assert caught.value.code == "permission_denied"
    assert snapshot(workspace) == before


@pytest.mark.parametrize(
    "status", [s for s in Issue.Status.values if s not in ("done", "cancelled")]
)
def test_every_eligible_issue_status_may_claim(workspace, agent, status):
    issue = IssueFactory(company=workspace.company, status=status)
    assert claim(workspace, agent, issue_id=issue.pk).outcome == "created"
    assert claim(workspace, agent, issue_id=issue.pk).outcome == "renewed"


def test_a_queued_run_may_claim(workspace, agent):
    run = HeartbeatRunFactory(company=workspace.company, agent=agent, status="queued")
    assert claim(workspace, agent, run_id=run.pk).outcome == "created"


def test_an_issue_owner_is_judged_by_its_issue_like_the_stale_verdict(workspace):
    # The owner key is the issue: the run named alongside does not make the lease stale, so
    # it does not make the owner ineligible either.
    owner = Owner(workspace, "issue")
    HeartbeatRun.objects.filter(pk=owner.run.pk).update(status="succeeded")
    assert owner.claim().outcome == "created"
    assert runtime_lease_get(execution_workspace_id=workspace.pk).stale_reason is None
    assert owner.claim().outcome == "renewed"


def test_a_stale_owner_is_refused_before_a_live_holder_is_consulted(workspace):
    rival = AgentFactory(company=workspace.company)
    claim(workspace, rival)
    owner = Owner(workspace, "issue")
    Issue.objects.filter(pk=owner.issue.pk).update(status="done")
    before = snapshot(workspace)

    with pytest.raises(RuntimeLeaseOwnerIneligible) as caught:
        owner.claim()

    assert_ineligible(caught, owner, "owner_issue_terminal")
    assert snapshot(workspace) == before


def test_a_stale_owner_does_not_reclaim_a_stale_lease(workspace):
    rival = AgentFactory(company=workspace.company)
    claim(workspace, rival)
    expire(workspace)
    owner = Owner(workspace, "run")
    HeartbeatRun.objects.filter(pk=owner.run.pk).update(status="failed")
    before = snapshot(workspace)

    with pytest.raises(RuntimeLeaseOwnerIneligible):
        owner.claim()

    assert snapshot(workspace) == before
    assert runtime_lease_get(execution_workspace_id=workspace.pk).lease.owner_key == (
        f"agent:{rival.pk}"
    )


def test_a_stale_holder_may_still_release_its_lease(workspace):
    owner = Owner(workspace, "issue")
    owner.claim()
    Issue.objects.filter(pk=owner.issue.pk).update(status="done")
    released = runtime_lease_release(
        company_id=workspace.company_id,
        execution_workspace_id=workspace.pk,
        owner=owner.service_owner,
    )
    assert released.released
    assert not WorkspaceRuntimeLease.objects.exists()


def test_an_agent_owner_has_no_lifecycle_and_is_never_ineligible(workspace, agent):
    assert claim(workspace, agent).outcome == "created"
    assert claim(workspace, agent).outcome == "renewed"


# --- fenced writes --------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "stale", "reason"), CASES)
def test_a_fenced_write_by_a_stale_holder_is_refused(workspace, kind, stale, reason):
    owner = Owner(workspace, kind)
    generation = owner.claim().lease.generation
    assert owner.write(generation).lease_generation == generation  # eligible: accepted
    stale(owner.issue, owner.run)
    row, counter, events, operations = snapshot(workspace)

    with pytest.raises(RuntimeLeaseOwnerIneligible) as caught:
        owner.write(generation)

    assert_ineligible(caught, owner, reason)
    assert (lease_row(workspace), WorkspaceOperation.objects.count()) == (row, operations)
    workspace.refresh_from_db()
    assert workspace.runtime_lease_generation == counter
    # Like a superseded write, the refusal is evidence worth keeping: one audit row, written
    # after the refused write rolled back.
    rejected = ActivityEvent.objects.exclude(id__in=events).get()
    assert rejected.action == "runtime_lease.ineligible_write_rejected"
    assert rejected.details == {
        **caught.value.details,
        "phase": "runtime_restart",
        "run_id": str(owner.run.pk),
    }


def test_a_stale_owner_that_no_longer_holds_the_lease_is_superseded(workspace):
    owner = Owner(workspace, "issue")
    owner.claim()
    Issue.objects.filter(pk=owner.issue.pk).update(status="done")
    claim(workspace, AgentFactory(company=workspace.company))  # reclaimed: generation 2

    with pytest.raises(RuntimeLeaseSuperseded) as caught:
        owner.write(1)

    assert caught.value.details["current_generation"] == 2
    assert not WorkspaceOperation.objects.exists()


# --- the verdict is the stale verdict's owner part ----------------------------------------


def test_the_owner_verdict_agrees_with_the_stale_verdict_for_every_status(workspace, agent):
    from leases.selectors import owner_stale_reason_sql, runtime_lease_evaluate_stale

    lease = claim(workspace, agent).lease

    def both(kind: str, ref: uuid.UUID) -> tuple[str | None, str | None]:
        """The raw verdict (every text shape that applies, which must agree) and the ORM's."""
        WorkspaceRuntimeLease.objects.filter(pk=lease.id).update(owner_key=f"{kind}:{ref}")
        shapes = [  # the general text, and the one-owner text the renew fast path uses
            {"issue": "%(issue)s::uuid", "run": "%(run)s::uuid"},
            {"issue": "%(issue)s::uuid", "run": None}
            if kind == "issue"
            else {"issue": None, "run": "%(run)s::uuid"},
        ]
        raws = set()
        for shape in shapes:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT " + owner_stale_reason_sql(company="%(company)s::uuid", **shape),
                    {
                        "issue": ref if kind == "issue" else None,
                        "run": ref if kind == "run" else None,
                        "company": workspace.company_id,
                    },
                )
                raws.add(cursor.fetchone()[0])
        assert len(raws) == 1, raws
        return raws.pop(), runtime_lease_evaluate_stale(lease_id=lease.id)

    seen = set()
    for status in Issue.Status.values:
        for hidden in (None, timezone.now()):
            issue = IssueFactory(company=workspace.company, status=status, hidden_at=hidden)
            raw, orm = both("issue", issue.pk)
            assert raw == orm, (status, hidden)
            seen.add(raw)
    for status in HeartbeatRun.Status.values:
        run = HeartbeatRunFactory(company=workspace.company, agent=agent, status=status)
        raw, orm = both("run", run.pk)
        assert raw == orm, status
        seen.add(raw)
    for kind in ("issue", "run"):
        raw, orm = both(kind, uuid.uuid4())
        assert raw == orm == f"owner_{kind}_missing"
        seen.add(raw)
    assert seen == {
        None,
        "owner_issue_hidden",
        "owner_issue_terminal",
        "owner_run_terminal",
        "owner_issue_missing",
        "owner_run_missing",
    }


# --- HTTP ---------------------------------------------------------------------------------


def test_http_claim_by_a_stale_owner_is_409_with_details(make_agent_client, workspace):
    owner = Owner(workspace, "issue")
    client = make_agent_client(owner.agent)
    body = {"action": "start", "issue_id": str(owner.issue.pk), "run_id": str(owner.run.pk)}
    assert client.post(claim_url(workspace), body, format="json").status_code == 200
    backdate(workspace)
    Issue.objects.filter(pk=owner.issue.pk).update(status="done")
    before = snapshot(workspace)

    response = client.post(claim_url(workspace), body, format="json")

    error = assert_error(response, 409, "workspace_runtime_lease_owner_ineligible")
    assert error["details"] == {
        "execution_workspace_id": str(workspace.pk),
        "owner_key": owner.key,
        "reason": "owner_issue_terminal",
    }
    assert error["remediation"] == RuntimeLeaseOwnerIneligible.remediation
    assert snapshot(workspace) == before


def test_http_fenced_write_by_a_stale_holder_is_409(make_agent_client, workspace):
    owner = Owner(workspace, "run")
    client = make_agent_client(owner.agent)
    generation = owner.claim().lease.generation
    HeartbeatRun.objects.filter(pk=owner.run.pk).update(status="timed_out")

    response = client.post(
        f"/api/execution-workspaces/{workspace.pk}/operations",
        {
            "generation": generation,
            "run_id": str(owner.run.pk),
            "phase": "runtime_stop",
            "status": "running",
        },
        format="json",
    )

    error = assert_error(response, 409, "workspace_runtime_lease_owner_ineligible")
    assert error["details"] == {
        "execution_workspace_id": str(workspace.pk),
        "owner_key": owner.key,
        "reason": "owner_run_terminal",
    }
    assert error["remediation"]
    assert not WorkspaceOperation.objects.exists()


def claim_url(workspace: ExecutionWorkspace) -> str:
    return f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"
