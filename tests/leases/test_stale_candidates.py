"""Set-wide stale reads (the sweep's listing, the dashboard's tiles, the admin's stale filters)
judge only `stale_candidate_ids`: they must find exactly the leases the per-row verdict calls
stale, for every reason and for owner rows that do not match their key."""

from __future__ import annotations

import uuid

import pytest

from leases.attention import stale_runtime_leases
from leases.models import WorkspaceRuntimeLease
from leases.selectors import STALE, runtime_lease_stale_page, stale_candidate_ids
from leases.selectors import with_stale_reason as judged
from paperclip.models import HeartbeatRun, Issue
from tests.leases.factories import claim, expire
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
)


def lease(company, agent, **owner):
    return claim(ExecutionWorkspaceFactory(company=company), agent, **owner).lease


@pytest.mark.django_db
def test_the_candidates_hold_every_stale_lease_whatever_its_reason(company):
    agent = AgentFactory(company=company)
    other = CompanyFactory()
    expired_ws = ExecutionWorkspaceFactory(company=company)
    claim(expired_ws, agent)
    expire(expired_ws)
    hidden, done, deleted = (IssueFactory(company=company) for _ in range(3))
    ended, removed = (HeartbeatRunFactory(company=company, agent=agent) for _ in range(2))
    stale = {
        lease(company, agent, issue_id=hidden.pk).id: "owner_issue_hidden",
        lease(company, agent, issue_id=done.pk).id: "owner_issue_terminal",
        lease(company, agent, issue_id=deleted.pk).id: "owner_issue_missing",
        lease(company, agent, run_id=ended.pk).id: "owner_run_terminal",
        lease(company, agent, run_id=removed.pk).id: "owner_run_missing",
    }
    stale[WorkspaceRuntimeLease.objects.get(execution_workspace=expired_ws).id] = "lease_expired"
    Issue.objects.filter(pk=hidden.pk).update(hidden_at="2026-01-01T00:00:00Z")
    Issue.objects.filter(pk=done.pk).update(status="done")
    Issue.objects.filter(pk=deleted.pk).delete()  # the FK goes NULL, the key stays
    HeartbeatRun.objects.filter(pk=ended.pk).update(status="failed")
    HeartbeatRun.objects.filter(pk=removed.pk).delete()
    # Rows whose FK disagrees with the key: the verdict reads the key, so must the candidates.
    foreign = IssueFactory(company=other)
    moved = lease(company, agent, issue_id=IssueFactory(company=company).pk)
    WorkspaceRuntimeLease.objects.filter(pk=moved.id).update(owner_key=f"issue:{foreign.pk}")
    stale[moved.id] = "owner_issue_missing"  # its key names another company's issue
    unknown = lease(company, agent, run_id=HeartbeatRunFactory(company=company, agent=agent).pk)
    WorkspaceRuntimeLease.objects.filter(pk=unknown.id).update(owner_key=f"run:{uuid.uuid4()}")
    stale[unknown.id] = "owner_run_missing"
    malformed = lease(company, agent, issue_id=IssueFactory(company=company).pk)
    WorkspaceRuntimeLease.objects.filter(pk=malformed.id).update(owner_key="issue:not-a-uuid")
    stale[malformed.id] = "owner_issue_missing"
    # Live ones of every owner kind, including a key in upper case that still names its issue.
    live_issue = IssueFactory(company=company)
    shouting = lease(company, agent, issue_id=live_issue.pk)
    WorkspaceRuntimeLease.objects.filter(pk=shouting.id).update(
        owner_key=f"issue:{str(live_issue.pk).upper()}"
    )
    lease(company, agent)
    lease(company, agent, issue_id=IssueFactory(company=company).pk)
    lease(company, agent, run_id=HeartbeatRunFactory(company=company, agent=agent).pk)

    every_row = dict(
        judged(WorkspaceRuntimeLease.objects.all())
        .filter(**STALE)
        .values_list("pk", "stale_reason")
    )
    assert every_row == stale
    assert set(stale) <= set(stale_candidate_ids())
    assert dict(runtime_lease_stale_page(after_id=None, limit=100)) == stale
    assert dict(stale_runtime_leases().values_list("pk", "stale_reason")) == stale
