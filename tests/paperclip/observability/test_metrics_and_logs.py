"""Metrics and logs in one process: the request id, the counters each kind of event moves (by
exactly one, and only once its transaction commits), /metrics' guard, the log formats, and that
no secret or checkpoint content reaches a log line.

The tests run inside the test's transaction, which never commits: `committed()` runs the
on-commit callbacks registered in its block when the block ends, as a real commit would. Only
the request-log test commits for real: an audit line carries the request id only when its
transaction commits inside the request."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from prometheus_client import REGISTRY

from paperclip.activity import activity_record
from paperclip.observability import metrics
from paperclip.observability.logs import ContextFilter, JsonFormatter
from tests.helpers import assert_error, sample
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory

pytestmark = pytest.mark.django_db


def claim_url(workspace: Any) -> str:
    return f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"


@pytest.fixture
def committed(
    django_capture_on_commit_callbacks: Callable[..., Any],
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A block whose on-commit callbacks run when it ends, as its transaction's commit would
    run them (a callback of a rolled-back savepoint inside it is dropped, as on rollback)."""
    return partial(django_capture_on_commit_callbacks, execute=True)


@pytest.fixture
def workspace(company: Any) -> Any:
    return ExecutionWorkspaceFactory(company=company)


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    """Every record of the project's loggers, formatted as the JSON format writes it."""
    lines: list[str] = []
    formatter = JsonFormatter()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(formatter.format(record))

    handler = Keep()
    handler.addFilter(ContextFilter())
    root = logging.getLogger()  # every logger propagates here
    root.addHandler(handler)
    try:
        yield lines
    finally:
        root.removeHandler(handler)


def test_every_response_carries_a_request_id_and_keeps_a_safe_incoming_one(
    client: Client,
) -> None:
    fresh = client.get("/healthz")
    kept = client.get("/healthz", HTTP_X_REQUEST_ID="edge-proxy:4f2a.9")
    too_long = client.get("/healthz", HTTP_X_REQUEST_ID="a" * 129)
    unsafe = client.get("/healthz", HTTP_X_REQUEST_ID="x\ny")
    not_found = client.get("/no/such/page", HTTP_X_REQUEST_ID="abc")

    assert len(fresh["X-Request-ID"]) == 32
    assert kept["X-Request-ID"] == "edge-proxy:4f2a.9"
    assert client.get("/healthz", HTTP_X_REQUEST_ID="a" * 128)["X-Request-ID"] == "a" * 128
    assert too_long["X-Request-ID"] not in ("a" * 129, "")
    assert len(too_long["X-Request-ID"]) == 32
    assert unsafe["X-Request-ID"] != "x\ny"
    assert not_found.status_code == 404
    assert not_found["X-Request-ID"] == "abc"


def test_claims_count_by_outcome_and_conflicts_by_error_code(
    agent_client: Any, make_agent_client: Any, workspace: Any, committed: Any
) -> None:
    before = {
        outcome: sample("paperclip_runtime_lease_claims_total", outcome=outcome)
        for outcome in ("created", "renewed")
    }
    conflicts = sample(
        "paperclip_api_errors_total", code="workspace_runtime_lease_conflict", status="409"
    )
    route = "runtime-lease-claim"
    requests = sample("paperclip_http_requests_total", route=route, method="POST", status="200")

    for _ in range(3):
        with committed():
            response = agent_client.post(claim_url(workspace), {"action": "start"}, format="json")
        assert response.status_code == 200
    rival = make_agent_client(AgentFactory(company=workspace.company))
    with committed():
        refused = rival.post(claim_url(workspace), {"action": "stop"}, format="json")

    assert_error(refused, 409, "workspace_runtime_lease_conflict")
    assert sample("paperclip_runtime_lease_claims_total", outcome="created") == (
        before["created"] + 1
    )
    assert sample("paperclip_runtime_lease_claims_total", outcome="renewed") == (
        before["renewed"] + 2
    )
    assert sample(
        "paperclip_api_errors_total", code="workspace_runtime_lease_conflict", status="409"
    ) == (conflicts + 1)
    assert sample("paperclip_http_requests_total", route=route, method="POST", status="200") == (
        requests + 3
    )
    assert sample("paperclip_http_request_duration_seconds_count", route=route, method="POST") > 0


def test_an_audit_row_moves_its_counters_only_when_it_commits(company: Any, committed: Any) -> None:
    def count() -> float:
        return sample("paperclip_runtime_lease_releases_total", kind="force_released")

    def record() -> None:
        activity_record(
            company_id=company.pk,
            actor_type="user",
            actor_id="board",
            action="runtime_lease.force_released",
            entity_type="execution_workspace",
            entity_id=company.pk,
        )

    before = count()
    with committed(), contextlib.suppress(RuntimeError), transaction.atomic():
        record()
        raise RuntimeError("rolled back")
    assert count() == before
    with committed(), transaction.atomic():
        record()
        assert count() == before  # not yet: the commit moves it
    assert count() == before + 1
    assert sample("paperclip_audit_events_total", action="runtime_lease.force_released") >= 1


def test_metrics_are_off_by_default_then_guarded_by_the_token(
    client: Client, settings: Any
) -> None:
    assert_error(client.get("/metrics"), 404, "not_found")

    settings.PAPERCLIP_METRICS_ENABLED = True
    settings.PAPERCLIP_METRICS_TOKEN = "s3cret-scrape-token"
    assert_error(client.get("/metrics"), 401, "not_authenticated")
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-the-token")
    assert_error(wrong, 401, "not_authenticated")
    assert wrong["WWW-Authenticate"].startswith("Bearer")
    scraped = client.get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret-scrape-token")
    assert scraped.status_code == 200
    assert scraped["Content-Type"].startswith("text/plain")
    text = scraped.content.decode()
    assert "# TYPE paperclip_http_requests_total counter" in text
    assert "paperclip_jobs" in text

    settings.PAPERCLIP_METRICS_TOKEN = ""
    assert client.get("/metrics").status_code == 200  # enabled without a token: open


@pytest.mark.django_db(transaction=True)
def test_a_request_logs_one_json_line_with_its_context_and_no_secret(
    make_agent_client: Any, agent: Any, workspace: Any, log_lines: list[str]
) -> None:
    api = make_agent_client(agent)
    key = api._credentials["HTTP_AUTHORIZATION"].split()[1]
    response = api.post(
        claim_url(workspace), {"action": "start"}, format="json", HTTP_X_REQUEST_ID="req-77"
    )
    assert response.status_code == 200

    requests = [json.loads(line) for line in log_lines if '"paperclip.request"' in line]
    assert len(requests) == 1
    line = requests[0]
    assert line["request_id"] == "req-77"
    assert line["http"]["route"] == "runtime-lease-claim"
    assert line["http"]["status"] == 200
    assert line["http"]["workspace_id"] == str(workspace.pk)
    assert line["actor_type"] == "agent"
    assert line["actor_id"] == str(agent.pk)
    assert line["company_id"] == str(agent.company_id)
    audits = [json.loads(line) for line in log_lines if '"paperclip.audit"' in line]
    assert [audit["event"]["action"] for audit in audits] == [
        "agent_key.created",  # minting the key, before the request: no request id
        "runtime_lease.created",
    ]
    assert [audit.get("request_id") for audit in audits] == [None, "req-77"]
    everything = "\n".join(log_lines)
    assert key not in everything
    assert key.split(".")[1] not in everything


def test_checkpoint_contents_and_key_material_never_reach_a_log_line(
    make_agent_client: Any, log_lines: list[str], settings: Any, tmp_path: Any, committed: Any
) -> None:
    """A checkpoint written and read back over the API: the counters move, and neither the
    parts' contents nor the checkpoint key appears in any line (request, audit or other)."""
    from tests.checkpoints.factories import TEST_KEY, coordinator

    settings.DATA_DIR = tmp_path / "data"
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]
    fin = coordinator()
    runner = make_agent_client(fin.run.agent)
    base = f"/api/heartbeat-runs/{fin.run_id}"
    writes = sample("paperclip_checkpoint_operations_total", operation="write")
    written_bytes = sample("paperclip_checkpoint_bytes_total", operation="write")
    reads = sample("paperclip_checkpoint_operations_total", operation="read")
    acquired = sample("paperclip_controller_lease_operations_total", operation="acquired")
    renewed = sample("paperclip_controller_lease_operations_total", operation="renewed")
    with committed():
        grant = runner.post(f"{base}/controller-lease", {"boot_id": "boot-a"}, format="json").json()
    again = {"boot_id": "boot-a", "lease_owner": grant["lease_owner"]}
    with committed():
        assert runner.post(f"{base}/controller-lease", again, format="json").status_code == 200
    assert sample("paperclip_controller_lease_operations_total", operation="acquired") == (
        acquired + 1
    )
    assert sample("paperclip_controller_lease_operations_total", operation="renewed") == (
        renewed + 1
    )
    contents = "SECRET-CHECKPOINT-CONTENTS-41f9"
    with committed():
        put = runner.put(
            f"{base}/checkpoint",
            {
                "owner": {
                    "boot_id": grant["controller_boot_id"],
                    "lease_owner": grant["lease_owner"],
                    "generation": grant["generation"],
                },
                "reset": False,
                "changed": {"header": contents, "log": contents * 2},
                "removed": [],
                "work_command_ids": [],
                "predecessor": None,
            },
            format="json",
        )
    assert put.status_code == 200, put.json()
    with committed():
        read = runner.get(f"{base}/checkpoint")
    assert read.json()["parts"]["header"] == contents

    assert sample("paperclip_checkpoint_operations_total", operation="write") == writes + 1
    assert sample("paperclip_checkpoint_bytes_total", operation="write") == (
        written_bytes + 3 * len(contents)
    )
    assert sample("paperclip_checkpoint_operations_total", operation="read") == reads + 1
    everything = "\n".join(log_lines)
    assert any('"checkpoint.written"' in line for line in log_lines)
    assert contents not in everything
    assert TEST_KEY not in everything


def _series(name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == name
    }


# What each audited action must count (docs/operations.md#counters-and-histograms), written
# out here rather than read from the implementation's table.
AUDITED = {
    "runtime_lease.created": [("paperclip_runtime_lease_claims_total", {"outcome": "created"})],
    "runtime_lease.bypassed": [("paperclip_runtime_lease_claims_total", {"outcome": "bypassed"})],
    "runtime_lease.reclaimed": [
        ("paperclip_runtime_lease_claims_total", {"outcome": "reclaimed"}),
        ("paperclip_runtime_lease_reclaims_total", {"reason": "lease_expired"}),
    ],
    "runtime_lease.released": [("paperclip_runtime_lease_releases_total", {"kind": "released"})],
    "runtime_lease.force_released": [
        ("paperclip_runtime_lease_releases_total", {"kind": "force_released"})
    ],
    "runtime_lease.swept": [("paperclip_runtime_lease_releases_total", {"kind": "swept"})],
    "controller_lease.acquired": [
        ("paperclip_controller_lease_operations_total", {"operation": "acquired"})
    ],
    "controller_lease.taken_over": [
        ("paperclip_controller_lease_operations_total", {"operation": "taken_over"})
    ],
    "controller_lease.expired": [
        ("paperclip_controller_lease_operations_total", {"operation": "expired"})
    ],
    "controller_lease.expired_on_failure": [
        ("paperclip_controller_lease_operations_total", {"operation": "expired"})
    ],
    "run.workspace_finalize_started": [("paperclip_finalizations_total", {"outcome": "started"})],
    "run.finalization_committed": [("paperclip_finalizations_total", {"outcome": "committed"})],
    "run.workspace_finalize_retry_exhausted": [
        ("paperclip_finalizations_total", {"outcome": "failed"})
    ],
    "run.workspace_finalize_abandoned": [
        ("paperclip_finalizations_total", {"outcome": "abandoned"})
    ],
    "issue.workspace_owner_stop_confirmed": [
        ("paperclip_owner_stop_confirmations_total", {"kind": "board"})
    ],
    "issue.workspace_owner_stop_verified": [
        ("paperclip_owner_stop_confirmations_total", {"kind": "platform"})
    ],
    "environment_lease.cleanup_claimed": [
        ("paperclip_environment_cleanups_total", {"event": "claimed"})
    ],
    "environment_lease.cleanup_settled": [
        ("paperclip_environment_cleanups_total", {"event": "settled"})
    ],
    "environment_lease.cleanup_retry_due": [
        ("paperclip_environment_cleanups_total", {"event": "retry_due"})
    ],
    "checkpoint.written": [],  # counted by the writer itself, with its bytes and time
}


def test_every_mapped_action_is_specified_here() -> None:
    assert set(metrics._AUDIT_EFFECTS) <= set(AUDITED)


@pytest.mark.parametrize("action", sorted(AUDITED))
def test_each_audited_action_moves_its_counters_by_exactly_one(
    company: Any, action: str, committed: Any
) -> None:
    """One committed audit row of `action` moves paperclip_audit_events_total and exactly the
    counters the operations guide names for it, each by one, and no other series."""
    names = {
        "paperclip_audit_events_total",
        *(
            described.name + "_total"
            for counter in metrics._COUNTED_BY_AUDIT
            for described in counter.describe()
        ),
    }
    before = {name: _series(name) for name in names}
    with committed(), transaction.atomic():
        activity_record(
            company_id=company.pk,
            actor_type="system",
            actor_id="test",
            action=action,
            entity_type="test",
            entity_id=company.pk,
            details={"reason": "lease_expired"},
        )
    moved = {}
    for name in names:
        for labels, value in _series(name).items():
            delta = value - before[name].get(labels, 0.0)
            if delta:
                moved[(name, labels)] = delta
    expected = {(name, tuple(sorted(labels.items()))): 1.0 for name, labels in AUDITED[action]}
    expected[("paperclip_audit_events_total", (("action", action),))] = 1.0
    assert moved == expected
