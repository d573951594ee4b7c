"""A PostgreSQL failover under real work (docs/ha.md#how-it-is-tested).

Standalone: `python -m tests.ha.failover [--async] [--agents N] [--out DIR]`; from pytest,
tests/ha/test_failover.py calls `run_failover()`.

What runs: a primary and a streaming standby built from the machine's PostgreSQL binaries
(tests/support/replication.py), synchronous unless `--async`; the project migrated onto
it through the multi-host URL (`target_session_attrs=read-write`); two gunicorn web nodes and
two `manage.py run_worker` processes on that URL, storing blobs in PostgreSQL (nothing else
shared); N `paperclip-agent run` processes, one per workspace, started a little apart, each
writing a file of its own and waiting for its finalization, half of them on each web node; a
prober asking both web nodes every 100 ms. While the first results are being finalized, the
primary is SIGKILLed, and the standby is promoted a second later.

Checked afterwards, on the new primary:
- web: no 500, no request slower than 10 s, 200 from both nodes again within 15 s of the
  promotion;
- workers: both still running (never restarted), each with a heartbeat after the promotion,
  and periodic jobs run after it;
- acknowledged results (the CLI printed `result: accepted`): with synchronous replication all
  present; with asynchronous replication the lost ones are counted (documented as possible);
- every surviving accepted result ends committed exactly once (one `run.finalization_committed`
  audit row) with the workspace head exactly its tree, or held for the board (its agent said
  so, and it was never committed);
- no two owners of one run's finalization at once: the operation log's intervals of different
  owner tokens never overlap;
- the runtime lease's `fence` after the failover exceeds every fence granted before it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from tests.chaos.run import (
    Config,
    GunicornServer,
    cluster_database,
    cluster_world,
    stop_process_group,
)
from tests.support.replication import ReplicatedCluster

ROOT = Path(__file__).resolve().parents[2]
AGENT = str(Path(sys.executable).with_name("paperclip-agent"))
DATABASE = "paperclip_ha"
# The workers' cadence, fast enough for a short test (production defaults: docs/worker.md).
STALLED_SECONDS = 6
WORKER_ENV = {
    "PAPERCLIP_WORKER_HEARTBEAT_SECONDS": "0.5",
    "PAPERCLIP_WORKER_STALLED_AFTER_SECONDS": str(STALLED_SECONDS),
    "PAPERCLIP_WORKER_POLL_SECONDS": "1",
    "PAPERCLIP_RECONCILE_INTERVAL_SECONDS": "1",
    "PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS": "1",
    "PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS": "1",
}
OWNER_UNVERIFIED_CAUSE = "native_workspace_finalization_owner_unverified"  # recovery.selectors
FENCE_MASK = (1 << 40) - 1  # a fence's low bits: the generation (docs/leases.md#fence)
RUN_LINE = re.compile(r"^run: ([0-9a-f-]{36})$")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Probe:
    at: float
    node: str
    status: int | None  # None: no HTTP answer (connection refused, timeout)
    seconds: float


@dataclass
class FailoverReport:
    synchronous: bool
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> str:
        mode = "synchronous" if self.synchronous else "asynchronous"
        lines = [f"failover with {mode} replication: {len(self.violations)} violations"]
        lines += [f"  {key}: {value}" for key, value in self.figures.items()]
        lines += [f"  VIOLATION {v}" for v in self.violations]
        return "\n".join(lines)


class Prober(threading.Thread):
    """Asks every web node an authenticated read every 100 ms, recording status and time."""

    def __init__(self, nodes: dict[str, str], key: str) -> None:
        super().__init__(daemon=True, name="prober")
        self.nodes = nodes
        self.key = key
        self.probes: list[Probe] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        with httpx.Client(timeout=30.0, headers=headers) as http:
            while not self.stopping.is_set():
                for name, base in self.nodes.items():
                    started = time.monotonic()
                    try:
                        status: int | None = http.get(f"{base}/api/me/issues").status_code
                    except httpx.HTTPError:
                        status = None
                    self.probes.append(Probe(started, name, status, time.monotonic() - started))
                self.stopping.wait(0.1)


class Agent:
    """One `paperclip-agent run` process; its output read by a thread."""

    def __init__(
        self, *, url: str, key: str, workspace: str, issue: str, workdir: Path, gated: bool
    ) -> None:
        workdir.mkdir(parents=True)
        self.log_path = workdir.with_suffix(".log")
        self.token = f"{workspace}:{time.monotonic_ns()}"
        self.lines: list[str] = []
        # A gated agent's command writes its file and then waits for the gate (a file beside
        # the workdir, never in a snapshot) before it exits: nothing after it happens before
        # the test opens the gate.
        self.gate = workdir.with_suffix(".gate") if gated else None
        command = f'printf %s "{self.token}" > result.txt'
        if self.gate is not None:
            command += f" && while [ ! -e '{self.gate}' ]; do sleep 0.05; done"
        self.proc = subprocess.Popen(
            [
                AGENT, "run", "--workspace", workspace, "--issue", issue,
                "--workdir", str(workdir), "--lease-ttl", "60", "--",
                "sh", "-c", command,
            ],
            env={**os.environ, "PAPERCLIP_URL": url, "PAPERCLIP_AGENT_KEY": key},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        self.workspace = workspace
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with self.log_path.open("a") as log:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                log.write(line)
                log.flush()

    @property
    def run_id(self) -> str | None:
        for line in self.lines:
            if found := RUN_LINE.match(line):
                return found.group(1)
        return None

    def said(self, fragment: str) -> bool:
        return any(fragment in line for line in self.lines)


def _node_env(url: str, data_dir: Path, application: str) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "paperclip.settings",
        "PYTHONPATH": str(ROOT),
        "DATABASE_URL": url,
        "DJANGO_SECRET_KEY": "failover-test-only",
        "DJANGO_DEBUG": "false",
        "DJANGO_CONN_MAX_AGE": "60",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
        "DJANGO_LOG_LEVEL": "INFO",
        "PAPERCLIP_DATA_DIR": str(data_dir),
        "PAPERCLIP_CAS_BACKEND": "postgres",
        "PGAPPNAME": application,
        **WORKER_ENV,
    }


def _wait(predicate: Any, what: str, within: float) -> float:
    """Poll `predicate` every 100 ms; the seconds it took. TimeoutError after `within`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > within:
            raise TimeoutError(f"{what}: not within {within:.0f} s")
        time.sleep(0.1)  # polling processes and the database
    return time.monotonic() - started


def _fence(base_url: str, key: str, workspace: str, issue: str) -> int:
    """Claim the workspace's runtime lease for `issue`, read its fence, release it (retrying
    through the outage as an agent would)."""
    with httpx.Client(base_url=base_url, timeout=30.0) as http:
        headers = {"Authorization": f"Bearer {key}"}
        deadline = time.monotonic() + 60
        while True:
            try:
                claimed = http.post(
                    f"/api/execution-workspaces/{workspace}/runtime-lease/claim",
                    json={"action": "start", "issue_id": issue, "ttl_seconds": 60},
                    headers=headers,
                )
            except httpx.HTTPError:
                claimed = None
            if claimed is not None and claimed.status_code in (200, 201):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no claim: {claimed and claimed.text}")
            time.sleep(0.5)  # the database is failing over: retry as the client would
        fence = int(claimed.json()["lease"]["fence"])
        http.post(
            f"/api/execution-workspaces/{workspace}/runtime-lease/release",
            json={"issue_id": issue},
            headers=headers,
        ).raise_for_status()
        return fence


def run_failover(
    *,
    synchronous: bool = True,
    agents: int = 4,
    out: Path | None = None,
    outage: float = 1.0,
) -> FailoverReport:
    """`outage`: seconds between the crash and the promotion; longer than the workers'
    stalled timeout (STALLED_SECONDS), every worker's heartbeat goes stale meanwhile."""
    report = FailoverReport(synchronous=synchronous)
    workdir = Path(tempfile.mkdtemp(prefix="paperclip-failover-", dir=out))
    cluster = ReplicatedCluster(synchronous=synchronous, log=say)
    webs: list[GunicornServer] = []
    workers: list[subprocess.Popen[bytes]] = []
    fleet: list[Agent] = []
    prober: Prober | None = None
    try:
        cluster.start()
        url = cluster.url(DATABASE)
        env = _node_env(url, workdir / "data", "failover-node")
        cluster_database(cluster, DATABASE, env)
        seed = Config(agents=agents + 1, workspaces=agents + 1, issues_per_agent=1)
        world = cluster_world(env, seed, cwd_root=str(workdir / "ws"))
        say(f"migrated and seeded {DATABASE} through {url}")
        config = Config(gunicorn_workers=2, gunicorn_threads=2)
        for name in ("web-a", "web-b"):
            web = GunicornServer(config, _node_env(url, workdir / "data", name), workdir)
            web.log_path = workdir / f"{name}.log"
            web.start()
            webs.append(web)
        for name in ("worker-a", "worker-b"):
            log = (workdir / f"{name}.log").open("ab")
            workers.append(
                subprocess.Popen(
                    [sys.executable, "manage.py", "run_worker", "--concurrency", "2"],
                    cwd=ROOT,
                    env=_node_env(url, workdir / "data", name),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
        for log_path in (workdir / "worker-a.log", workdir / "worker-b.log"):
            _wait(lambda p=log_path: " running on " in p.read_text(), f"{log_path.stem} up", 60)
        nodes = {f"web-{i}": web.base_url for i, web in enumerate(webs)}
        spare = world.agents[-1]
        fence_before = _fence(webs[0].base_url, spare.key, world.workspaces[-1], spare.issues[0])
        prober = Prober(nodes, spare.key)
        prober.start()
        # The race, forced: once the first two agents hold their runtime lease (the claim is
        # the only step of an agent's that locks its workspace row), their workspaces' rows
        # are locked, and only then are their commands let go (their gates), so their
        # finalizations claim ownership, start their operation and then wait inside the
        # commit that moves the head, until the primary dies under them.
        blocker = psycopg.connect(cluster.url(DATABASE))
        blocked = threading.Thread(target=_block_heads, args=(blocker, fleet), daemon=True)
        blocked.start()
        for i, spec in enumerate(world.agents[:-1]):
            fleet.append(
                Agent(
                    url=webs[i % 2].base_url,
                    key=spec.key,
                    workspace=world.workspaces[i],
                    issue=spec.issues[0],
                    workdir=workdir / "agents" / spec.name,
                    gated=i < 2,
                )
            )
            time.sleep(0.4)  # spread the runs so that some are in finalization at the crash
        # Watched from a connection of its own, in autocommit: pg_stat_activity is read once
        # per transaction, and the blocker's stays open (its first read would be the only one).
        with psycopg.connect(cluster.url(DATABASE), autocommit=True) as watcher:
            _wait(lambda: _finalizations_waiting(watcher) >= 2, "two finalizations waiting", 120)
        fence_lost = None
        if not synchronous:
            # Asynchronous: a grant the primary acknowledges but never ships (its WAL sender
            # stopped), lost with the primary. Its generation comes back on the
            # new primary; its fence must not.
            cluster.pause_replication()
            fence_lost = _fence(webs[0].base_url, spare.key, world.workspaces[-1], spare.issues[0])
        killed_at = time.monotonic()
        cluster.crash_primary()
        time.sleep(outage)
        cluster.promote()
        promoted_at = time.monotonic()
        promoted_wall = time.time()
        report.figures["seconds without a primary"] = outage
        report.figures["timeline after promotion"] = cluster.timeline(cluster.standby)
        _wait(lambda: all(a.proc.poll() is not None for a in fleet), "every agent done", 90)
        fence_after = _fence(webs[1].base_url, spare.key, world.workspaces[-1], spare.issues[0])
        # A run its agent saw held may still commit: its owner's receipt is removed once the
        # database answers (in the background), and the next attempt goes on. Up to 15 s.
        with suppress(TimeoutError):
            _wait(lambda: _uncommitted(url, fleet) == 0, "every run committed", 15)
        time.sleep(3.0)  # a few heartbeats and periodic defers after the promotion
        prober.stopping.set()
        prober.join()
        _check_web(report, prober.probes, killed_at=killed_at, promoted_at=promoted_at)
        _check_workers(report, url, workers, promoted_wall=promoted_wall)
        _check_runs(report, url, fleet)
        report.figures["fence before / after"] = f"{fence_before} / {fence_after}"
        if not fence_after > fence_before:
            report.violations.append(f"fence went from {fence_before} to {fence_after}")
        if fence_lost is not None:
            lost_generation, after_generation = fence_lost & FENCE_MASK, fence_after & FENCE_MASK
            report.figures["lost grant: fence / generation"] = f"{fence_lost} / {lost_generation}"
            report.figures["next grant: fence / generation"] = f"{fence_after} / {after_generation}"
            if not fence_after > fence_lost:
                report.violations.append(f"fence {fence_after} after the lost grant {fence_lost}")
    finally:
        if prober is not None:
            prober.stopping.set()
        for agent in fleet:
            if agent.proc.poll() is None:
                stop_process_group(agent.proc, grace=5)  # type: ignore[arg-type]
        for proc in workers:
            stop_process_group(proc, grace=20)
        for web in webs:
            web.stop()
        cluster.stop()
        report.figures["logs"] = str(workdir)
    return report


def _block_heads(conn: psycopg.Connection[Any], fleet: list[Agent]) -> None:
    pending = 2
    while pending:
        for agent in fleet[:2]:
            if agent.said("lease: runtime lease") and not getattr(agent, "blocked", False):
                conn.execute(
                    "SELECT 1 FROM execution_workspaces WHERE id = %s FOR NO KEY UPDATE",
                    [agent.workspace],
                )
                agent.blocked = True
                assert agent.gate is not None
                agent.gate.touch()
        pending = 2 - sum(bool(getattr(a, "blocked", False)) for a in fleet[:2])
        time.sleep(0.005)  # watching the agents' output


def _uncommitted(url: str, fleet: list[Agent]) -> int:
    runs = [a.run_id for a in fleet if a.run_id]
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT count(*) FROM native_run_finalizations WHERE run_id = ANY(%s::uuid[])"
            " AND phase <> 'committed'",
            [runs],
        ).fetchone()
    return int(row[0]) if row else 0


def _finalizations_waiting(conn: psycopg.Connection[Any]) -> int:
    """Worker sessions waiting for a lock in the statement that moves a workspace head (the
    blocker's row lock). Only that statement: another job waiting a moment for a row the
    waiting finalization holds (its run's, its coordinator's) is not a second finalization."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND state = 'active'"
        " AND application_name LIKE 'worker-%%'"
        " AND query LIKE 'UPDATE execution_workspaces SET head_tree%%'"
    ).fetchone()
    return int(row[0]) if row else 0


def _check_web(
    report: FailoverReport, probes: list[Probe], *, killed_at: float, promoted_at: float
) -> None:
    statuses = Counter(p.status for p in probes if p.at >= killed_at)
    report.figures["web answers from the crash on"] = dict(sorted(statuses.items(), key=str))
    slowest = max((p.seconds for p in probes), default=0.0)
    report.figures["slowest request (s)"] = round(slowest, 2)
    if statuses[500]:
        report.violations.append(f"{statuses[500]} answers 500 during the failover")
    if slowest > 10:
        report.violations.append(f"a request took {slowest:.1f} s")
    for node in sorted({p.node for p in probes}):
        back = [p.at for p in probes if p.node == node and p.at > promoted_at and p.status == 200]
        if not back:
            report.violations.append(f"{node} never answered 200 after the promotion")
            continue
        first_bad = [p.at for p in probes if p.node == node and p.at > back[0] and p.status != 200]
        report.figures[f"{node}: 200 again after promotion (s)"] = round(back[0] - promoted_at, 2)
        if back[0] - promoted_at > 15:
            report.violations.append(f"{node} answered 200 only {back[0] - promoted_at:.1f} s on")
        if first_bad:
            report.violations.append(f"{node} failed again {first_bad[0] - promoted_at:.1f} s on")


def _check_workers(
    report: FailoverReport,
    url: str,
    workers: list[subprocess.Popen[bytes]],
    *,
    promoted_wall: float,
) -> None:
    alive = [proc.poll() is None for proc in workers]
    report.figures["workers still running"] = f"{sum(alive)}/{len(workers)}"
    if not all(alive):
        report.violations.append("a worker process exited during the failover")
    with psycopg.connect(url, autocommit=True) as conn:
        beats = conn.execute(
            "SELECT count(*) FROM procrastinate_workers WHERE last_heartbeat > to_timestamp(%s)",
            [promoted_wall],
        ).fetchone()
        periodic = conn.execute(
            "SELECT count(*) FROM procrastinate_jobs j JOIN procrastinate_events e"
            " ON e.job_id = j.id WHERE e.type = 'succeeded' AND e.at > to_timestamp(%s)"
            " AND j.task_name IN (SELECT task_name FROM procrastinate_periodic_defers)",
            [promoted_wall],
        ).fetchone()
        # A job started before the crash and still `doing` at the end: its worker lost it (its
        # outcome never recorded) and nothing will ever recover it.
        stuck = conn.execute(
            "SELECT j.id, j.task_name, j.worker_id FROM procrastinate_jobs j"
            " WHERE j.status = 'doing' AND (SELECT max(e.at) FROM procrastinate_events e"
            " WHERE e.job_id = j.id AND e.type = 'started') < to_timestamp(%s)",
            [promoted_wall],
        ).fetchall()
    report.figures["jobs started before the crash, still 'doing'"] = len(stuck)
    if stuck:
        report.violations.append(f"jobs from before the crash left 'doing': {stuck}")
    report.figures["workers heartbeating after promotion"] = beats[0] if beats else 0
    report.figures["periodic jobs succeeded after promotion"] = periodic[0] if periodic else 0
    if not beats or beats[0] < len(workers):
        report.violations.append("not every worker heartbeats after the promotion")
    if not periodic or periodic[0] == 0:
        report.violations.append("no periodic job ran after the promotion")


def _check_runs(report: FailoverReport, url: str, fleet: list[Agent]) -> None:
    acknowledged = [a for a in fleet if a.said("result: accepted") and a.run_id]
    exits = Counter(a.proc.returncode for a in fleet)
    report.figures["agents' exit codes"] = dict(exits)
    report.figures["results acknowledged"] = len(acknowledged)
    lost = committed = held = lost_commits = 0
    with psycopg.connect(url, autocommit=True) as conn:
        for agent in acknowledged:
            run_id = agent.run_id
            result = conn.execute(
                "SELECT count(*) FROM native_run_results WHERE run_id = %s"
                " AND schema_status = 'accepted'",
                [run_id],
            ).fetchone()
            if not result or result[0] == 0:
                lost += 1
                if report.synchronous:
                    report.violations.append(f"run {run_id}: acknowledged result lost")
                continue
            commits = conn.execute(
                "SELECT count(*) FROM activity_events WHERE run_id = %s"
                " AND action = 'run.finalization_committed'",
                [run_id],
            ).fetchone()
            n_commits = commits[0] if commits else 0
            held_here = agent.said("held for the board") or _held(conn, run_id)
            if n_commits > 1:
                report.violations.append(f"run {run_id}: committed {n_commits} times")
            elif n_commits == 0 and held_here:
                held += 1  # held for the board
            elif n_commits == 0 and report.synchronous:
                report.violations.append(f"run {run_id}: neither committed nor held")
            elif n_commits == 0:
                # Asynchronous: its commit (which its agent may have been told of) was lost
                # with the old primary, and the run waits for its next attempt.
                lost_commits += 1
            else:
                # Committed once (also after a hold its agent saw: the owner's receipt was
                # removed once the database answered, and the next attempt committed).
                committed += 1
                _check_tree(report, conn, agent)
            _check_owners(report, conn, run_id)
        spanned = conn.execute(
            "SELECT count(*) FROM native_run_finalizations WHERE run_id = ANY(%s::uuid[])"
            " AND attempt > 1",
            [[a.run_id for a in acknowledged]],
        ).fetchone()
    report.figures["committed / held / lost"] = f"{committed} / {held} / {lost}"
    report.figures["commits lost, run waiting to commit again"] = lost_commits
    report.figures["finalizations that took a second attempt"] = spanned[0] if spanned else 0


def _held(conn: psycopg.Connection[Any], run_id: str) -> bool:
    """The run waits for the board: a live owner-unverified recovery action names it."""
    row = conn.execute(
        "SELECT count(*) FROM issue_recovery_actions WHERE cause = %s"
        " AND status IN ('active', 'escalated') AND evidence ->> 'runId' = %s",
        [OWNER_UNVERIFIED_CAUSE, run_id],
    ).fetchone()
    return bool(row and row[0])


def _check_tree(report: FailoverReport, conn: psycopg.Connection[Any], agent: Agent) -> None:
    """The head is exactly the run's tree, and it holds the agent's file."""
    row = conn.execute(
        "SELECT w.head_tree, r.result_json FROM execution_workspaces w, native_run_results r"
        " WHERE w.id = %s AND r.run_id = %s AND r.schema_status = 'accepted'",
        [agent.workspace, agent.run_id],
    ).fetchone()
    tree = (row[1] or {}).get("workspaceTree") if row else None
    if row is None or tree is None or row[0] != tree:
        report.violations.append(f"run {agent.run_id}: head {row and row[0]} is not its tree")


def _check_owners(report: FailoverReport, conn: psycopg.Connection[Any], run_id: str) -> None:
    """No two owner tokens' operations on one run overlap in time."""
    spans = conn.execute(
        "SELECT metadata->>'ownerToken', started_at, coalesce(finished_at, now())"
        " FROM workspace_operations WHERE heartbeat_run_id = %s AND metadata ? 'ownerToken'"
        " ORDER BY started_at",
        [run_id],
    ).fetchall()
    report.violations += [f"run {run_id}: {clash}" for clash in overlapping_owners(spans)]


def overlapping_owners(spans: list[tuple[str, Any, Any]]) -> list[str]:
    """(owner token, start, end) spans, sorted by start: each pair of different owners whose
    spans overlap."""
    clashes = []
    for i, (token, _start, end) in enumerate(spans):
        for other, start2, _end2 in spans[i + 1 :]:
            if other != token and start2 < end:
                clashes.append(f"owners {token} and {other} overlap")
    return clashes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--outage", type=float, default=1.0, help="seconds without a primary")
    args = parser.parse_args(argv)
    report = run_failover(
        synchronous=not args.asynchronous, agents=args.agents, out=args.out, outage=args.outage
    )
    print(report.summary(), flush=True)
    return 1 if report.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
