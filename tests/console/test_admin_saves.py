"""A board member's Save on a setup record writes only what the form changed: a save racing a
service that moves the record's other columns (a run publishing the workspace's head, a lease
grant moving its generation) leaves that move in place, and a save that changed nothing
writes nothing."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.urls import reverse

from paperclip.models import ActivityEvent, Company, ExecutionWorkspace
from tests.console.test_pages import staff
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import ExecutionWorkspaceFactory

pytestmark = pytest.mark.django_db(transaction=True)

TREE = "sha256:" + "ab" * 32


def form(workspace: ExecutionWorkspace, **changes: str) -> dict[str, str]:
    return {
        "company": str(workspace.company_id),
        "name": workspace.name,
        "status": workspace.status,
        "cwd": workspace.cwd or "",
        "source_issue": "",
        "mode": workspace.mode,
        "strategy_type": workspace.strategy_type,
        "provider_type": workspace.provider_type,
        "provider_ref": workspace.provider_ref or "",
        "metadata": "null",
        **changes,
    }


def test_a_save_racing_a_publish_keeps_the_published_head(company: Company) -> None:
    """The save read the row, then waited on the publisher's lock: its whole-row UPDATE put
    back the head it had read (none) and the older lease generation."""
    workspace = ExecutionWorkspaceFactory(company=company, name="w", runtime_lease_generation=3)
    client = staff(company)
    url = reverse("admin:paperclip_executionworkspace_change", args=[workspace.pk])
    answered: dict[str, Any] = {}
    with raw_connection(autocommit=False) as holder:
        holder.execute(
            "SELECT 1 FROM execution_workspaces WHERE id = %s FOR UPDATE", [workspace.pk]
        )
        saver = threading.Thread(
            target=lambda: answered.update(
                response=client.post(url, form(workspace, name="renamed"))
            )
        )
        saver.start()
        assert wait_for_lock_waiters(1, until=lambda: not saver.is_alive())
        holder.execute(
            "UPDATE execution_workspaces SET head_tree = %s, runtime_lease_generation = 4"
            " WHERE id = %s",
            [TREE, workspace.pk],
        )
        holder.commit()
        saver.join(timeout=30)
    assert answered["response"].status_code == 302
    row = ExecutionWorkspace.objects.get(pk=workspace.pk)
    assert (row.name, row.head_tree, row.runtime_lease_generation) == ("renamed", TREE, 4)


def test_a_save_that_changes_nothing_writes_nothing(company: Company) -> None:
    workspace = ExecutionWorkspaceFactory(company=company, name="w")
    client = staff(company)
    url = reverse("admin:paperclip_executionworkspace_change", args=[workspace.pk])
    stamp = ExecutionWorkspace.objects.get(pk=workspace.pk).updated_at
    events = ActivityEvent.objects.count()
    assert client.post(url, form(workspace)).status_code == 302
    assert ActivityEvent.objects.count() == events
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).updated_at == stamp


def test_a_records_company_cannot_be_changed_after_it_is_made(
    company: Company, other_company: Company, make_agent_client: Any
) -> None:
    """A board member of two companies saving a workspace with the other company chosen
    (a crafted post: the field is shown read-only) does not move it: its history would
    follow it and the other company's agents would read it. The same holds for an agent."""
    from paperclip.models import Agent
    from tests.paperclip.factories import AgentFactory
    from tests.paperclip.snapshots.test_history import _record
    from tests.recovery.snapshots import store_tree

    note = "company A's secret: the payroll export broke, rolled back"
    workspace = ExecutionWorkspaceFactory(company=company, name="ws")
    tree = store_tree(company.pk, {"payroll.csv": b"alice,100\n"})
    _record(workspace, tree, None, kind="restore", note=note)
    client = staff(company, other_company)
    url = reverse("admin:paperclip_executionworkspace_change", args=[workspace.pk])
    page = client.get(url).content.decode()
    assert 'name="company"' not in page  # shown, not editable
    response = client.post(url, form(workspace, company=str(other_company.pk), name="renamed"))
    assert response.status_code == 302, response.content.decode()[:2000]
    workspace.refresh_from_db()
    assert (workspace.company_id, workspace.name) == (company.pk, "renamed")
    stranger = make_agent_client(AgentFactory(company=other_company))
    assert stranger.get(f"/api/execution-workspaces/{workspace.pk}/history").status_code == 404
    agent = AgentFactory(company=company, name="a1")
    url = reverse("admin:paperclip_agent_change", args=[agent.pk])
    fields = {"name": "a1", "role": agent.role, "status": agent.status}
    client.post(url, {**fields, "company": str(other_company.pk)})
    assert Agent.objects.get(pk=agent.pk).company_id == company.pk


def test_an_existing_record_links_only_to_its_own_companys_rows(
    company: Company, other_company: Company
) -> None:
    """With the company read-only on the change page, the form checks the links it offers
    (rows of every company the member belongs to) against the record's own company."""
    from paperclip.models import Issue
    from tests.paperclip.factories import AgentFactory, IssueFactory

    issue = IssueFactory(company=company)
    client = staff(company, other_company)
    url = reverse("admin:paperclip_issue_change", args=[issue.pk])
    fields = {"title": issue.title, "status": issue.status, "hidden_at": ""}
    foreign = {
        "assignee_agent": str(AgentFactory(company=other_company).pk),
        "execution_workspace": str(ExecutionWorkspaceFactory(company=other_company).pk),
    }
    for field, value in foreign.items():
        blank = {"assignee_agent": "", "execution_workspace": ""}
        page = client.post(url, {**fields, **blank, field: value})
        assert page.status_code == 200  # the form again, with the error
        assert "Must belong to the issue&#x27;s company." in page.content.decode()
    assert Issue.objects.filter(pk=issue.pk, assignee_agent=None, execution_workspace=None).exists()
    workspace = ExecutionWorkspaceFactory(company=company, name="w")
    url = reverse("admin:paperclip_executionworkspace_change", args=[workspace.pk])
    page = client.post(
        url, form(workspace, source_issue=str(IssueFactory(company=other_company).pk))
    )
    assert page.status_code == 200
    assert "Must belong to the workspace&#x27;s company." in page.content.decode()
    workspace.refresh_from_db()
    assert workspace.source_issue_id is None
