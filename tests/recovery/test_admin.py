"""Admin: held finalizations are readable and the owner-stop confirmation goes through the
service."""

from __future__ import annotations

import pytest
from django.test import Client

from paperclip.models import ActivityEvent, BoardMembership
from paperclip.receipts import OWNER_KEY
from recovery.models import IssueRecoveryAction
from tests.paperclip.factories import UserFactory
from tests.recovery.services.test_owner_stop import held_binding

pytestmark = pytest.mark.django_db


def _client(company: object) -> Client:
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=company)
    user.is_superuser = True  # admin model permissions; company scoping is via membership
    user.save()
    client = Client()
    client.force_login(user)
    return client


def test_change_view_shows_owner_line_and_current_receipt() -> None:
    b, action, receipt, _actor = held_binding()
    client = _client(b.company)
    page = client.get(f"/admin/recovery/issuerecoveryaction/{action.pk}/change/")
    assert page.status_code == 200
    text = page.content.decode()
    assert f"gone.example · PID {receipt['pid']} · started {receipt['processStartedAt']}" in text
    assert receipt["token"] in text
    # Panels only where they apply: an owner hold is not about a recovery source.
    assert "Recovery source" not in text
    assert 'data-verdict="foreign_host"' in text
    assert "The owner ran on another host (gone.example" in text
    listing = client.get("/admin/recovery/issuerecoveryaction/?status__exact=active")
    assert listing.status_code == 200
    assert str(action.pk) in listing.content.decode()


def test_confirm_action_form_then_apply_calls_the_service() -> None:
    b, action, receipt, _actor = held_binding()
    client = _client(b.company)
    url = "/admin/recovery/issuerecoveryaction/"
    form = client.post(url, {"action": "confirm_owner_stop", "_selected_action": [action.pk]})
    assert form.status_code == 200
    assert "Deployment stop evidence" in form.content.decode()
    short = client.post(
        url,
        {
            "action": "confirm_owner_stop",
            "_selected_action": [action.pk],
            "apply": "1",
            "stop_evidence": "too short",
            "confirmed": "on",
        },
    )
    assert short.status_code == 200  # the form again, with its error
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == receipt
    done = client.post(
        url,
        {
            "action": "confirm_owner_stop",
            "_selected_action": [action.pk],
            "apply": "1",
            "stop_evidence": "pod deleted; node drained; no tar processes remain",
            "confirmed": "on",
        },
    )
    assert done.status_code == 302
    b.run.refresh_from_db()
    assert OWNER_KEY not in b.run.runner_profile_json
    action.refresh_from_db()
    assert action.evidence["workspaceOwnerStop"]["owner"] == receipt
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 1
    assert IssueRecoveryAction.objects.count() == 1
