"""The provider cleanup protocol over HTTP: claims, receipts, scoping, audit, racing workers."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from rest_framework.test import APIClient

import paperclip.db.locking
from leases.environment.export_resume.markers import export_resume_has
from leases.models import EnvironmentLease
from paperclip.db.advisory import dedicated_connection
from paperclip.db.clock import db_now
from paperclip.models import ActivityEvent, Agent, Company
from tests.helpers import assert_error
from tests.leases.environment.factories import (
    EnvironmentLeaseFactory,
    ProviderAgentFactory,
    pending_cleanup_lease,
    set_meta,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def agent(company: Company) -> Agent:
    """`agent_client` is a provider worker here: only providers may drive cleanups."""
    return ProviderAgentFactory(company=company)


def claim_url(lease_id: Any) -> str:
    return f"/api/environment-leases/{lease_id}/cleanup-claims"


def receipt_url(lease_id: Any) -> str:
    return f"/api/environment-leases/{lease_id}/cleanup-receipts"


def receipt(attempt_id: str, lease: EnvironmentLease, state: str = "stopped") -> dict[str, Any]:
    return {
        "attempt_id": attempt_id,
        "receipt": {"provider_lease_id": lease.provider_lease_id, "state": state},
    }


def test_claim_then_stop_receipt_settles_the_export_lease(
    company: Company, agent_client: APIClient
) -> None:
    lease = pending_cleanup_lease(company)
    before_ms = int(db_now().timestamp() * 1000)

    claimed = agent_client.post(claim_url(lease.pk))
    assert claimed.status_code == 200, claimed.json()
    body = claimed.json()
    attempt = body["attempt_id"]
    assert body["stop_only"] is True
    assert body["lease"]["id"] == str(lease.pk)
    meta = body["lease"]["metadata"]
    assert meta["pendingCleanupAttemptId"] == attempt
    assert meta["pendingCleanupInFlight"] is True
    expiry = meta["pendingCleanupLeaseExpiresAtMs"]
    assert before_ms + 15 * 60 * 1000 <= expiry <= before_ms + 15 * 60 * 1000 + 60_000
    assert set(body["lease"]) >= {
        "id", "company_id", "environment_id", "execution_workspace_id", "issue_id",
        "heartbeat_run_id", "status", "lease_policy", "provider", "provider_lease_id",
        "acquired_at", "last_used_at", "expires_at", "released_at", "failure_reason",
        "cleanup_status", "metadata",
    }  # fmt: skip

    again = agent_client.post(claim_url(lease.pk))
    assert_error(again, 409, "cleanup_in_flight")

    settled = agent_client.post(receipt_url(lease.pk), receipt(attempt, lease), format="json")
    assert settled.status_code == 200, settled.json()
    data = settled.json()
    assert (data["status"], data["cleanup_status"]) == ("released", "success")
    assert "nativeWorkspaceExportResume" not in data["metadata"]
    assert data["metadata"]["remoteExecutionTermination"]["state"] == "stopped"

    duplicate = agent_client.post(receipt_url(lease.pk), receipt(attempt, lease), format="json")
    assert_error(duplicate, 409, "cleanup_attempt_stale")
    actions = list(
        ActivityEvent.objects.filter(entity_id=str(lease.pk))
        .order_by("created_at")
        .values_list("action", "actor_type")
    )
    assert actions == [
        ("environment_lease.cleanup_claimed", "agent"),
        ("environment_lease.cleanup_settled", "agent"),
    ]


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        pytest.param(
            lambda body: body.update(attempt_id="older-attempt"), "attempt_mismatch", id="stale"
        ),
        pytest.param(
            lambda body: body["receipt"].update(provider_lease_id="sbx-foreign"),
            "provider_lease_mismatch",
            id="foreign",
        ),
    ],
)
def test_stale_and_foreign_receipts_change_nothing(
    company: Company, agent_client: APIClient, mutate: Callable[[dict[str, Any]], None], reason: str
) -> None:
    lease = pending_cleanup_lease(company)
    attempt = agent_client.post(claim_url(lease.pk)).json()["attempt_id"]
    before = EnvironmentLease.objects.get(pk=lease.pk)
    body = receipt(attempt, lease)
    mutate(body)
    response = agent_client.post(receipt_url(lease.pk), body, format="json")
    error = assert_error(response, 409, "cleanup_attempt_stale")
    assert error["details"]["reason"] == reason
    after = EnvironmentLease.objects.get(pk=lease.pk)
    assert (after.metadata, after.status, after.updated_at) == (
        before.metadata,
        before.status,
        before.updated_at,
    )
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_settled").count() == 0


def test_an_expired_claim_can_be_reclaimed_and_the_old_attempt_goes_stale(
    company: Company, agent_client: APIClient
) -> None:
    lease = pending_cleanup_lease(company)
    first = agent_client.post(claim_url(lease.pk)).json()["attempt_id"]
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupLeaseExpiresAtMs=1000)
    second = agent_client.post(claim_url(lease.pk))
    assert second.status_code == 200
    assert second.json()["attempt_id"] != first
    late = agent_client.post(receipt_url(lease.pk), receipt(first, lease), format="json")
    assert late.json()["error"]["details"]["reason"] == "attempt_mismatch"


def test_a_late_receipt_is_accepted_while_nobody_has_reclaimed(
    company: Company, agent_client: APIClient
) -> None:
    lease = pending_cleanup_lease(company)
    attempt = agent_client.post(claim_url(lease.pk)).json()["attempt_id"]
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupLeaseExpiresAtMs=1000)
    late = agent_client.post(receipt_url(lease.pk), receipt(attempt, lease), format="json")
    assert late.status_code == 200
    assert late.json()["status"] == "released"


@override_settings(PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS=60, PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS=90)
def test_failed_receipt_keeps_the_lease_pending_and_claimable_after_its_back_off(
    company: Company, agent_client: APIClient
) -> None:
    lease = pending_cleanup_lease(company)
    attempt = agent_client.post(claim_url(lease.pk)).json()["attempt_id"]
    failed = agent_client.post(
        receipt_url(lease.pk), receipt(attempt, lease, "failed"), format="json"
    )
    assert failed.status_code == 200
    data = failed.json()
    assert (data["status"], data["cleanup_status"]) == ("pending_cleanup", "failed")
    assert data["metadata"]["pendingCleanupInFlight"] is False
    assert export_resume_has(EnvironmentLease.objects.get(pk=lease.pk))
    unclaimed = agent_client.post(receipt_url(lease.pk), receipt(attempt, lease), format="json")
    assert unclaimed.json()["error"]["details"]["reason"] == "not_claimed"
    # The failed attempt counts, and the next one waits out the back-off (database clock).
    now_ms = int(db_now().timestamp() * 1000)
    assert data["metadata"]["pendingCleanupRetryAttempts"] == 1
    assert 59_000 <= data["metadata"]["pendingCleanupRetryAfterMs"] - now_ms <= 60_000
    early = assert_error(agent_client.post(claim_url(lease.pk)), 409, "cleanup_retry_not_due")
    assert early["details"]["attempts"] == 1
    assert EnvironmentLease.objects.get(pk=lease.pk).metadata["pendingCleanupInFlight"] is False
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupRetryAfterMs=now_ms - 1)
    assert agent_client.post(claim_url(lease.pk)).status_code == 200
    # A second failure doubles the back-off (capped by the setting).
    attempt = EnvironmentLease.objects.get(pk=lease.pk).metadata["pendingCleanupAttemptId"]
    again = agent_client.post(
        receipt_url(lease.pk), receipt(attempt, lease, "failed"), format="json"
    ).json()
    assert again["metadata"]["pendingCleanupRetryAttempts"] == 2
    assert 89_000 <= again["metadata"]["pendingCleanupRetryAfterMs"] - now_ms <= 91_000


@pytest.mark.parametrize(
    ("intent", "state", "status"),
    [
        pytest.param(None, "destroyed", "released", id="plain-destroyed"),
        pytest.param(None, "stopped", "released", id="plain-stopped"),
        pytest.param(None, "failed", "pending_cleanup", id="plain-failed"),
        pytest.param("stop_and_retain", "stopped", "released", id="stop-and-retain-stopped"),
        pytest.param(
            "stop_and_retain", "destroyed", "pending_cleanup", id="stop-and-retain-destroyed"
        ),
        pytest.param("export", "destroyed", "pending_cleanup", id="export-destroyed"),
    ],
)
def test_receipt_outcomes(
    company: Company, agent_client: APIClient, intent: str | None, state: str, status: str
) -> None:
    lease = pending_cleanup_lease(company, intent=intent)
    attempt = agent_client.post(claim_url(lease.pk)).json()["attempt_id"]
    response = agent_client.post(
        receipt_url(lease.pk), receipt(attempt, lease, state), format="json"
    )
    assert response.status_code == 200
    assert response.json()["status"] == status
    assert response.json()["cleanup_status"] == ("success" if status == "released" else "failed")


def test_claim_refuses_a_lease_without_pending_cleanup(
    company: Company, agent_client: APIClient
) -> None:
    lease = EnvironmentLeaseFactory(company=company, status="active")
    response = agent_client.post(claim_url(lease.pk))
    error = assert_error(response, 409, "cleanup_not_pending")
    assert error == {
        "code": "cleanup_not_pending",
        "message": error["message"],
        "details": {"status": "active"},
        "remediation": error["remediation"],
    }


@pytest.mark.parametrize(
    ("intent", "named"),
    [("export", "nativeWorkspaceExportResume"), ("stop_and_retain", "sandboxStopAndRetain")],
)
def test_claim_refuses_an_unbound_stop_only_intent(
    company: Company, agent_client: APIClient, intent: str, named: str
) -> None:
    lease = pending_cleanup_lease(company, intent=intent)
    set_meta(lease, pluginId="another-plugin")
    response = agent_client.post(claim_url(lease.pk))
    error = assert_error(response, 422, "cleanup_intent_invalid")
    assert error["details"] == {"intent": named}  # which intent failed to bind
    assert "pendingCleanupInFlight" not in EnvironmentLease.objects.get(pk=lease.pk).metadata


def test_scoping_and_permissions(
    company: Company,
    other_company: Company,
    agent_client: APIClient,
    make_agent_client: Callable[[Agent], APIClient],
    make_board_client: Callable[..., APIClient],
) -> None:
    lease = pending_cleanup_lease(company)
    foreign = make_agent_client(ProviderAgentFactory(company=other_company))
    hidden = [
        foreign.post(claim_url(lease.pk)),
        foreign.post(receipt_url(lease.pk), receipt("x", lease), format="json"),
        agent_client.post(claim_url(uuid.uuid4())),
        agent_client.post(receipt_url(uuid.uuid4()), receipt("x", lease), format="json"),
        agent_client.post(claim_url("not-a-uuid")),
    ]
    # Another company's lease, a missing one and a malformed id look exactly alike
    # (docs/api.md#company-scoping).
    for response in hidden:
        assert_error(response, 404, "not_found")
    board = make_board_client(company)
    assert_error(board.post(claim_url(lease.pk)), 403, "permission_denied")
    assert APIClient().post(claim_url(lease.pk)).status_code == 401
    bad = agent_client.post(
        receipt_url(lease.pk), {"attempt_id": "x", "receipt": {"state": "gone"}}, format="json"
    )
    assert bad.status_code == 400
    assert set(bad.json()["error"]["details"]["fields"]["receipt"]) == {
        "provider_lease_id",
        "state",
    }
    assert "pendingCleanupInFlight" not in EnvironmentLease.objects.get(pk=lease.pk).metadata
    assert not ActivityEvent.objects.filter(entity_type="environment_lease").exists()


def _lock_waiters(probe: Any) -> int:
    row = probe.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
    ).fetchone()
    return int(row[0])


def contend(
    lease: EnvironmentLease, calls: list[Callable[[], Any]]
) -> list[tuple[int, dict[str, Any]]]:
    """Run `calls` (HTTP requests) in threads that all reach the lease's row lock while another
    transaction holds it, then release it: the calls really overlap, deterministically."""
    with (
        dedicated_connection(application_name="env-test-holder") as holder,
        dedicated_connection(autocommit=True, application_name="env-test-probe") as probe,
    ):
        holder.execute("SELECT 1 FROM environment_leases WHERE id = %s FOR UPDATE", [lease.pk])

        def run(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
            try:
                response = call()
                return response.status_code, response.json()
            finally:
                connection.close()

        with ThreadPoolExecutor(max_workers=len(calls)) as pool:
            futures = [pool.submit(run, call) for call in calls]
            deadline = time.monotonic() + 20
            while _lock_waiters(probe) < len(calls):
                assert time.monotonic() < deadline, "workers never reached the row lock"
                assert not any(f.done() for f in futures), [f.result() for f in futures]
                time.sleep(0.01)  # polling for a condition, not synchronisation by sleep
            holder.rollback()
            return [f.result(timeout=30) for f in futures]


@pytest.mark.django_db(transaction=True)
def test_two_workers_racing_to_claim_get_exactly_one_winner(
    make_agent_client: Callable[[Agent], APIClient],
) -> None:
    company = Company.objects.create(name="race")
    lease = pending_cleanup_lease(company)
    clients = [make_agent_client(ProviderAgentFactory(company=company)) for _ in range(2)]
    outcomes = sorted(
        contend(lease, [lambda c=c: c.post(claim_url(lease.pk)) for c in clients]),
        key=lambda outcome: outcome[0],
    )
    assert [status for status, _ in outcomes] == [200, 409]
    assert outcomes[1][1]["error"]["code"] == "cleanup_in_flight"
    stored = EnvironmentLease.objects.get(pk=lease.pk).metadata
    assert stored["pendingCleanupAttemptId"] == outcomes[0][1]["attempt_id"]
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_claimed").count() == 1


@pytest.mark.django_db(transaction=True)
def test_racing_duplicate_receipts_settle_once(
    make_agent_client: Callable[[Agent], APIClient],
) -> None:
    company = Company.objects.create(name="race")
    lease = pending_cleanup_lease(company)
    client = make_agent_client(ProviderAgentFactory(company=company))
    attempt = client.post(claim_url(lease.pk)).json()["attempt_id"]
    body = receipt(attempt, lease)
    outcomes = sorted(
        contend(lease, [lambda: client.post(receipt_url(lease.pk), body, format="json")] * 2),
        key=lambda outcome: outcome[0],
    )
    assert [status for status, _ in outcomes] == [200, 409]
    assert outcomes[0][1]["status"] == "released"
    assert outcomes[1][1]["error"]["code"] == "cleanup_attempt_stale"
    assert outcomes[1][1]["error"]["details"]["reason"] == "not_pending"
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_settled").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_held_row_lock_answers_resource_busy_and_changes_nothing(
    make_agent_client: Callable[[Agent], APIClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(paperclip.db.locking, "HOT_PATH_LOCK_TIMEOUT", "200ms")
    company = Company.objects.create(name="busy")
    lease = pending_cleanup_lease(company)
    client = make_agent_client(ProviderAgentFactory(company=company))
    with dedicated_connection(application_name="env-test-holder") as holder:
        holder.execute("SELECT 1 FROM environment_leases WHERE id = %s FOR UPDATE", [lease.pk])
        response = client.post(claim_url(lease.pk))
        holder.rollback()
    assert_error(response, 409, "resource_busy")
    assert "pendingCleanupInFlight" not in EnvironmentLease.objects.get(pk=lease.pk).metadata
    assert not ActivityEvent.objects.filter(entity_type="environment_lease").exists()


def test_claim_expiry_comes_from_the_database_clock(
    company: Company, agent_client: APIClient
) -> None:
    # Inside this test's transaction now() stands still at the transaction's start, so a claim
    # timed by the database clock expires exactly 15 minutes after it; the application clock
    # would already be later.
    database_now = db_now()
    lease = pending_cleanup_lease(company)
    body = agent_client.post(claim_url(lease.pk)).json()
    stored = EnvironmentLease.objects.get(pk=lease.pk).metadata
    expected_ms = int(database_now.timestamp() * 1000) + 15 * 60 * 1000
    assert stored["pendingCleanupLeaseExpiresAtMs"] == expected_ms
    assert datetime.fromisoformat(body["expires_at"]) == datetime.fromtimestamp(
        expected_ms / 1000, tz=UTC
    )
