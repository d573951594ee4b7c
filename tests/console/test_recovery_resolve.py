"""The console's "Resolve recovery action…": offered on live actions waiting for the board
that have no button of their own (a failed sandbox run's workspace validation, for one); a
confirmation page, an outcome and a required note, then `recovery_action_resolve` once an
action; the message says what was closed and how, what was left out or refused and why."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from paperclip.models import ActivityEvent, Company
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.services.conflicts import CONFLICT_CAUSE
from tests.console.test_pages import staff
from tests.recovery.factories import RecoveryActionFactory

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

ACTIONS = reverse("admin:recovery_issuerecoveryaction_changelist")


def sandbox_failed(company: Company) -> IssueRecoveryAction:
    action: IssueRecoveryAction = RecoveryActionFactory(
        source_issue__company=company,
        kind=IssueRecoveryAction.Kind.WORKSPACE_VALIDATION,
        owner_type=IssueRecoveryAction.OwnerType.BOARD,
        cause="sandbox_run_failed",
        next_action="Inspect the recorded workspace source, then recover from it.",
    )
    return action


def _button(client: Client, action: IssueRecoveryAction) -> bool:
    page = client.get(reverse("admin:recovery_issuerecoveryaction_change", args=[action.pk]))
    return 'data-console-action="resolve_recovery_action"' in page.content.decode()


def test_only_live_board_actions_without_their_own_button_offer_it(company: Company) -> None:
    client = staff(company)
    assert _button(client, sandbox_failed(company))
    agent_owned = RecoveryActionFactory(source_issue__company=company)
    assert not _button(client, agent_owned)
    closed = sandbox_failed(company)
    IssueRecoveryAction.objects.filter(pk=closed.pk).update(status="resolved")
    assert not _button(client, closed)
    for cause in (OWNER_UNVERIFIED_CAUSE, CONFLICT_CAUSE):
        own = RecoveryActionFactory(
            source_issue__company=company, owner_type="board", cause=cause, evidence={}
        )
        assert not _button(client, own)


def test_resolve_a_failed_sandbox_runs_action_with_an_outcome_and_a_note(
    company: Company,
) -> None:
    action = sandbox_failed(company)
    agent_owned = RecoveryActionFactory(source_issue__company=company)
    client = staff(company)
    selected = {
        "action": "resolve_recovery_action",
        "_selected_action": [str(action.pk), str(agent_owned.pk)],
    }
    confirm = client.post(ACTIONS, selected).content.decode()
    assert f'data-action="{action.pk}"' in confirm
    assert f"{agent_owned.pk}: not_board_resolvable (owned by agent, not the board)" in confirm
    blank = client.post(ACTIONS, {**selected, "apply": "1", "outcome": "restored", "note": ""})
    assert "This field is required" in blank.content.decode()
    action.refresh_from_db()
    assert action.status == "active"
    done = client.post(
        ACTIONS,
        {**selected, "apply": "1", "outcome": "restored", "note": "re-ran from the sandbox"},
        follow=True,
    ).content.decode()
    assert "Closed 1 recovery action(s): resolved with outcome restored" in done
    assert f"{agent_owned.pk}: not_board_resolvable" in done
    action.refresh_from_db()
    assert (action.status, action.outcome, action.resolution_note) == (
        "resolved",
        "restored",
        "re-ran from the sandbox",
    )
    (event,) = ActivityEvent.objects.filter(action="recovery_action.resolved")
    assert event.details["resolutionNote"] == "re-ran from the sandbox"
    assert not _button(client, action)

    # Closed since it was selected: refused by the service, nothing written.
    again = client.post(
        ACTIONS,
        {
            "action": "resolve_recovery_action",
            "_selected_action": [str(action.pk)],
            "apply": "1",
            "outcome": "blocked",
            "note": "again",
        },
        follow=True,
    ).content.decode()
    assert "Nothing to resolve" in again
    assert f"{action.pk}: not_board_resolvable (already resolved)" in again
    assert ActivityEvent.objects.filter(action="recovery_action.resolved").count() == 1


def test_cancelled_closes_the_action_as_cancelled(company: Company) -> None:
    action = sandbox_failed(company)
    staff(company).post(
        ACTIONS,
        {
            "action": "resolve_recovery_action",
            "_selected_action": [str(action.pk)],
            "apply": "1",
            "outcome": "cancelled",
            "note": "issue abandoned",
        },
    )
    action.refresh_from_db()
    assert (action.status, action.outcome) == ("cancelled", "cancelled")


def test_the_resolve_confirmation_reads_a_fixed_number_of_queries(
    company: Company, django_assert_max_num_queries: Any
) -> None:
    client: Client = staff(company)
    first = sandbox_failed(company)
    body = {"action": "resolve_recovery_action", "_selected_action": [str(first.pk)]}
    with CaptureQueriesContext(connection) as few:
        client.post(ACTIONS, body)
    more = [str(sandbox_failed(company).pk) for _ in range(5)]
    with django_assert_max_num_queries(len(few)):
        response = client.post(ACTIONS, {**body, "_selected_action": [str(first.pk), *more]})
    assert response.status_code == 200
