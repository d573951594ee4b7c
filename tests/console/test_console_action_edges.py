"""Console actions at their edges: a staff user who may only view holds, runs or keys is
offered no action on them and cannot post one; a crafted POST naming ids that are not keys is
answered, not a 500; a repeated owner-stop confirmation says nothing changed."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from paperclip.models import ActivityEvent, BoardMembership, Company
from tests.console.helpers import held
from tests.console.test_pages import staff
from tests.paperclip.factories import UserFactory

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
