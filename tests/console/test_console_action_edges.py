"""Console actions at their edges: a staff user who may only view holds, runs or keys is
offered no action on them and cannot post one; a crafted POST naming ids that are not keys is
answered, not a 500; a repeated owner-stop confirmation says nothing changed; a bulk
force-release leaves alone a lease reclaimed since its confirmation page."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.urls import reverse

from leases.models import WorkspaceRuntimeLease
from paperclip.models import ActivityEvent, BoardMembership, Company, ExecutionWorkspace
from tests.console.helpers import held, stale_lease
from tests.console.test_pages import staff
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.leases.factories import claim
from tests.paperclip.factories import AgentFactory, IssueFactory, UserFactory

pytestmark = pytest.mark.django_db

ACTIONS = reverse("admin:recovery_issuerecoveryaction_changelist")
EVIDENCE = "k8s: pod finalizer-7f9 terminated 12:03Z, no copy processes left on node"


def viewer(company: Company, *codenames: str) -> Client:
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=company)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def confirm(hold_id: Any) -> dict[str, Any]:
    return {
        "action": "confirm_owner_stop",
        "_selected_action": [str(hold_id)],
        "apply": "1",
        "stop_evidence": EVIDENCE,
        "confirmed": "on",
    }


def test_view_permission_alone_offers_and_takes_no_recovery_action(company: Company) -> None:
    """Viewing the holds let a user confirm an owner stopped (and finalize, and revoke)."""
    _run, hold, _receipt = held(company)
    client = viewer(company, "view_issuerecoveryaction")
    page = client.get(ACTIONS).content.decode()
    assert "confirm_owner_stop" not in page
    events = ActivityEvent.objects.count()
    client.post(ACTIONS, confirm(hold.pk), follow=True)
    assert ActivityEvent.objects.count() == events
    hold.refresh_from_db()
    assert hold.status == "active"


@pytest.mark.parametrize(
    ("changelist", "action"),
    [
        ("admin:recovery_issuerecoveryaction_changelist", "confirm_owner_stop"),
        ("admin:recovery_issuerecoveryaction_changelist", "resolve_recovery_action"),
        ("admin:leases_workspaceruntimelease_changelist", "force_release_selected"),
    ],
)
def test_ids_that_are_not_keys_are_answered_not_a_500(
    company: Company, changelist: str, action: str
) -> None:
    held(company)
    client = staff(company)
    url = reverse(changelist)
    answer = client.post(url, {"action": action, "_selected_action": ["not-a-uuid"]}, follow=True)
    assert answer.status_code == 200
    assert "Nothing was done" in answer.content.decode()


def test_a_repeated_owner_stop_confirmation_says_nothing_changed(company: Company) -> None:
    _run, hold, _receipt = held(company)
    client = staff(company)
    first = client.post(ACTIONS, confirm(hold.pk), follow=True)
    assert "Confirmed 1" in first.content.decode()
    events = ActivityEvent.objects.count()
    again = client.post(ACTIONS, confirm(hold.pk), follow=True).content.decode()
    assert "Confirmed 0" in again
    assert "1 already confirmed (nothing changed)" in again
    assert ActivityEvent.objects.count() == events


LEASES_BULK = reverse("admin:leases_workspaceruntimelease_bulk", args=["force-release"])


@pytest.mark.django_db(transaction=True)  # each request its own transaction, as served
def test_bulk_force_release_keeps_a_lease_reclaimed_since_its_page(company: Company) -> None:
    """The page (no staleness filter) showed a stale owner; a live agent reclaimed the
    workspace before the board confirmed: the release pinned the new generation and evicted
    the owner the board never saw, while the page said such a lease was kept."""
    lease = stale_lease(company)
    client = staff(company)
    page = client.get(LEASES_BULK).content.decode()
    as_of = re.search(r'name="as_of" value="([^"]+)"', page)
    assert as_of is not None
    workspace = ExecutionWorkspace.objects.get(pk=lease.execution_workspace_id)
    issue = IssueFactory(company=company, status="in_progress")
    claim(workspace, AgentFactory(company=company), issue_id=issue.pk)
    done = client.post(
        LEASES_BULK, {"reason": "host rebuilt", "seen": "1", "as_of": as_of.group(1)}, follow=True
    )
    text = done.content.decode()
    assert "0 row(s) acted on" in text
    assert WorkspaceRuntimeLease.objects.filter(execution_workspace=workspace).exists()
    assert not ActivityEvent.objects.filter(action="runtime_lease.force_released").exists()
    stale = client.post(LEASES_BULK, {"reason": "host rebuilt", "seen": "1"})
    assert "The page is out of date" in stale.content.decode()


@pytest.mark.django_db(transaction=True)
def test_bulk_force_release_keeps_a_lease_reclaimed_while_its_page_was_made(
    company: Company,
) -> None:
    """A reclaim waiting for the lease row while the page was made commits after it, stamped
    with its transaction's start, before the page's moment: a time let the release evict an
    owner the page never showed. The page carries the database's snapshot, and a claim
    committed after it is kept (found in review, shown failing first)."""
    lease = stale_lease(company)
    workspace = ExecutionWorkspace.objects.get(pk=lease.execution_workspace_id)
    issue = IssueFactory(company=company, status="in_progress")
    agent = AgentFactory(company=company)
    client = staff(company)

    def reclaim() -> str:
        try:
            return str(claim(workspace, agent, issue_id=issue.pk).outcome)
        finally:
            connection.close()

    with raw_connection(autocommit=False) as gate, ThreadPoolExecutor(1) as pool:
        # A fenced write in flight holds the lease row FOR SHARE: the reclaim waits.
        gate.execute(
            "SELECT 1 FROM execution_workspace_runtime_leases WHERE id = %s FOR SHARE",
            [lease.id],
        )
        reclaimed = pool.submit(reclaim)
        assert wait_for_lock_waiters(
            1, until=reclaimed.done, holder=gate, table="execution_workspace_runtime_leases"
        )
        page = client.get(LEASES_BULK).content.decode()  # made while the reclaim waits
        as_of = re.search(r'name="as_of" value="([^"]+)"', page)
        assert as_of is not None
        gate.rollback()
        assert reclaimed.result(timeout=15) == "reclaimed"
    client.post(
        LEASES_BULK, {"reason": "host rebuilt", "seen": "1", "as_of": as_of.group(1)}, follow=True
    )
    kept = WorkspaceRuntimeLease.objects.get(execution_workspace=workspace)
    assert kept.owner_key == f"issue:{issue.pk}"
    assert not ActivityEvent.objects.filter(action="runtime_lease.force_released").exists()
