"""Finalization in the worker: request latency vs workspace size, and how soon a worker starts.

Run with `make bench` (or `.venv/bin/python bench/finalize.py`). Not part of the test suite.

It creates a throwaway database (`paperclip_bench_finalize`, or $PAPERCLIP_BENCH_FINALIZE_DB)
on the server of $DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres), migrates
it, measures, and drops it at the end, also on failure. Requests go over HTTP to a live
gunicorn (as bench/leases.py); jobs run in real worker subprocesses. In one run:

1. Worker wake-up, one idle worker (`manage.py run_worker`, LISTEN/NOTIFY plus its fallback
   polling every PAPERCLIP_WORKER_POLL_SECONDS): `POST /api/heartbeat-runs/{id}/results` one
   at a time, each after the previous job ended and a pause spread evenly over one polling
   interval; the delay from the result's transaction (`run.native_result_accepted` created_at,
   its now(): it over-counts by that transaction's own few milliseconds) to the job's
   `started` event in procrastinate_events (and to its `workspace_finalize` operation row),
   both database timestamps. Baseline, same schedule: a worker built from the same parts with
   LISTEN/NOTIFY off (polling only). Then one run whose workspace holds the large tree, for
   the copy-back time the requests below never wait for.
2. Request latency with no worker running (jobs stay queued, so the time is the request
   alone; the bench checks afterwards that no job of these runs started), for runs whose
   workspace directory holds 10 files and for runs whose directory holds the large tree
   (100,000 small files), interleaved so drift hits both alike:
   - `POST .../results` (accepts the result, defers the finalization job);
   - `POST .../finalize` on those runs (their job is already waiting: answers 202, writes
     nothing);
   - `POST .../finalize` on runs whose automatic retries are spent (defers an explicit job
     and an audit row, answers 202).
   Median and p95 per size, and the ratio large / small (target <= 1.2: independent of size).

Options: --iterations N (requests per path and size, default 200), --files N (large tree,
default 100,000), --results N (wake-up samples of run_worker, default 20), --baseline-results N
(of the polling-only worker, default 10: each costs about one polling interval), --quick
(1,000 files, 10 requests, 3 + 2 samples: a smoke run of under a minute), --keep-db.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.servers import (  # noqa: E402 - after the path setup
    NoDelayHTTPConnection,
    free_port,
    stop_process,
    throwaway_database,
    wait_for_server,
)

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"
WARMUP = 5
SMALL_FILES = 10
POLL_ONLY_FLAG = "--poll-only-worker"


def log(message: str = "") -> None:
    print(message, flush=True)


def main() -> int:
    if POLL_ONLY_FLAG in sys.argv[1:]:
        return poll_only_worker()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=None)
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--results", type=int, default=None)
    parser.add_argument("--baseline-results", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the finally blocks stop the children and clean up.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    quick = args.quick
    config = Config(
        iterations=args.iterations or (10 if quick else 200),
        files=args.files or (1_000 if quick else 100_000),
        results=args.results or (3 if quick else 20),
        baseline_results=args.baseline_results or (2 if quick else 10),
        warmup=2 if quick else WARMUP,
    )
    server_url = os.environ.get("DATABASE_URL") or DEFAULT_SERVER
    name = os.environ.get("PAPERCLIP_BENCH_FINALIZE_DB", "paperclip_bench_finalize")
    scratch = Path(tempfile.mkdtemp(prefix="paperclip-bench-finalize-"))
    # The runs' directories and the workspaces live here: the legacy copy-back reads only under
    # its roots (the worker processes inherit it).
    os.environ["PAPERCLIP_COPYBACK_ROOTS"] = str(scratch)
    try:
        with throwaway_database(server_url, name, keep=args.keep_db, log=log) as bench_url:
            return run(bench_url, config, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        log(f"removed {scratch}")


@dataclass(frozen=True)
class Config:
    iterations: int
    files: int
    results: int
    baseline_results: int
    warmup: int


def django_setup(bench_url: str | None = None) -> None:
    if bench_url is not None:
        os.environ["DATABASE_URL"] = bench_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
    # A bench is neither manage.py nor pytest: give it (and its subprocesses) a throwaway key.
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    import django

    django.setup()


def make_tree(root: Path, files: int) -> Path:
    """`files` small files, at most 1,000 per directory."""
    root.mkdir(parents=True)
    per_dir = 1000
    for start in range(0, files, per_dir):
        directory = root / f"d{start // per_dir:04d}"
        directory.mkdir()
        for i in range(start, min(start + per_dir, files)):
            (directory / f"f{i:06d}.txt").write_text(f"file {i}\n")
    return root


def run(bench_url: str, config: Config, scratch: Path) -> int:
    django_setup(bench_url)
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection

    from paperclip.credentials import agent_key_create
    from paperclip.models import Agent, Company

    log("migrating ...")
    call_command("migrate", verbosity=0)
    company = Company.objects.create(name="bench")
    agent = Agent.objects.create(company=company, name="bench-agent")
    secret = agent_key_create(agent_id=agent.pk).secret
    log(f"creating the workspace trees ({SMALL_FILES} and {config.files:,} files) in {scratch} ...")
    started = time.perf_counter()
    small_tree = make_tree(scratch / "small", SMALL_FILES)
    large_tree = make_tree(scratch / "large", config.files)
    log(f"  done in {time.perf_counter() - started:.1f}s")
    fixtures = Fixtures(company, agent, scratch / "dest")
    poll_seconds = float(settings.PAPERCLIP_WORKER_POLL_SECONDS)

    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": bench_url,
        "DJANGO_CONN_MAX_AGE": "600",  # persistent DB connections, as in production
        "DJANGO_DEBUG": "false",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
    }
    with ExitStack() as stack:
        stack.callback(connection.close)
        log(f"starting gunicorn on 127.0.0.1:{port} (1 worker, gthread, keep-alive) ...")
        server = stack.enter_context(
            subprocess_running(
                "gunicorn",
                [
                    str(Path(sys.executable).with_name("gunicorn")),
                    "paperclip.wsgi:application",
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--workers",
                    "1",
                    "--worker-class",
                    "gthread",
                    "--threads",
                    "2",
                    "--keep-alive",
                    "30",
                    "--log-level",
                    "warning",
                ],
                env,
            )
        )
        client = Client(wait_for_server(port, server, request_timeout=30), secret)
        stack.callback(client.conn.close)

        # --- 1. wake-up delay, one idle worker each ---------------------------------------
        log(f"starting a worker (manage.py run_worker; fallback poll {poll_seconds:g}s) ...")
        with subprocess_running(
            "worker", [sys.executable, "manage.py", "run_worker"], env, quiet=True
        ) as worker:
            wait_for_worker(worker)
            notify = wakeups(client, fixtures, small_tree, config.results, poll_seconds, "notify")
            log(f"finalizing one run with the {config.files:,}-file tree ...")
            large_copy = wakeup(client, fixtures.running(large_tree, 1)[0], timeout=900)
        log("starting a polling-only worker (the same worker, LISTEN/NOTIFY off) ...")
        with subprocess_running(
            "polling-only worker",
            [sys.executable, str(Path(__file__).resolve()), POLL_ONLY_FLAG],
            env,
            quiet=True,
        ) as worker:
            wait_for_worker(worker)
            polling = wakeups(
                client, fixtures, small_tree, config.baseline_results, poll_seconds, "polling"
            )

        # --- 2. request latency, no worker running ----------------------------------------
        latency = request_latency(client, fixtures, small_tree, large_tree, config)

    return report(config, poll_seconds, notify, polling, large_copy, latency)


# --- processes ----------------------------------------------------------------------------


@contextmanager
def subprocess_running(
    label: str, argv: list[str], env: dict[str, str], *, quiet: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """Start a child; on leaving, SIGTERM it (graceful: a worker finishes its running job),
    and kill it if it is still there after 30 s."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL if quiet else None)
    try:
        yield proc
    finally:
        stop_process(proc, timeout=30)
        log(f"{label} (pid {proc.pid}) stopped")


def wait_for_worker(proc: subprocess.Popen[bytes]) -> None:
    """Until the worker registered itself (paperclip's WorkerProcess row for its pid)."""
    from paperclip.models import WorkerProcess

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}")
        if WorkerProcess.objects.filter(pid=proc.pid, stopped_at__isnull=True).exists():
            return
        time.sleep(0.05)  # polling a starting process; not synchronisation between workers
    raise RuntimeError("the worker did not register within 60s")


def poll_only_worker() -> int:
    """The child behind POLL_ONLY_FLAG: `manage.py run_worker`'s own worker_run (concurrency 1,
    every queue), with the one difference that Procrastinate's LISTEN/NOTIFY is off, so new
    jobs are found by polling alone (every PAPERCLIP_WORKER_POLL_SECONDS)."""
    django_setup()
    from procrastinate import worker as procrastinate_worker

    from paperclip.worker import process

    class PollingOnlyWorker(procrastinate_worker.Worker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "listen_notify": False})

    # worker_run builds its worker as `procrastinate_worker.Worker(...)`: swap in ours.
    process.procrastinate_worker = types.SimpleNamespace(Worker=PollingOnlyWorker)  # type: ignore[assignment]
    process.worker_run(name=f"bench-polling-only:{os.getpid()}")
    return 0


# --- HTTP ---------------------------------------------------------------------------------


class Client:
    def __init__(self, conn: NoDelayHTTPConnection, secret: str) -> None:
        self.conn = conn
        self.headers = {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"}

    def post(self, path: str, body: dict[str, Any] | None, expect: int) -> dict[str, Any]:
        self.conn.request(
            "POST",
            path,
            body=json.dumps(body).encode() if body is not None else None,
            headers=self.headers,
        )
        response = self.conn.getresponse()
        payload: dict[str, Any] = json.loads(response.read())
        assert response.status == expect, (path, response.status, payload)
        return payload

    def result(self, run_id: UUID) -> None:
        body = {"result": {"summary": "bench"}, "terminal": {"run_terminal_state": "succeeded"}}
        self.post(f"/api/heartbeat-runs/{run_id}/results", body, 201)

    def finalize(self, run_id: UUID) -> None:
        payload = self.post(f"/api/heartbeat-runs/{run_id}/finalize", None, 202)
        assert payload["status"] == "queued", payload


# --- fixtures -----------------------------------------------------------------------------


class Fixtures:
    """Native runs bound to an issue and an execution workspace, the run's workspace directory
    in its runner profile (as tests/recovery/factories.py's make_binding), in bulk."""

    def __init__(self, company: Any, agent: Any, dest_root: Path) -> None:
        self.company = company
        self.agent = agent
        self.dest_root = dest_root
        self.count = 0

    def running(self, tree: Path, n: int) -> list[UUID]:
        """Running runs waiting for their result (coordinator `observed`)."""
        return self._make(tree, n, spent=False)

    def retries_spent(self, tree: Path, n: int) -> list[UUID]:
        """Runs with an accepted result whose automatic retries are spent
        (`retryable_failure`, no job waiting): what an explicit finalize is for."""
        return self._make(tree, n, spent=True)

    def _make(self, tree: Path, n: int, *, spent: bool) -> list[UUID]:
        from django.db import transaction

        from paperclip.models import (
            ExecutionWorkspace,
            HeartbeatRun,
            Issue,
            NativeRunFinalization,
            NativeRunResult,
        )

        first = self.count
        self.count += n
        numbers = range(first, first + n)
        with transaction.atomic():
            workspaces = ExecutionWorkspace.objects.bulk_create(
                ExecutionWorkspace(
                    company=self.company, name=f"bench-{i}", cwd=str(self.dest_root / f"run-{i}")
                )
                for i in numbers
            )
            issues = Issue.objects.bulk_create(
                Issue(
                    company=self.company,
                    title=f"bench {i}",
                    status=Issue.Status.IN_PROGRESS,
                    assignee_agent=self.agent,
                    execution_workspace=workspace,
                )
                for i, workspace in zip(numbers, workspaces, strict=True)
            )
            profile = {"nativeExecutionInput": {"binding": {"workspaceDir": str(tree)}}}
            runs = HeartbeatRun.objects.bulk_create(
                HeartbeatRun(
                    company=self.company,
                    agent=self.agent,
                    issue=issue,
                    native_issue=issue,
                    execution_workspace=issue.execution_workspace,
                    runner_profile_json=profile,
                    status=HeartbeatRun.Status.RUNNING,
                    runtime_mode=HeartbeatRun.RuntimeMode.NATIVE,
                    completion_contract_id=uuid4(),
                )
                for issue in issues
            )
            for issue, run in zip(issues, runs, strict=True):
                issue.execution_run = run
                issue.checkout_run = run
            Issue.objects.bulk_update(issues, ["execution_run", "checkout_run"])
            results: list[NativeRunResult | None] = [None] * n
            if spent:
                results = list(
                    NativeRunResult.objects.bulk_create(
                        NativeRunResult(
                            company=self.company,
                            issue=issue,
                            run=run,
                            completion_contract_id=run.completion_contract_id,
                            server_fingerprint=uuid4().hex,
                            schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
                            result_json={
                                "result": {},
                                "terminal": {"runTerminalState": "succeeded"},
                            },
                            canonical_sha256=uuid4().hex * 2,
                        )
                        for issue, run in zip(issues, runs, strict=True)
                    )
                )
            phase = (
                NativeRunFinalization.Phase.RETRYABLE_FAILURE
                if spent
                else NativeRunFinalization.Phase.OBSERVED
            )
            NativeRunFinalization.objects.bulk_create(
                NativeRunFinalization(
                    run=run,
                    company=self.company,
                    issue=issue,
                    phase=phase,
                    result=result,
                    attempt=5 if spent else 0,
                    failure_code="workspace_copyback_retry_exhausted" if spent else None,
                )
                for issue, run, result in zip(issues, runs, results, strict=True)
            )
        return [run.pk for run in runs]


# --- 1. wake-up delay ---------------------------------------------------------------------


@dataclass(frozen=True)
class Wakeup:
    to_started: float  # result transaction -> job `started` event (s)
    to_operation: float  # result transaction -> `workspace_finalize` row (s)
    copy: float  # the operation's own duration, started -> finished (s)
    files: int


def pause_schedule(n: int, poll_seconds: float) -> list[float]:
    """Pauses before each result, spread evenly over one polling interval (shuffled, fixed
    seed): a polling worker then sees results land at every phase of its sleep."""
    offsets = [poll_seconds * (i + 0.5) / n for i in range(n)]
    random.Random(1).shuffle(offsets)
    return offsets


def wakeups(
    client: Client, fixtures: Fixtures, tree: Path, n: int, poll_seconds: float, label: str
) -> list[Wakeup]:
    """n results, one at a time, each after the previous job ended and a pause from
    pause_schedule (the same schedule for every worker measured)."""
    runs = fixtures.running(tree, n + 1)
    wakeup(client, runs[0])  # warm-up: the worker's first job (imports, connections)
    samples = []
    offsets = pause_schedule(n, poll_seconds)
    for number, (run_id, pause) in enumerate(zip(runs[1:], offsets, strict=True), 1):
        time.sleep(pause)
        sample = wakeup(client, run_id)
        samples.append(sample)
        log(
            f"  {label} {number}/{n}: paused {pause:.2f}s, job started after "
            f"{sample.to_started * 1000:.1f} ms"
        )
    return samples


def wakeup(client: Client, run_id: UUID, timeout: float = 120) -> Wakeup:
    """POST the run's result, wait until its finalization job ended, and read the database
    timestamps of the result, the job's start and the copy-back operation."""
    from procrastinate.contrib.django.models import ProcrastinateEvent, ProcrastinateJob

    from paperclip.models import (
        ActivityEvent,
        JobError,
        NativeRunFinalization,
        WorkspaceOperation,
    )

    client.result(run_id)
    accepted = ActivityEvent.objects.get(run_id=run_id, action="run.native_result_accepted")
    job_id = accepted.details["finalizationJobId"]
    deadline = time.monotonic() + timeout
    while True:
        status = ProcrastinateJob.objects.filter(pk=job_id).values_list("status", flat=True)[0]
        if status in ("succeeded", "failed", "cancelled", "aborted"):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} still {status} after {timeout:g}s")
        time.sleep(0.01)  # waiting for the worker's outcome, observed in the database
    errors = list(JobError.objects.filter(job_id=job_id).values_list("error", flat=True))
    assert status == "succeeded", (job_id, status, errors)
    phase = NativeRunFinalization.objects.get(run_id=run_id).phase
    assert phase == NativeRunFinalization.Phase.COMMITTED, (run_id, phase)
    started_at: datetime = ProcrastinateEvent.objects.get(job_id=job_id, type="started").at
    operation = WorkspaceOperation.objects.get(
        heartbeat_run_id=run_id, phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE
    )
    assert operation.finished_at is not None
    copied = ((operation.metadata or {}).get("copied") or {}).get("files", 0)
    return Wakeup(
        to_started=(started_at - accepted.created_at).total_seconds(),
        to_operation=(operation.started_at - accepted.created_at).total_seconds(),
        copy=(operation.finished_at - operation.started_at).total_seconds(),
        files=int(copied),
    )


# --- 2. request latency -------------------------------------------------------------------

PATHS = (
    ("results", "POST /results (accept, defer job)"),
    ("finalize_queued", "POST /finalize (job waiting)"),
    ("finalize_defer", "POST /finalize (defers a job)"),
)


def request_latency(
    client: Client, fixtures: Fixtures, small: Path, large: Path, config: Config
) -> dict[tuple[str, str], list[float]]:
    """Seconds per request, keyed (path, "small" | "large"). No worker runs meanwhile."""
    from django.db import connection
    from procrastinate.contrib.django.models import ProcrastinateJob

    from paperclip.models import WorkerProcess

    assert not WorkerProcess.objects.filter(stopped_at__isnull=True).exists()
    total = config.warmup + config.iterations
    log(f"creating {4 * total} runs ({total} per path and size) ...")
    trees = {"small": small, "large": large}
    running = {size: iter(fixtures.running(tree, total)) for size, tree in trees.items()}
    spent = {size: iter(fixtures.retries_spent(tree, total)) for size, tree in trees.items()}
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    accepted: dict[str, list[UUID]] = {"small": [], "large": []}
    used: dict[str, list[UUID]] = {"small": [], "large": []}

    def accept(size: str) -> Callable[[], None]:
        run_id = next(running[size])
        accepted[size].append(run_id)
        return lambda: client.result(run_id)

    def finalize_queued(size: str) -> Callable[[], None]:
        run_id = accepted[size][-1]  # its result was just accepted: its job is waiting
        return lambda: client.finalize(run_id)

    def finalize_defer(size: str) -> Callable[[], None]:
        run_id = next(spent[size])
        used[size].append(run_id)
        return lambda: client.finalize(run_id)

    makers = {
        "results": accept,
        "finalize_queued": finalize_queued,
        "finalize_defer": finalize_defer,
    }
    times: dict[tuple[str, str], list[float]] = {
        (path, size): [] for path, _ in PATHS for size in trees
    }
    log(f"measuring requests ({config.warmup} warm-up + {config.iterations} per path and size,")
    log("no worker running: every job stays queued) ...")
    for i in range(total):
        # Alternate the order so neither size always runs first.
        sizes = ("small", "large") if i % 2 else ("large", "small")
        for path, _ in PATHS:
            for size in sizes:
                op = makers[path](size)
                started = time.perf_counter()
                op()
                elapsed = time.perf_counter() - started
                if i >= config.warmup:
                    times[(path, size)].append(elapsed)
    # Honesty check: every request deferred its job, and no job of these runs was taken.
    run_ids = [str(run_id) for size in trees for run_id in (*accepted[size], *used[size])]
    jobs = ProcrastinateJob.objects.filter(task_name="finalize_run", args__run_id__in=run_ids)
    statuses = sorted(set(jobs.values_list("status", flat=True)))
    count = jobs.count()
    assert statuses == ["todo"], statuses
    assert count == len(run_ids) == 4 * total, (count, len(run_ids))
    log(f"  {count} finalization jobs deferred by these requests, all still queued")
    return times


# --- report -------------------------------------------------------------------------------


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def report(
    config: Config,
    poll_seconds: float,
    notify: list[Wakeup],
    polling: list[Wakeup],
    large_copy: Wakeup,
    latency: dict[tuple[str, str], list[float]],
) -> int:
    large_label = f"{config.files:,}"
    log("")
    log(
        f"request latency, HTTP on a live gunicorn, no worker running (the request alone), "
        f"{config.iterations} per path and size"
    )
    header = (
        f"{'path':<34} | {'files':>7} | {'median ms':>9} | {'p95 ms':>7} | "
        f"{'ratio large/small':>17}"
    )
    log(header)
    log("-" * len(header))
    ratios = {}
    for path, label in PATHS:
        small, large = latency[(path, "small")], latency[(path, "large")]
        ratio = statistics.median(large) / statistics.median(small)
        ratios[path] = ratio
        for size, values, files in (
            ("small", small, f"{SMALL_FILES}"),
            ("large", large, large_label),
        ):
            shown = f"{ratio:17.3f}" if size == "large" else ""
            log(
                f"{label if size == 'small' else '':<34} | {files:>7} | "
                f"{statistics.median(values) * 1000:9.2f} | {p95(values) * 1000:7.2f} | "
                f"{shown:>17}"
            )
    log("(ratio: median with the large tree / median with 10 files; the request never reads")
    log(" the workspace directory, the copy-back runs later in the worker)")

    def seconds(samples: list[Wakeup], key: str) -> tuple[float, float]:
        values = [getattr(s, key) for s in samples]
        return statistics.median(values), max(values)

    n_med, n_max = seconds(notify, "to_started")
    p_med, p_max = seconds(polling, "to_started")
    no_med, no_max = seconds(notify, "to_operation")
    po_med, po_max = seconds(polling, "to_operation")
    log("")
    log(
        "result committed -> finalization started, one idle worker, results one at a time "
        "(database timestamps)"
    )
    log(
        "(from the result transaction's now(); job started = its procrastinate_events "
        "'started' row, operation row = its workspace_finalize row)"
    )
    header = (
        f"{'worker':<36} | {'n':>3} | {'job started: median s':>21} | {'max s':>6} | "
        f"{'operation row: median s':>23} | {'max s':>6}"
    )
    log(header)
    log("-" * len(header))
    log(
        f"{'run_worker (LISTEN/NOTIFY + polling)':<36} | {len(notify):>3} | {n_med:21.3f} | "
        f"{n_max:6.3f} | {no_med:23.3f} | {no_max:6.3f}"
    )
    log(
        f"{'polling only (baseline)':<36} | {len(polling):>3} | {p_med:21.3f} | "
        f"{p_max:6.3f} | {po_med:23.3f} | {po_max:6.3f}"
    )
    log(f"poll interval PAPERCLIP_WORKER_POLL_SECONDS = {poll_seconds:g}s")
    log(f"ratio median delay / poll interval: {n_med / poll_seconds:.4f}")
    log(f"ratio median delay / polling-only median: {n_med / p_med:.4f}")
    small_copy = statistics.median(s.copy for s in notify)
    log("")
    log(
        f"copy-back in the worker (workspace_finalize started -> finished): {SMALL_FILES} files "
        f"{small_copy * 1000:.0f} ms (median), {large_copy.files:,} files "
        f"{large_copy.copy:.2f}s (one run; its job started "
        f"{large_copy.to_started * 1000:.1f} ms after the result)"
    )
    log("")
    targets = [
        (f"POST /results, {large_label} vs {SMALL_FILES} files", ratios["results"], 1.2),
        (
            f"POST /finalize (job waiting), {large_label} vs {SMALL_FILES} files",
            ratios["finalize_queued"],
            1.2,
        ),
        (
            f"POST /finalize (defers a job), {large_label} vs {SMALL_FILES} files",
            ratios["finalize_defer"],
            1.2,
        ),
    ]
    for label, ratio, target in targets:
        log(f"{'MET   ' if ratio <= target else 'MISSED'} {label}: ratio {ratio:.2f} (<= {target})")
    log(
        f"{'MET   ' if n_med < 1.0 else 'MISSED'} result committed -> job started, median "
        f"{n_med:.3f}s (< 1 s; max {n_max:.3f}s; polling-only median {p_med:.3f}s, poll "
        f"interval {poll_seconds:g}s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
