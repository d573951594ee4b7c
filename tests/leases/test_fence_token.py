"""The runtime lease's `fence` (docs/leases.md#fence): strictly increasing over every grant of
a workspace (create and reclaim), the PostgreSQL timeline above bit 40 so that a failover that
lost the last grants still hands out larger fences; fenced writes that name one must match."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from hypothesis import given
from hypothesis import strategies as st

from leases.services import RuntimeLeaseOwner, runtime_lease_claim, runtime_lease_release
from leases.services.claim import FENCE_SHIFT, fence_of
from paperclip.models import WorkspaceOperation
from tests.leases.factories import expire
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
)

GENERATIONS = st.integers(min_value=1, max_value=2**FENCE_SHIFT - 1)
TIMELINES = st.integers(min_value=1, max_value=2**22)


@given(t1=TIMELINES, t2=TIMELINES, g1=GENERATIONS, g2=GENERATIONS)
def test_a_later_timeline_always_fences_above_an_earlier_one(
    t1: int, t2: int, g1: int, g2: int
) -> None:
    if t1 < t2:
        assert fence_of(timeline=t1, generation=g1) < fence_of(timeline=t2, generation=g2)
    if t1 == t2 and g1 < g2:
        assert fence_of(timeline=t1, generation=g1) < fence_of(timeline=t2, generation=g2)


def _timeline() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int"
        )
        row = cursor.fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.django_db
def test_every_grant_gets_a_larger_fence_made_of_the_timeline_and_the_generation() -> None:
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    agents = [AgentFactory(company=company) for _ in range(3)]
    issues = [IssueFactory(company=company, assignee_agent=a) for a in agents]

    def claim(index: int) -> Any:
        owner = RuntimeLeaseOwner.for_agent(agents[index].pk, issue_id=issues[index].pk)
        return runtime_lease_claim(
            company_id=company.pk,
            execution_workspace_id=workspace.pk,
            action="start",
            owner=owner,
        )

    fences = []
    first = claim(0)  # created
    fences.append(first.lease.fence)
    assert claim(0).lease.fence == first.lease.fence  # a renew is the same grant
    expire(workspace)
    fences.append(claim(1).lease.fence)  # reclaimed
    runtime_lease_release(
        company_id=company.pk,
        execution_workspace_id=workspace.pk,
        owner=RuntimeLeaseOwner.for_agent(agents[1].pk, issue_id=issues[1].pk),
    )
    third = claim(2)  # created again
    fences.append(third.lease.fence)
    assert fences == sorted(set(fences))
    timeline = _timeline()
    assert third.lease.fence == fence_of(timeline=timeline, generation=third.lease.generation)


@pytest.mark.django_db
def test_a_fenced_write_naming_another_fence_is_superseded(
    make_agent_client: Any,
) -> None:
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)
    issue = IssueFactory(company=company, assignee_agent=agent)
    client = make_agent_client(agent)
    claimed = client.post(
        f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim",
        {"action": "start", "issue_id": str(issue.pk)},
        format="json",
    ).json()["lease"]
    url = f"/api/execution-workspaces/{workspace.pk}/operations"
    body = {
        "issue_id": str(issue.pk),
        "generation": claimed["generation"],
        "phase": "build",
        "status": "running",
    }
    stale = client.post(url, {**body, "fence": claimed["fence"] - 1}, format="json")
    assert stale.status_code == 409
    error = stale.json()["error"]
    assert error["code"] == "workspace_runtime_lease_superseded"
    assert error["details"]["current_fence"] == claimed["fence"]
    assert not WorkspaceOperation.objects.exists()
    assert client.post(url, {**body, "fence": claimed["fence"]}, format="json").status_code == 201
    assert client.post(url, body, format="json").status_code == 201  # generation alone still fences
