"""The run page's actions: "Interrupt run…" (confirmation page, required reason, the service
behind POST /api/heartbeat-runs/{id}/interrupt, one audit row a run), no "Finalize now" on a
run held for the board (its hold first, and its confirmation instead), and what each action's
message says happened: done, refused and why, or queued and where the outcome will show."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    Company,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
)
from recovery.selectors.actions import HEAD_CONFLICT_CODE
from tests.console.helpers import held, held_export, one_of_each, orphaned_run
from tests.console.test_pages import ACTIONS, staff
from tests.paperclip.factories import HeartbeatRunFactory, UserFactory
from tests.recovery.factories import RecoveryActionFactory, make_binding

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


def test_a_held_run_offers_its_holds_confirmation_first_and_no_finalize_now(
    company: Company,
) -> None:
    b, action, _ = held(company)
    client = staff(company)
    for url in (
        reverse("admin:paperclip_heartbeatrun_change", args=[b.run.pk]),
        reverse("admin:paperclip_nativerunfinalization_change", args=[b.run.pk]),
    ):
        html = client.get(url).content.decode()
        assert 'data-console-action="finalize_now"' not in html, url
        # The button posts the hold to the recovery action list's own confirmation.
        button = re.search(
            r'<form method="post" action="([^"]+)"[^>]*>.*?name="_selected_action" '
            r'value="([^"]+)">\s*<button[^>]*data-console-action="confirm_owner_stop"',
            html,
            re.S,
        )
        assert button is not None, url
        assert button.groups() == (ACTIONS, str(action.pk))
        # The hold is the first thing on the page, above the run's own fields.
        assert f'id="board-hold" data-cause="{action.cause}"' in html
        assert html.index('id="board-hold"') < html.index('class="form-row')
    confirm = client.post(
        ACTIONS, {"action": "confirm_owner_stop", "_selected_action": [action.pk]}
    )
    assert confirm.status_code == 200
    assert 'id="id_stop_evidence"' in confirm.content.decode()


def test_finalize_now_on_a_held_run_is_refused_and_says_where_to_act(company: Company) -> None:
    b, action, _ = held(company)
    client = staff(company)
    done = client.post(
        RUNS, {"action": "finalize_now", "_selected_action": [str(b.run.pk)]}, follow=True
    )
    text = done.content.decode()
    assert "Finalization queued for 0 run(s)" in text
    assert (
        f"run {b.run.pk}: finalization_not_acquired (held for the board (owner_unverified), "
        f"nothing queued: open recovery action {action.pk}" in text
    )
    assert not ActivityEvent.objects.filter(action="run.finalization_requested").exists()


def test_finalize_now_says_it_queued_and_where_the_outcome_shows(company: Company) -> None:
    coordinator = one_of_each(company)["failed"]
    client = staff(company)
    changelist = reverse("admin:paperclip_nativerunfinalization_changelist")
    first = client.post(
        changelist, {"action": "finalize_now", "_selected_action": [coordinator.pk]}, follow=True
    ).content.decode()
    assert "Finalization queued for 1 run(s); the outcome will show in each run&#x27;s" in first
    assert "Refused: none" in first
    again = client.post(
        changelist, {"action": "finalize_now", "_selected_action": [coordinator.pk]}, follow=True
    ).content.decode()
    assert "Finalization queued for 0 run(s)" in again
    assert "Already queued: 1" in again


def test_a_run_held_over_a_head_conflict_offers_the_resolution(company: Company) -> None:
    b = make_binding(company=company, phase="result_accepted")
    NativeRunFinalization.objects.filter(pk=b.run.pk).update(failure_code=HEAD_CONFLICT_CODE)
    hold = RecoveryActionFactory(
        company=company,
        source_issue=b.issue,
        kind="workspace_validation",
        owner_type="board",
        cause=HEAD_CONFLICT_CODE,
        evidence={"runId": str(b.run.pk), "conflictingPaths": ["a.txt"], "conflictCount": 1},
    )
    client = staff(company)
    html = _page(client, b.run)
    assert 'data-console-action="finalize_now"' not in html
    assert 'data-console-action="resolve_workspace_conflict"' in html
    assert f'data-hold="{hold.pk}"' in html
    done = client.post(
        RUNS, {"action": "finalize_now", "_selected_action": [str(b.run.pk)]}, follow=True
    ).content.decode()
    assert "held for the board (workspace_head_conflict), nothing queued" in done


def test_a_run_whose_export_is_held_offers_the_retry_and_no_finalize_now(
    company: Company, django_assert_max_num_queries: Any
) -> None:
    b, hold = held_export(company)
    client = staff(company)
    html = _page(client, b.run)
    assert 'data-console-action="finalize_now"' not in html
    assert 'data-console-action="retry_workspace_export"' in html
    assert f'id="board-hold" data-cause="{hold.cause}" data-hold="{hold.pk}"' in html
    assert "Exporting the saved result into the workspace failed on every attempt" in html
    assert html.index('id="board-hold"') < html.index('class="form-row')
    action_page = client.get(
        reverse("admin:recovery_issuerecoveryaction_change", args=[hold.pk])
    ).content.decode()
    assert "copyback_io_error after 5 attempt(s): No space left on device" in action_page
    assert "no environment lease (nothing to stop)" in action_page
    assert 'data-console-action="resolve_recovery_action"' not in action_page
    done = client.post(
        RUNS, {"action": "finalize_now", "_selected_action": [str(b.run.pk)]}, follow=True
    ).content.decode()
    assert "held for the board (workspace_export_failed), nothing queued" in done
    assert "use Retry workspace export" in done
    # The confirmation page reads a fixed number of queries, however many holds are selected.
    body = {"action": "retry_workspace_export", "_selected_action": [str(hold.pk)]}
    with CaptureQueriesContext(connection) as few:
        page = client.post(ACTIONS, body)
    assert 'id="id_repair_note"' in page.content.decode()
    more = [str(held_export(company)[1].pk) for _ in range(4)]
    with django_assert_max_num_queries(len(few)):
        client.post(ACTIONS, {**body, "_selected_action": [str(hold.pk), *more]})
    # A note too short is asked again and nothing is queued.
    short = client.post(ACTIONS, {**body, "apply": "1", "repair_note": "fixed"}).content.decode()
    assert "Say what you repaired" in short
    assert not ActivityEvent.objects.filter(action="issue.workspace_export_retry_requested")
