"""/metrics of a live multi-process server: a 2-worker gunicorn and a job worker sharing one
metrics directory, scraped before and after driving each kind of event over HTTP. Each counter
moved by exactly what was done, whichever process did it; the job worker's counters
(finalization, copy-back, jobs) reach the web's /metrics; every log line of every process is
one JSON object and none holds a key or a result's contents."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from paperclip.credentials import agent_key_create
from recovery.selectors.finalization import finalization_state
from tests.chaos.run import Config, GunicornServer
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory
from tests.paperclip.worker.test_worker_processes import Worker, fresh_binding, wait_for
from tests.support.processes import child_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TOKEN = "scrape-token-7c1e"
SECRET_RESULT = "result-contents-that-must-never-be-logged"


class Web:
    """The chaos test's gunicorn (2 gthread workers x 2 threads), its output (JSON log lines)
    in its workdir's server.log, and requests over a new connection each time, so that both
    workers take them."""

    def __init__(self, env: dict[str, str], workdir: Path) -> None:
        self.server = GunicornServer(Config(gunicorn_workers=2, gunicorn_threads=2), env, workdir)
        self.server.start()
        self.port = self.server.port
        self.log = self.server.log_path

    def request(
        self, method: str, path: str, body: Any = None, key: str | None = None
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, data

    def stop(self) -> None:
        self.server.stop()


def scrape(web: Web) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    assert response.status == 200
    text = response.read().decode()
    conn.close()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _job_lines(lines: list[str], *, task: str, outcome: str) -> int:
    """How many `paperclip.jobs` lines (JSON log format) a worker wrote for `task` ending
    with `outcome`: one per run of a job, written right after its counters moved."""
    count = 0
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        job = record.get("job") if isinstance(record, dict) else None
        if isinstance(job, dict) and job.get("task") == task and job.get("outcome") == outcome:
            count += 1
    return count


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Web, Worker, Path]]:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    env = {
        "PAPERCLIP_METRICS_ENABLED": "true",
        "PAPERCLIP_METRICS_TOKEN": TOKEN,
        "PAPERCLIP_METRICS_DIR": str(metrics_dir),
        "PAPERCLIP_LOG_FORMAT": "json",
    }
    web = Web(child_env(**env), tmp_path)
    worker = Worker(**env)
    try:
        yield web, worker, tmp_path
    finally:
        worker.stop()
        web.stop()


def test_counters_of_every_process_reach_metrics_exactly(
    stack: tuple[Web, Worker, Path], tmp_path: Path
) -> None:
    web, worker, _ = stack
    workspace = ExecutionWorkspaceFactory()
    holder = AgentFactory(company=workspace.company)
    rival = AgentFactory(company=workspace.company)
    holder_key = agent_key_create(agent_id=holder.pk).secret
    rival_key = agent_key_create(agent_id=rival.pk).secret
    claim = f"/api/execution-workspaces/{workspace.pk}/runtime-lease/claim"
    release = f"/api/execution-workspaces/{workspace.pk}/runtime-lease/release"
    b = fresh_binding(tmp_path / "binding")
    run_key = agent_key_create(agent_id=b.run.agent_id).secret

    before = scrape(web)
    assert web.request("POST", claim, {"action": "start"}, holder_key)[0] == 200
    for _ in range(4):
        assert web.request("POST", claim, {"action": "start"}, holder_key)[0] == 200
    assert web.request("POST", claim, {"action": "stop"}, rival_key)[0] == 409
    assert web.request("POST", release, {}, holder_key)[0] == 200
    status, _ = web.request(
        "POST",
        f"/api/heartbeat-runs/{b.run.pk}/results",
        {"result": {"summary": SECRET_RESULT}, "terminal": {"run_terminal_state": "succeeded"}},
        run_key,
    )
    assert status in (200, 201)

    def committed() -> bool:
        b.run.refresh_from_db()
        return finalization_state(b.run).state == "committed"

    wait_for(committed, "the worker to commit the run", worker)
    deadline = time.monotonic() + 20
    while True:  # the job's own counters move as it returns, just after its commit
        after = scrape(web)
        moved = value(after, "paperclip_jobs_total", task="finalize_run", outcome="succeeded")
        if moved >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    # Under load the worker may run finalize_run for this run more than once (a stalled-job
    # retry, or the reconciler's follow-up, which finds the run committed): each run of the
    # job counts once. Stop the worker, so that every job it ran has counted and logged its
    # one `paperclip.jobs` line, then compare the counter with those lines.
    worker.stop()
    after = scrape(web)
    finalize_runs = _job_lines(worker.lines, task="finalize_run", outcome="succeeded")

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("paperclip_runtime_lease_claims_total", outcome="created") == 1
    assert delta("paperclip_runtime_lease_claims_total", outcome="renewed") == 4
    assert (
        delta("paperclip_api_errors_total", code="workspace_runtime_lease_conflict", status="409")
        == 1
    )
    assert delta("paperclip_runtime_lease_releases_total", kind="released") == 1
    assert (
        delta(
            "paperclip_http_requests_total",
            route="runtime-lease-claim",
            method="POST",
            status="200",
        )
        == 5
    )
    assert delta("paperclip_finalizations_total", outcome="started") == 1
    assert delta("paperclip_finalizations_total", outcome="committed") == 1
    assert delta("paperclip_copyback_duration_seconds_count") == 1
    assert delta("paperclip_copyback_bytes_total") > 0
    assert finalize_runs >= 1
    # Every line the worker wrote since it started, against the counter's total (this test's
    # metrics directory started empty, and only the worker runs jobs): not the delta since
    # `before`, as the reconciler may finalize something before that scrape on a busy machine.
    assert value(after, "paperclip_jobs_total", task="finalize_run", outcome="succeeded") == (
        finalize_runs
    ), "\n".join(line for line in worker.lines if "finalize_run" in line)
    assert value(after, "paperclip_worker_heartbeat_age_seconds") < 30

    # The stuck-work gauges are the dashboard's tiles: one stale lease, seen by both (the job
    # worker stopped first, or its periodic sweep would remove the lease in between).
    worker.stop()
    from recovery.console.attention import attention_summary
    from tests.leases.factories import claim as lease_claim
    from tests.leases.factories import expire

    lease_claim(workspace, holder)
    expire(workspace)
    gauges = scrape(web)
    tiles = attention_summary(company_ids=None, include_jobs=True).tiles
    for tile in tiles:
        if tile.kind == "worker_heartbeat_stale":
            continue
        labels = {"kind": tile.kind, "reason": tile.detail or ""}
        assert value(gauges, "paperclip_stuck_work", **labels) == tile.count, tile
    assert (
        value(gauges, "paperclip_stuck_work", kind="runtime_lease_stale", reason="lease_expired")
        == 1
    )
    assert (
        value(
            gauges,
            "paperclip_stuck_work_oldest_age_seconds",
            kind="runtime_lease_stale",
            reason="lease_expired",
        )
        > 0
    )

    lines = web.log.read_text().splitlines() + worker.lines
    records = [json.loads(line) for line in lines if line.startswith("{")]
    loggers = {record["logger"] for record in records}
    assert {"paperclip.request", "paperclip.audit"} <= loggers
    assert any(r["logger"] == "paperclip.jobs" for r in records)
    text = "\n".join(lines)
    for secret in (holder_key, rival_key, run_key, TOKEN, SECRET_RESULT):
        assert secret not in text
