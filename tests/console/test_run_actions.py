"""The run page's actions: "Interrupt run…" (confirmation page, required reason, the service
behind POST /api/heartbeat-runs/{id}/interrupt, one audit row a run) and what each action's
message says happened."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from paperclip.models import ActivityEvent, BoardMembership, HeartbeatRun, Issue
from tests.console.helpers import orphaned_run
from tests.console.test_pages import staff
from tests.paperclip.factories import HeartbeatRunFactory, UserFactory

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

RUNS = reverse("admin:paperclip_heartbeatrun_changelist")


def _page(client: Client, run: HeartbeatRun) -> str:
    response = client.get(reverse("admin:paperclip_heartbeatrun_change", args=[run.pk]))
    assert response.status_code == 200
    return response.content.decode()


def _interrupt(client: Client, *runs: HeartbeatRun, **extra: Any) -> Any:
    return client.post(
        RUNS,
        {"action": "interrupt_selected", "_selected_action": [str(r.pk) for r in runs], **extra},
        follow="apply" in extra,
    )


def test_interrupt_an_orphaned_run_from_its_page() -> None:
    run = orphaned_run()
    client = staff(run.company)
    html = _page(client, run)
    assert 'id="orphaned-verdict" data-state="orphaned"' in html
    assert 'data-console-action="interrupt_selected"' in html

    confirm = _interrupt(client, run)
    assert confirm.status_code == 200
    text = confirm.content.decode()
    assert f'data-run="{run.pk}"' in text
    assert "yes, every lease lapsed" in text
    assert 'value="Interrupt 1 run"' in text

    # The reason is required: without it nothing changes.
    blank = _interrupt(client, run, apply="1", reason="  ")
    assert "This field is required" in blank.content.decode()
    run.refresh_from_db()
    assert run.status == "running"

    done = _interrupt(client, run, apply="1", reason="agent host lost, kill -9")
    assert "Interrupted 1 run(s)" in done.content.decode()
    assert "Refused: none" in done.content.decode()
    run.refresh_from_db()
    assert run.status == "interrupted"
    assert Issue.objects.get(pk=run.issue_id).execution_run_id is None
    (event,) = ActivityEvent.objects.filter(
        action="heartbeat_run.status_changed", entity_id=str(run.pk)
    )
    assert event.actor_type == "user"
    assert event.details["reason"] == "agent host lost, kill -9"
    assert event.details["to"] == "interrupted"
    # An ended run offers no interrupt, and says nothing about being orphaned.
    after = _page(client, run)
    assert 'data-console-action="interrupt_selected"' not in after
    assert "orphaned-verdict" not in after


def test_a_run_already_ended_is_refused_and_the_message_says_why() -> None:
    live = orphaned_run()
    ended = HeartbeatRunFactory(
        company=live.company, agent=live.agent, status=HeartbeatRun.Status.SUCCEEDED
    )
    client = staff(live.company)
    confirm = _interrupt(client, live, ended).content.decode()
    assert "already ended: will be refused" in confirm
    assert 'value="Interrupt 1 run"' in confirm
    done = _interrupt(client, live, ended, apply="1", reason="cleanup after outage")
    text = done.content.decode()
    assert "Interrupted 1 run(s)" in text
    assert (
        f"run {ended.pk}: invalid_run_transition (A succeeded run cannot become interrupted)"
        in text
    )
    ended.refresh_from_db()
    assert ended.status == "succeeded"
    assert ActivityEvent.objects.filter(action="heartbeat_run.status_changed").count() == 1


def test_the_interrupt_button_needs_the_permission() -> None:
    run = orphaned_run()
    user = UserFactory()
    user.user_permissions.set(Permission.objects.filter(codename="view_heartbeatrun"))
    BoardMembership.objects.create(user=user, company=run.company)
    client = Client()
    client.force_login(user)
    assert "interrupt_selected" not in _page(client, run)


def test_the_interrupt_confirmation_reads_a_fixed_number_of_queries(
    django_assert_max_num_queries: Any,
) -> None:
    first = orphaned_run()
    client = staff(first.company)
    with CaptureQueriesContext(connection) as few:
        assert _interrupt(client, first).status_code == 200
    more = [orphaned_run(company=first.company) for _ in range(4)]
    with django_assert_max_num_queries(len(few)):
        assert _interrupt(client, first, *more).status_code == 200
