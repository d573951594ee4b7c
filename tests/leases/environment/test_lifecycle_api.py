"""The environment lease lifecycle over HTTP: environments created by the board; provider agents
acquire, heartbeat and release leases (each policy and outcome, the export-resume marker rules),
then claim and settle the cleanups; the single-flight slot; the provider role and company rules;
the 15-minute claim expiry on the database clock; the worker retrying a failed cleanup."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import override_settings
from rest_framework.test import APIClient

import leases.environment.lifecycle
import leases.environment.services
from leases.environment.locks import environment_slot_key
from leases.models import EnvironmentLease
from paperclip.db.clock import db_now
from paperclip.models import (
    ActivityEvent,
    Agent,
    Company,
    Environment,
    ExecutionWorkspace,
    HeartbeatRun,
)
from paperclip.worker.jobs import job_defer_in_tx
from tests.helpers import assert_error, raw_connection, run_jobs
from tests.leases.environment.factories import (
    ProviderAgentFactory,
    export_marker,
    set_meta,
    sync_reference,
)
from tests.paperclip.factories import (
    CompanyFactory,
    EnvironmentFactory,
    ExecutionWorkspaceFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
)

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

ACQUIRE = "/api/environment-leases"


def lease_url(lease_id: Any, tail: str = "") -> str:
    return f"/api/environment-leases/{lease_id}{tail}"


def acquire_body(
    environment: Environment,
    run: HeartbeatRun,
    *,
    workspace: ExecutionWorkspace | None = None,
    policy: str = "ephemeral",
    **changes: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "environment_id": str(environment.pk),
        "heartbeat_run_id": str(run.pk),
        "lease_policy": policy,
        "provider": "daytona",
        "provider_lease_id": f"sbx-{uuid.uuid4().hex[:8]}",
        "remote_cwd": "/workspace",
        "plugin_id": "plugin-daytona",
    }
    if workspace is not None:
        body["execution_workspace_id"] = str(workspace.pk)
    body.update(changes)
    return body


def actions(lease_id: Any) -> list[str]:
    return list(
        ActivityEvent.objects.filter(entity_type="environment_lease", entity_id=str(lease_id))
        .order_by("created_at", "pk")
        .values_list("action", flat=True)
    )


@pytest.fixture
def provider(company: Company) -> Agent:
    return ProviderAgentFactory(company=company)


@pytest.fixture
def provider_client(provider: Agent, make_agent_client: Callable[[Agent], APIClient]) -> APIClient:
    return make_agent_client(provider)


@pytest.fixture
def environment(company: Company) -> Environment:
    return EnvironmentFactory(company=company, driver="sandbox")


@pytest.fixture
def run(company: Company) -> HeartbeatRun:
    return NativeRunFactory(company=company, status="running")


# --- agents, environments ---------------------------------------------------------------------


def test_the_board_creates_provider_agents_and_environments(
    company: Company, board_client: APIClient, provider_client: APIClient, agent_client: APIClient
) -> None:
    worker = board_client.post(f"/api/companies/{company.pk}/agents", {"name": "w"}, format="json")
    assert (worker.status_code, worker.json()["role"]) == (201, "worker")
    made = board_client.post(
        f"/api/companies/{company.pk}/agents", {"name": "p", "role": "provider"}, format="json"
    )
    assert (made.status_code, made.json()["role"]) == (201, "provider")
    assert Agent.objects.get(pk=made.json()["id"]).role == "provider"
    bad = board_client.post(
        f"/api/companies/{company.pk}/agents", {"name": "p", "role": "admin"}, format="json"
    )
    assert "role" in assert_error(bad, 400, "invalid_request")["details"]["fields"]

    url = f"/api/companies/{company.pk}/environments"
    body = {"name": "sandboxes", "driver": "sandbox", "config": {"region": "eu"}}
    created = board_client.post(url, body, format="json")
    assert created.status_code == 201, created.json()
    data = created.json()
    assert {k: data[k] for k in ("company_id", "name", "driver", "status", "config")} == {
        "company_id": str(company.pk),
        "name": "sandboxes",
        "driver": "sandbox",
        "status": "active",
        "config": {"region": "eu"},
    }
    assert ActivityEvent.objects.filter(
        action="environment.created", entity_id=data["id"], actor_type="user"
    ).exists()
    for agent in (provider_client, agent_client):
        assert_error(agent.post(url, body, format="json"), 403, "permission_denied")
    wrong = board_client.post(url, {"name": "x", "driver": "docker"}, format="json")
    assert "driver" in assert_error(wrong, 400, "invalid_request")["details"]["fields"]
    foreign = board_client.post(
        f"/api/companies/{CompanyFactory().pk}/environments", body, format="json"
    )
    assert_error(foreign, 404, "not_found")


# --- the whole life, per policy and outcome -----------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "outcome", "released_status", "cleanup"),
    [
        ("ephemeral", "succeeded", "pending_cleanup", True),
        ("ephemeral", "failed", "pending_cleanup", True),
        ("retain_on_failure", "succeeded", "pending_cleanup", True),
        ("retain_on_failure", "failed", "retained", False),
        ("reuse_by_environment", "succeeded", "released", False),
        ("reuse_by_environment", "failed", "released", False),
        ("reuse_by_execution_workspace", "succeeded", "released", False),
        ("reuse_by_execution_workspace", "failed", "released", False),
    ],
)
def test_the_whole_life_of_a_lease_over_http(
    company: Company,
    provider_client: APIClient,
    board_client: APIClient,
    environment: Environment,
    run: HeartbeatRun,
    policy: str,
    outcome: str,
    released_status: str,
    cleanup: bool,
) -> None:
    workspace = ExecutionWorkspaceFactory(company=company)
    body = acquire_body(environment, run, workspace=workspace, policy=policy)
    acquired = provider_client.post(ACQUIRE, body, format="json")
    assert acquired.status_code == 201, acquired.json()
    lease = acquired.json()
    assert (lease["status"], lease["lease_policy"], lease["cleanup_status"]) == (
        "active",
        policy,
        None,
    )
    assert lease["issue_id"] == str(run.native_issue_id)
    assert lease["metadata"]["remoteCwd"] == "/workspace"
    lease_id = lease["id"]

    # A repeat of the same acquire is the same lease, written once.
    again = provider_client.post(ACQUIRE, body, format="json")
    assert (again.status_code, again.json()["id"]) == (200, lease_id)

    EnvironmentLease.objects.filter(pk=lease_id).update(last_used_at=db_now().replace(year=2000))
    beat = provider_client.post(lease_url(lease_id, "/heartbeat"))
    assert beat.status_code == 200, beat.json()
    touched = EnvironmentLease.objects.get(pk=lease_id)
    assert touched.last_used_at >= db_now()  # the database clock (statement time)
    assert beat.json()["last_used_at"] == touched.last_used_at.isoformat().replace("+00:00", "Z")

    for reader in (provider_client, board_client):
        read = reader.get(lease_url(lease_id))
        assert (read.status_code, read.json()["status"]) == (200, "active")
    listed = board_client.get(
        f"/api/companies/{company.pk}/environment-leases",
        {"status": "active", "heartbeat_run_id": str(run.pk)},
    )
    assert [row["id"] for row in listed.json()["results"]] == [lease_id]

    released = provider_client.post(
        lease_url(lease_id, "/release"), {"outcome": outcome}, format="json"
    )
    assert released.status_code == 200, released.json()
    data = released.json()
    assert data["status"] == released_status
    assert data["released_at"] is not None
    assert data["cleanup_status"] == ("pending" if cleanup else None)
    audited = actions(lease_id)
    assert audited == ["environment_lease.acquired", "environment_lease.released"]

    # Repeating the release with the same outcome changes nothing; another outcome is refused.
    stored = EnvironmentLease.objects.get(pk=lease_id)
    repeat = provider_client.post(
        lease_url(lease_id, "/release"), {"outcome": outcome}, format="json"
    )
    assert (repeat.status_code, repeat.json()["status"]) == (200, released_status)
    other = "failed" if outcome == "succeeded" else "succeeded"
    refused = provider_client.post(
        lease_url(lease_id, "/release"), {"outcome": other}, format="json"
    )
    error = assert_error(refused, 409, "environment_lease_not_active")
    assert error["details"] == {"status": released_status, "outcome": outcome}
    assert_error(
        provider_client.post(lease_url(lease_id, "/heartbeat")), 409, "environment_lease_not_active"
    )
    assert EnvironmentLease.objects.get(pk=lease_id).updated_at == stored.updated_at
    assert actions(lease_id) == audited

    claim = provider_client.post(lease_url(lease_id, "/cleanup-claims"))
    if not cleanup:
        assert_error(claim, 409, "cleanup_not_pending")
        return
    assert claim.status_code == 200, claim.json()
    assert claim.json()["stop_only"] is False
    receipt = provider_client.post(
        lease_url(lease_id, "/cleanup-receipts"),
        {
            "attempt_id": claim.json()["attempt_id"],
            "receipt": {"provider_lease_id": body["provider_lease_id"], "state": "destroyed"},
        },
        format="json",
    )
    assert receipt.status_code == 200, receipt.json()
    assert (receipt.json()["status"], receipt.json()["cleanup_status"]) == ("released", "success")
    assert actions(lease_id) == [
        "environment_lease.acquired",
        "environment_lease.released",
        "environment_lease.cleanup_claimed",
        "environment_lease.cleanup_settled",
    ]


# --- export-resume marker rules on release -------------------------------------------------------


def _active_lease(
    provider_client: APIClient, environment: Environment, run: HeartbeatRun, **changes: Any
) -> EnvironmentLease:
    response = provider_client.post(
        ACQUIRE, acquire_body(environment, run, **changes), format="json"
    )
    assert response.status_code == 201, response.json()
    return EnvironmentLease.objects.get(pk=response.json()["id"])


@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_a_lease_with_a_pending_export_is_stopped_never_destroyed(
    provider_client: APIClient, environment: Environment, run: HeartbeatRun, outcome: str
) -> None:
    lease = _active_lease(provider_client, environment, run, policy="reuse_by_environment")
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease))
    released = provider_client.post(
        lease_url(lease.pk, "/release"), {"outcome": outcome}, format="json"
    ).json()
    assert (released["status"], released["cleanup_status"], released["failure_reason"]) == (
        "pending_cleanup",
        "pending",
        "workspace_export_stop_pending",
    )
    assert "nativeWorkspaceExportResume" in released["metadata"]
    claim = provider_client.post(lease_url(lease.pk, "/cleanup-claims")).json()
    assert claim["stop_only"] is True

    def receipt(state: str) -> dict[str, Any]:
        return {
            "attempt_id": claim["attempt_id"],
            "receipt": {"provider_lease_id": lease.provider_lease_id, "state": state},
        }

    destroyed = provider_client.post(
        lease_url(lease.pk, "/cleanup-receipts"), receipt("destroyed"), format="json"
    ).json()
    assert (destroyed["status"], destroyed["cleanup_status"]) == ("pending_cleanup", "failed")
    assert "nativeWorkspaceExportResume" in destroyed["metadata"]
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupRetryAfterMs=1)
    claim = provider_client.post(lease_url(lease.pk, "/cleanup-claims")).json()
    stopped = provider_client.post(
        lease_url(lease.pk, "/cleanup-receipts"), receipt("stopped"), format="json"
    ).json()
    assert (stopped["status"], stopped["cleanup_status"]) == ("released", "success")
    assert "nativeWorkspaceExportResume" not in stopped["metadata"]
    assert stopped["metadata"]["remoteExecutionTermination"]["state"] == "stopped"


def test_a_retained_lease_keeps_its_pending_export_marker(
    provider_client: APIClient, environment: Environment, run: HeartbeatRun
) -> None:
    lease = _active_lease(provider_client, environment, run, policy="retain_on_failure")
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease))
    released = provider_client.post(
        lease_url(lease.pk, "/release"), {"outcome": "failed"}, format="json"
    ).json()
    assert (released["status"], released["cleanup_status"], released["failure_reason"]) == (
        "retained",
        None,
        "workspace_export_stop_pending",
    )
    assert "nativeWorkspaceExportResume" in released["metadata"]
    assert_error(
        provider_client.post(lease_url(lease.pk, "/cleanup-claims")), 409, "cleanup_not_pending"
    )


def test_an_invalid_marker_waits_for_an_operator(
    provider_client: APIClient, environment: Environment, run: HeartbeatRun
) -> None:
    lease = _active_lease(provider_client, environment, run)
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease, pluginId="another-plugin"))
    released = provider_client.post(
        lease_url(lease.pk, "/release"), {"outcome": "succeeded"}, format="json"
    ).json()
    assert released["status"] == "pending_cleanup"
    assert "nativeWorkspaceExportResume" in released["metadata"]
    assert_error(
        provider_client.post(lease_url(lease.pk, "/cleanup-claims")), 422, "cleanup_intent_invalid"
    )
    assert EnvironmentLease.objects.get(pk=lease.pk).metadata.get("pendingCleanupInFlight") is False


def test_a_completed_export_releases_its_marker_and_then_the_policy_applies(
    company: Company, provider_client: APIClient, environment: Environment
) -> None:
    run = NativeRunFactory(company=company, status="succeeded", native_phase="committed")
    lease = _active_lease(provider_client, environment, run)
    result = NativeRunResultFactory(run=run)
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease, resultId=str(result.pk)))
    run.runner_profile_json = {
        "nativeWorkspaceSync": sync_reference(lease, uuid.uuid4(), state="finalized")
    }
    run.save(update_fields=["runner_profile_json"])
    NativeRunFinalizationFactory(run=run, phase="committed", result=result)
    released = provider_client.post(
        lease_url(lease.pk, "/release"), {"outcome": "succeeded"}, format="json"
    ).json()
    assert (released["status"], released["failure_reason"]) == ("pending_cleanup", None)
    assert "nativeWorkspaceExportResume" not in released["metadata"]
    assert actions(lease.pk) == [
        "environment_lease.acquired",
        "environment_lease.export_resume_released",
        "environment_lease.released",
    ]
    claim = provider_client.post(lease_url(lease.pk, "/cleanup-claims")).json()
    assert claim["stop_only"] is False


def test_a_failed_release_of_a_prepared_export_is_preserved_stop_only(
    company: Company, provider_client: APIClient, environment: Environment
) -> None:
    run = NativeRunFactory(company=company, status="running")
    lease = _active_lease(provider_client, environment, run, policy="reuse_by_environment")
    result = NativeRunResultFactory(run=run)
    run.runner_profile_json = {"nativeWorkspaceSync": sync_reference(lease, uuid.uuid4())}
    run.save(update_fields=["runner_profile_json"])
    released = provider_client.post(
        lease_url(lease.pk, "/release"), {"outcome": "failed"}, format="json"
    ).json()
    assert (released["status"], released["failure_reason"]) == (
        "pending_cleanup",
        "workspace_export_stop_pending",
    )
    marker = released["metadata"]["nativeWorkspaceExportResume"]
    assert (marker["resultId"], marker["pluginId"]) == (str(result.pk), "plugin-daytona")
    assert actions(lease.pk) == [
        "environment_lease.acquired",
        "environment_lease.export_resume_preserved",
        "environment_lease.released",
    ]
    assert provider_client.post(lease_url(lease.pk, "/cleanup-claims")).json()["stop_only"] is True


# --- single flight ----------------------------------------------------------------------------


def test_single_flight_is_a_clean_409(
    company: Company,
    provider_client: APIClient,
    environment: Environment,
    run: HeartbeatRun,
) -> None:
    workspace = ExecutionWorkspaceFactory(company=company)
    first = _active_lease(provider_client, environment, run, workspace=workspace)
    refused = provider_client.post(
        ACQUIRE, acquire_body(environment, run, workspace=workspace), format="json"
    )
    error = assert_error(refused, 409, "environment_lease_single_flight")
    assert error["details"] == {
        "environment_id": str(environment.pk),
        "execution_workspace_id": str(workspace.pk),
        "lease_id": str(first.pk),
    }
    # Other slots, other policies and no workspace are not single-flight.
    other_workspace = ExecutionWorkspaceFactory(company=company)
    for body in (
        acquire_body(environment, run, workspace=other_workspace),
        acquire_body(environment, run, workspace=workspace, policy="reuse_by_execution_workspace"),
        acquire_body(environment, run),
        acquire_body(environment, run),
    ):
        assert provider_client.post(ACQUIRE, body, format="json").status_code == 201
    provider_client.post(lease_url(first.pk, "/release"), {"outcome": "succeeded"}, format="json")
    again = provider_client.post(
        ACQUIRE, acquire_body(environment, run, workspace=workspace), format="json"
    )
    assert again.status_code == 201


def test_the_partial_unique_index_backs_the_lock_with_the_same_409(
    company: Company,
    provider_client: APIClient,
    environment: Environment,
    run: HeartbeatRun,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workspace = ExecutionWorkspaceFactory(company=company)
    first = _active_lease(provider_client, environment, run, workspace=workspace)
    # Take away the first line (the check under the slot lock): the index still refuses.
    monkeypatch.setattr(leases.environment.lifecycle, "_slot_holder", lambda live: None)
    refused = provider_client.post(
        ACQUIRE, acquire_body(environment, run, workspace=workspace), format="json"
    )
    error = assert_error(refused, 409, "environment_lease_single_flight")
    assert error["details"]["lease_id"] == str(first.pk)
    assert EnvironmentLease.objects.filter(execution_workspace=workspace).count() == 1
    assert actions(first.pk) == ["environment_lease.acquired"]


def _waiters(probe: Any, wait_event: str) -> int:
    row = probe.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND wait_event = %s",
        [wait_event],
    ).fetchone()
    return int(row[0])


def _wait_for(probe: Any, wait_event: str, count: int, futures: list[Future[Any]]) -> int:
    deadline = time.monotonic() + 20
    while (seen := _waiters(probe, wait_event)) < count:
        assert time.monotonic() < deadline, f"never saw {count} waiting on {wait_event}"
        assert not any(f.done() for f in futures), [f.result() for f in futures]
        time.sleep(0.01)  # polling for a condition, not synchronisation by sleep
    return seen


def _request(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    try:
        response = call()
        return response.status_code, response.json()
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_two_providers_racing_for_one_single_flight_slot_get_one_lease(
    make_agent_client: Callable[[Agent], APIClient],
) -> None:
    company = CompanyFactory()
    environment = EnvironmentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)
    run = NativeRunFactory(company=company, status="running")
    clients = [make_agent_client(ProviderAgentFactory(company=company)) for _ in range(2)]
    bodies = [acquire_body(environment, run, workspace=workspace) for _ in clients]
    holder, probe = raw_connection(autocommit=False), raw_connection()
    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            [environment_slot_key(environment.pk, workspace.pk)],
        )
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [
                pool.submit(_request, lambda c=c, b=b: c.post(ACQUIRE, b, format="json"))
                for c, b in zip(clients, bodies, strict=True)
            ]
            # Evidence of overlap: both requests are inside their transactions, waiting for the
            # same slot at the same moment.
            overlap = _wait_for(probe, "advisory", 2, futures)
            holder.rollback()
            outcomes = sorted((f.result(timeout=30) for f in futures), key=lambda o: o[0])
    finally:
        holder.close()
        probe.close()
    assert overlap == 2
    assert [status for status, _ in outcomes] == [201, 409]
    (_, won), (_, lost) = outcomes
    assert lost["error"]["code"] == "environment_lease_single_flight"
    assert lost["error"]["details"]["lease_id"] == won["id"]
    assert list(EnvironmentLease.objects.values_list("pk", flat=True)) == [uuid.UUID(won["id"])]
    assert ActivityEvent.objects.filter(action="environment_lease.acquired").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_release_racing_a_cleanup_claim_never_claims_an_active_lease(
    make_agent_client: Callable[[Agent], APIClient],
) -> None:
    company = CompanyFactory()
    environment = EnvironmentFactory(company=company)
    run = NativeRunFactory(company=company, status="running")
    releaser, claimer = (make_agent_client(ProviderAgentFactory(company=company)) for _ in range(2))
    lease_id = releaser.post(ACQUIRE, acquire_body(environment, run), format="json").json()["id"]
    holder, probe = raw_connection(autocommit=False), raw_connection()
    try:
        holder.execute("SELECT 1 FROM environment_leases WHERE id = %s FOR UPDATE", [lease_id])
        with ThreadPoolExecutor(max_workers=2) as pool:
            release = pool.submit(
                _request,
                lambda: releaser.post(
                    lease_url(lease_id, "/release"), {"outcome": "succeeded"}, format="json"
                ),
            )
            _wait_for(probe, "transactionid", 1, [release])
            claim = pool.submit(
                _request, lambda: claimer.post(lease_url(lease_id, "/cleanup-claims"))
            )
            # Both wait on the row at once: the release for the holder, the claim behind it.
            deadline = time.monotonic() + 20
            while _waiters(probe, "transactionid") + _waiters(probe, "tuple") < 2:
                assert time.monotonic() < deadline, "the claim never reached the row lock"
                assert not claim.done(), claim.result()
                time.sleep(0.01)  # polling for a condition, not synchronisation by sleep
            holder.rollback()
            released, claimed = release.result(timeout=30), claim.result(timeout=30)
    finally:
        holder.close()
        probe.close()
    assert released[0] == 200, released
    assert released[1]["status"] == "pending_cleanup"
    lease = EnvironmentLease.objects.get(pk=lease_id)
    if claimed[0] == 200:
        # The release went first: the claim saw the pending cleanup and holds it.
        assert lease.metadata["pendingCleanupAttemptId"] == claimed[1]["attempt_id"]
        assert lease.metadata["pendingCleanupInFlight"] is True
        expected = ["released", "cleanup_claimed"]
    else:
        # The claim went first and found the lease still active: nothing was claimed.
        assert (claimed[0], claimed[1]["error"]["code"]) == (409, "cleanup_not_pending")
        assert lease.metadata["pendingCleanupInFlight"] is False
        expected = ["released"]
    assert lease.status == "pending_cleanup"
    assert actions(lease_id) == ["environment_lease.acquired"] + [
        f"environment_lease.{a}" for a in expected
    ]


# --- roles and companies ------------------------------------------------------------------------


def test_only_provider_agents_drive_leases_and_cleanups(
    company: Company,
    agent_client: APIClient,
    board_client: APIClient,
    provider_client: APIClient,
    environment: Environment,
    run: HeartbeatRun,
) -> None:
    lease = _active_lease(provider_client, environment, run)
    body = acquire_body(environment, run)
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("post", ACQUIRE, body),
        ("post", lease_url(lease.pk, "/heartbeat"), None),
        ("post", lease_url(lease.pk, "/release"), {"outcome": "succeeded"}),
        ("post", lease_url(lease.pk, "/cleanup-claims"), None),
        (
            "post",
            lease_url(lease.pk, "/cleanup-receipts"),
            {"attempt_id": "a", "receipt": {"provider_lease_id": "p", "state": "stopped"}},
        ),
    ]
    before = ActivityEvent.objects.count()
    for method, url, data in calls:
        for client in (agent_client, board_client):
            response = getattr(client, method)(url, data, format="json")
            assert_error(response, 403, "permission_denied")
        assert getattr(APIClient(), method)(url, data, format="json").status_code == 401
    # Reads: a worker agent may not read leases; the board reads and lists them.
    assert_error(agent_client.get(lease_url(lease.pk)), 403, "permission_denied")
    assert_error(
        agent_client.get(f"/api/companies/{company.pk}/environment-leases"),
        403,
        "permission_denied",
    )
    assert_error(
        provider_client.get(f"/api/companies/{company.pk}/environment-leases"),
        403,
        "permission_denied",
    )
    assert board_client.get(lease_url(lease.pk)).status_code == 200
    assert ActivityEvent.objects.count() == before
    assert EnvironmentLease.objects.get(pk=lease.pk).status == "active"


def test_another_companys_leases_and_objects_are_404(
    company: Company,
    provider_client: APIClient,
    make_agent_client: Callable[[Agent], APIClient],
    make_board_client: Callable[..., APIClient],
    environment: Environment,
    run: HeartbeatRun,
) -> None:
    lease = _active_lease(provider_client, environment, run)
    other = CompanyFactory()
    stranger = make_agent_client(ProviderAgentFactory(company=other))
    stranger_board = make_board_client(other)
    before = ActivityEvent.objects.count()
    for url, data in (
        (lease_url(lease.pk, "/heartbeat"), None),
        (lease_url(lease.pk, "/release"), {"outcome": "failed"}),
        (lease_url(lease.pk, "/cleanup-claims"), None),
    ):
        assert_error(stranger.post(url, data, format="json"), 404, "not_found")
        assert_error(
            stranger.post(url.replace(str(lease.pk), str(uuid.uuid4())), data, format="json"),
            404,
            "not_found",
        )
    assert_error(stranger.get(lease_url(lease.pk)), 404, "not_found")
    assert_error(stranger_board.get(lease_url(lease.pk)), 404, "not_found")
    assert_error(
        stranger_board.get(f"/api/companies/{company.pk}/environment-leases"), 404, "not_found"
    )
    # Ids of another company inside an acquire body are as missing as random ones.
    own_env = EnvironmentFactory(company=other)
    own_run = NativeRunFactory(company=other, status="running")
    for body in (
        acquire_body(environment, own_run),
        acquire_body(own_env, run),
        acquire_body(own_env, own_run, workspace=ExecutionWorkspaceFactory(company=company)),
    ):
        assert_error(stranger.post(ACQUIRE, body, format="json"), 404, "not_found")
    assert ActivityEvent.objects.count() == before
    assert EnvironmentLease.objects.get(pk=lease.pk).status == "active"


def test_strict_acquire_and_release_bodies(
    provider_client: APIClient, environment: Environment, run: HeartbeatRun
) -> None:
    body = acquire_body(environment, run)
    for change, field in (
        ({"lease_policy": "forever"}, "lease_policy"),
        ({"remote_cwd": "relative/dir"}, "remote_cwd"),
        ({"provider_lease_id": 12}, "provider_lease_id"),
        ({"extra": True}, "extra"),
        ({"environment_id": "not-a-uuid"}, "environment_id"),
    ):
        response = provider_client.post(ACQUIRE, {**body, **change}, format="json")
        assert field in assert_error(response, 400, "invalid_request")["details"]["fields"]
    lease = _active_lease(provider_client, environment, run)
    bad = provider_client.post(lease_url(lease.pk, "/release"), {"outcome": "meh"}, format="json")
    assert "outcome" in assert_error(bad, 400, "invalid_request")["details"]["fields"]
    assert not EnvironmentLease.objects.exclude(pk=lease.pk).exists()


# --- the cleanup claim's 15 minutes, on the database clock ---------------------------------------


def test_a_claim_never_settled_is_claimable_again_once_its_15_minutes_pass(
    provider_client: APIClient, environment: Environment, run: HeartbeatRun
) -> None:
    # now() stands still inside this test's transaction: the boundary is exact.
    now_ms = int(db_now().timestamp() * 1000)
    lease = _active_lease(provider_client, environment, run)
    provider_client.post(lease_url(lease.pk, "/release"), {"outcome": "succeeded"}, format="json")
    first = provider_client.post(lease_url(lease.pk, "/cleanup-claims")).json()
    stored = EnvironmentLease.objects.get(pk=lease.pk)
    assert stored.metadata["pendingCleanupLeaseExpiresAtMs"] == now_ms + 15 * 60 * 1000
    # One millisecond before the 15 minutes are over (database clock): still in flight.
    set_meta(stored, pendingCleanupLeaseExpiresAtMs=now_ms + 1)
    assert_error(
        provider_client.post(lease_url(lease.pk, "/cleanup-claims")), 409, "cleanup_in_flight"
    )
    # Exactly over: claimable again, with a new attempt; the first attempt's receipt is stale.
    set_meta(EnvironmentLease.objects.get(pk=lease.pk), pendingCleanupLeaseExpiresAtMs=now_ms)
    second = provider_client.post(lease_url(lease.pk, "/cleanup-claims"))
    assert second.status_code == 200
    assert second.json()["attempt_id"] != first["attempt_id"]
    reclaim = ActivityEvent.objects.filter(action="environment_lease.cleanup_claimed").latest(
        "created_at"
    )
    assert reclaim.details["reclaimedExpiredClaim"] is True
    assert reclaim.details["previousAttemptId"] == first["attempt_id"]
    late = provider_client.post(
        lease_url(lease.pk, "/cleanup-receipts"),
        {
            "attempt_id": first["attempt_id"],
            "receipt": {"provider_lease_id": lease.provider_lease_id, "state": "destroyed"},
        },
        format="json",
    )
    assert (
        assert_error(late, 409, "cleanup_attempt_stale")["details"]["reason"] == "attempt_mismatch"
    )


@pytest.mark.django_db(transaction=True)
def test_claim_expiry_follows_the_database_clock_as_it_moves(
    make_agent_client: Callable[[Agent], APIClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(leases.environment.services, "CLEANUP_CLAIM_TTL_MS", 1500)
    # The application's clock is of no account: make it lie by a day.
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 86_400)
    company = CompanyFactory()
    client = make_agent_client(ProviderAgentFactory(company=company))
    run = NativeRunFactory(company=company, status="running")
    lease_id = client.post(
        ACQUIRE, acquire_body(EnvironmentFactory(company=company), run), format="json"
    ).json()["id"]
    client.post(lease_url(lease_id, "/release"), {"outcome": "failed"}, format="json")
    claimed = client.post(lease_url(lease_id, "/cleanup-claims"))
    assert claimed.status_code == 200
    expiry = EnvironmentLease.objects.get(pk=lease_id).metadata["pendingCleanupLeaseExpiresAtMs"]
    assert_error(client.post(lease_url(lease_id, "/cleanup-claims")), 409, "cleanup_in_flight")
    with raw_connection() as probe:
        deadline = real_time() + 20
        while (
            probe.execute("SELECT (extract(epoch from now()) * 1000)::bigint").fetchone()[0]
            < expiry
        ):  # type: ignore[index]
            assert real_time() < deadline
            time.sleep(0.05)  # polling the database clock, not synchronisation by sleep
    again = client.post(lease_url(lease_id, "/cleanup-claims"))
    assert again.status_code == 200, again.json()
    assert again.json()["attempt_id"] != claimed.json()["attempt_id"]


# --- the worker retries a failed cleanup after its back-off -------------------------------------


@pytest.mark.django_db(transaction=True)
@override_settings(PAPERCLIP_CLEANUP_RETRY_BASE_SECONDS=2, PAPERCLIP_CLEANUP_RETRY_CAP_SECONDS=2)
def test_the_worker_retries_a_failed_cleanup_after_the_back_off_and_not_before(
    make_agent_client: Callable[[Agent], APIClient],
) -> None:
    company = CompanyFactory()
    client = make_agent_client(ProviderAgentFactory(company=company))
    run = NativeRunFactory(company=company, status="running")
    body = acquire_body(EnvironmentFactory(company=company), run)
    lease_id = client.post(ACQUIRE, body, format="json").json()["id"]
    client.post(lease_url(lease_id, "/release"), {"outcome": "succeeded"}, format="json")
    attempt = client.post(lease_url(lease_id, "/cleanup-claims")).json()["attempt_id"]
    failed = client.post(
        lease_url(lease_id, "/cleanup-receipts"),
        {
            "attempt_id": attempt,
            "receipt": {"provider_lease_id": body["provider_lease_id"], "state": "failed"},
        },
        format="json",
    ).json()
    assert (failed["status"], failed["cleanup_status"]) == ("pending_cleanup", "failed")
    retry_after = failed["metadata"]["pendingCleanupRetryAfterMs"]

    def sweep() -> EnvironmentLease:
        with transaction.atomic():
            job_defer_in_tx("retry_environment_cleanups", timestamp=int(time.time()))
        run_jobs("maintenance")
        return EnvironmentLease.objects.get(pk=lease_id)

    early = sweep()
    if int(db_now().timestamp() * 1000) < retry_after:  # the back-off (2 s) is not over yet
        assert early.cleanup_status == "failed"
        assert not ActivityEvent.objects.filter(
            action="environment_lease.cleanup_retry_due"
        ).exists()
        assert_error(
            client.post(lease_url(lease_id, "/cleanup-claims")), 409, "cleanup_retry_not_due"
        )
    deadline = time.monotonic() + 20
    while int(db_now().timestamp() * 1000) < retry_after:
        assert time.monotonic() < deadline
        time.sleep(0.05)  # polling the database clock, not synchronisation by sleep
    reopened = sweep()
    assert reopened.cleanup_status == "pending"
    assert reopened.metadata["pendingCleanupRetryAttempts"] == 1  # the attempt count is kept
    assert reopened.metadata["pendingCleanupRetryAfterMs"] == 0
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_retry_due").count() == 1
    again = client.post(lease_url(lease_id, "/cleanup-claims"))
    assert again.status_code == 200, again.json()
    settled = client.post(
        lease_url(lease_id, "/cleanup-receipts"),
        {
            "attempt_id": again.json()["attempt_id"],
            "receipt": {"provider_lease_id": body["provider_lease_id"], "state": "destroyed"},
        },
        format="json",
    ).json()
    assert (settled["status"], settled["cleanup_status"]) == ("released", "success")


def test_an_archived_environment_takes_no_new_lease_but_repeats_answer(
    provider_client: APIClient, environment: Environment, run: HeartbeatRun
) -> None:
    body = acquire_body(environment, run)
    first = provider_client.post(ACQUIRE, body, format="json")
    assert first.status_code == 201
    Environment.objects.filter(pk=environment.pk).update(status=Environment.Status.ARCHIVED)
    leases = EnvironmentLease.objects.count()
    # The allocation it already holds is still answered (an idempotent repeat)...
    repeat = provider_client.post(ACQUIRE, body, format="json")
    assert repeat.status_code == 200
    assert repeat.json()["id"] == first.json()["id"]
    # ...but nothing new is leased in it.
    other = acquire_body(environment, run)
    refused = provider_client.post(ACQUIRE, other, format="json")
    error = assert_error(refused, 409, "environment_archived")
    assert error["details"] == {"environment_id": str(environment.pk)}
    assert EnvironmentLease.objects.count() == leases


def test_a_failed_release_of_another_lease_of_the_run_releases_the_lease_asked_for(
    company: Company, provider_client: APIClient, environment: Environment
) -> None:
    run = NativeRunFactory(company=company, status="running")
    export_lease = _active_lease(provider_client, environment, run, policy="reuse_by_environment")
    other = _active_lease(provider_client, environment, run, policy="ephemeral")
    NativeRunResultFactory(run=run)
    run.runner_profile_json = {"nativeWorkspaceSync": sync_reference(export_lease, uuid.uuid4())}
    run.save(update_fields=["runner_profile_json"])

    released = provider_client.post(
        lease_url(other.pk, "/release"), {"outcome": "failed"}, format="json"
    )
    assert released.status_code == 200, released.json()
    # The answer is about the lease in the path, which is no longer active.
    assert released.json()["id"] == str(other.pk)
    assert EnvironmentLease.objects.get(pk=other.pk).status == "pending_cleanup"
    # The export lease, which nobody released, is left as it was.
    assert EnvironmentLease.objects.get(pk=export_lease.pk).status == "active"
