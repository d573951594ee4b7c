"""Run the runtime-lease chaos test and check it.

Standalone: `python -m tests.chaos.run --duration 600 --agents 6 --workspaces 3 --seed 1`
(or `make chaos DURATION=600`). It creates a throwaway database ($PAPERCLIP_CHAOS_DB, default
`paperclip_chaos`) on the server of $DATABASE_URL (default
postgres://postgres@127.0.0.1:5432/postgres), migrates it, runs, checks, prints the figures
and drops the database and its temporary directory, also on failure or SIGTERM. Exit status
0 when the checker passes, 1 when it finds a violation. `--out DIR` keeps the histories, the
faults log, the server log and summary.json in DIR.

With `failover` or `cut_node` weighted (the default), it builds a replicated cluster of its
own instead (tests/support/replication.py), runs the server in a network namespace
(tests/support/netns.py, root) and removes both at the end; `--faults` without them uses
$DATABASE_URL's server as above.

From pytest, `run_chaos()` runs against the (transactional) test database, or against a
cluster and a namespace the test passes.

What runs: a company, a board user and token, N agents with a key and a few issues each
(`in_progress`, assigned to the agent), W execution workspaces, all made through the
services; a gunicorn (gthread, 3 workers x 2 threads by default, persistent database
connections, `PGAPPNAME=chaos-server`) on a free port; N agent processes
(tests/chaos/agent.py) that a supervisor restarts if they exit; the nemesis thread
(tests/chaos/nemesis.py). At the end: the agents are stopped, `/healthz` is asked (for up to
15 s, time for a killed worker's replacement), the audit rows of creates and reclaims, the
recorded operations, the leases and the workspace counters are read, the server is stopped
and tests/chaos/checker.py judges it all.

Lease TTLs: the API accepts 60 s at least (leases.services.TTL_MIN_SECONDS); agents claim
with 60 s and the nemesis forces expiry of a SIGSTOPped holder's leases through the database
clock (see tests/chaos/nemesis.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import psycopg

from tests.chaos.checker import Report, check, read_jsonl
from tests.chaos.nemesis import (
    CLUSTER_FAULTS,
    DEFAULT_WEIGHTS,
    SERVER_APPLICATION_NAME,
    FaultLog,
    Nemesis,
)
from tests.support.netns import IsolatedNode
from tests.support.replication import ReplicatedCluster
from tests.support.servers import free_port, throwaway_database

ROOT = Path(__file__).resolve().parents[2]


def say(message: str) -> None:
    print(message, flush=True)


@dataclass
class Config:
    duration: float = 120.0
    agents: int = 6
    workspaces: int = 3
    seed: int = 1
    issues_per_agent: int = 2
    ttl_seconds: int = 60  # the API's minimum
    gunicorn_workers: int = 3
    gunicorn_threads: int = 2
    fault_interval: tuple[float, float] = (1.0, 3.0)
    fault_window: float = 3.0
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))


@dataclass
class AgentSpec:
    name: str
    agent_id: str
    key: str
    issues: list[str]


@dataclass
class World:
    company_id: str
    board_token: str
    agents: list[AgentSpec]
    workspaces: list[str]


@dataclass
class Outcome:
    report: Report
    summary: str
    figures: dict[str, Any]
    pids: list[int]  # every process the run started (all gone at the end)
    births: dict[int, float] = field(default_factory=dict)  # pid -> its start, when seen

    def leftovers(self) -> list[int]:
        """The run's processes still alive: a pid alive now with the start it had when the run
        saw it. A pid alone can name another process by then (32,768 pids on this machine, and
        every thread of every test takes one): that is not a leftover."""
        alive = []
        for pid in self.pids:
            try:
                now = psutil.Process(pid).create_time()
            except psutil.NoSuchProcess:
                continue
            if self.births.get(pid) in (None, now):
                alive.append(pid)
        return alive


BIRTHS: dict[int, float] = {}  # the start of every process the run started, by pid


def note_birth(pid: int) -> None:
    """Remember when `pid` started (once), so that a reused pid is not taken for ours."""
    if pid not in BIRTHS:
        with suppress(psutil.NoSuchProcess):
            BIRTHS[pid] = psutil.Process(pid).create_time()


# --- setup -------------------------------------------------------------------------------------


def create_world(config: Config, *, cwd_root: str = "/srv/chaos") -> World:
    """The company, its board token, agents with keys and issues, and workspaces (their `cwd`
    under `cwd_root`), through the services (Django must be set up on the run's database)."""
    from paperclip import services
    from paperclip.access import board_actor
    from paperclip.credentials import board_token_create, board_user_ensure
    from paperclip.models import Issue

    tag = uuid.uuid4().hex[:8]
    user = board_user_ensure(username=f"chaos-board-{tag}", superuser=True).user
    actor = board_actor(user)
    company = services.company_create(actor=actor, name=f"chaos {tag}").company
    agents = []
    for i in range(config.agents):
        agent = services.agent_create(actor=actor, company_id=company.pk, name=f"agent-{i}").agent
        key = services.agent_key_issue(actor=actor, agent_id=agent.pk, name="chaos").secret
        issues = [
            str(
                services.issue_create(
                    actor=actor,
                    company_id=company.pk,
                    title=f"agent-{i} task {j}",
                    status=Issue.Status.IN_PROGRESS,
                    assignee_agent_id=agent.pk,
                ).issue.pk
            )
            for j in range(config.issues_per_agent)
        ]
        agents.append(AgentSpec(f"agent-{i}", str(agent.pk), key, issues))
    workspaces = [
        str(
            services.execution_workspace_create(
                actor=actor, company_id=company.pk, name=f"ws-{i}", cwd=f"{cwd_root}/ws-{i}"
            ).workspace.pk
        )
        for i in range(config.workspaces)
    ]
    token = board_token_create(user=user, name="chaos").secret
    return World(str(company.pk), token, agents, workspaces)


def http_status(url: str, timeout: float = 5.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - local
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def terminate(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the process group, and SIGCONT it if it is stopped (only then: an agent marks
    its next record after a SIGCONT as resumed)."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
        with suppress(psutil.NoSuchProcess):
            if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
                os.killpg(proc.pid, signal.SIGCONT)


def stop_process_group(proc: subprocess.Popen[Any], *, grace: float) -> None:
    """SIGTERM the process (its group leader), then SIGKILL the whole group."""
    if proc.poll() is None:
        terminate(proc)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class GunicornServer:
    """gunicorn on `host` (inside a network namespace when `prefix` is `ip netns exec ...`)."""

    def __init__(
        self,
        config: Config,
        env: dict[str, str],
        workdir: Path,
        *,
        host: str = "127.0.0.1",
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.host = host
        self.prefix = prefix
        self.base_url = f"http://{host}:{self.port}"
        self.config = config
        self.env = env
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen_workers: set[int] = set()

    def start(self) -> int:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                *self.prefix,
                str(Path(sys.executable).with_name("gunicorn")),
                "paperclip.wsgi:application",
                "--bind",
                f"{self.host}:{self.port}",
                "--workers",
                str(self.config.gunicorn_workers),
                "--worker-class",
                "gthread",
                "--threads",
                str(self.config.gunicorn_threads),
                "--keep-alive",
                "30",
                "--timeout",
                "30",
                "--graceful-timeout",
                "5",
                "--log-level",
                "info",  # worker boots; no access log
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.proc.returncode}: see its log")
            if http_status(f"{self.base_url}/healthz", timeout=2) == 200:
                note_birth(self.proc.pid)
                return self.proc.pid
            time.sleep(0.2)  # polling a starting server
        raise RuntimeError("gunicorn did not become healthy within 60 s")

    def worker_pids(self) -> list[int]:
        if self.proc is None or self.proc.poll() is not None:
            return []
        try:
            workers = [child.pid for child in psutil.Process(self.proc.pid).children()]
        except psutil.NoSuchProcess:
            return []
        self.seen_workers.update(workers)
        for pid in workers:
            note_birth(pid)
        return workers

    def healthz(self, within: float) -> int | None:
        deadline = time.monotonic() + within
        status = None
        while time.monotonic() < deadline:
            status = http_status(f"{self.base_url}/healthz", timeout=3)
            if status == 200:
                return status
            time.sleep(0.5)
        return status

    def stop(self) -> None:
        if self.proc is not None:
            self.seen_workers.update(self.worker_pids())
            stop_process_group(self.proc, grace=15)

    def pids(self) -> list[int]:
        """The master and every worker seen (the nemesis's victims and their successors)."""
        return [] if self.proc is None else [self.proc.pid, *sorted(self.seen_workers)]


class AgentFleet:
    """The agent processes, each in its own session (process group)."""

    def __init__(self, world: World, base_url: str, workdir: Path, config: Config) -> None:
        self.workdir = workdir
        self.seed = config.seed
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.starts: Counter[str] = Counter()
        self.pids: list[int] = []
        self.configs: dict[str, Path] = {}
        self.lock = threading.RLock()
        self.closed = False
        for spec in world.agents:
            path = workdir / f"{spec.name}.json"
            path.write_text(
                json.dumps(
                    {
                        "name": spec.name,
                        "base_url": base_url,
                        "agent_key": spec.key,
                        "board_token": world.board_token,
                        "issues": spec.issues,
                        "workspaces": world.workspaces,
                        "history": str(workdir / f"{spec.name}.history.jsonl"),
                        "ttl_seconds": config.ttl_seconds,
                    }
                )
            )
            self.configs[spec.name] = path

    def names(self) -> list[str]:
        return sorted(self.configs)

    def histories(self) -> list[Path]:
        return [self.workdir / f"{name}.history.jsonl" for name in self.names()]

    def pid(self, name: str) -> int | None:
        proc = self.procs.get(name)
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self, name: str, *, restarted: bool) -> int:
        with self.lock:
            if self.closed:
                raise RuntimeError("the fleet is stopped")
            seed = self.seed * 1000 + self.names().index(name) * 100 + self.starts[name]
            self.starts[name] += 1
            log = (self.workdir / f"{name}.log").open("ab")
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.chaos.agent",
                    str(self.configs[name]),
                    "--seed",
                    str(seed),
                    *(["--restarted"] if restarted else []),
                ],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            log.close()
            self.procs[name] = proc
            self.pids.append(proc.pid)
            note_birth(proc.pid)
            return proc.pid

    def kill(self, name: str) -> int | None:
        with self.lock:
            proc = self.procs.get(name)
            if proc is None:
                return None
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return proc.pid

    def restart_exited(self) -> list[tuple[str, int]]:
        """Restart the agents that exited by themselves (not killed by the nemesis)."""
        with self.lock:
            exited = [
                (name, proc.returncode)
                for name, proc in self.procs.items()
                if proc.poll() is not None and proc.returncode != -signal.SIGKILL
            ]
            for name, _ in exited:
                self.start(name, restarted=True)
            return exited

    def stop_all(self) -> None:
        with self.lock:
            self.closed = True
        for proc in self.procs.values():
            if proc.poll() is None:
                terminate(proc)
        for proc in self.procs.values():
            stop_process_group(proc, grace=10)


# --- the final database read -------------------------------------------------------------------


def read_final(db_url: str, company_id: str) -> dict[str, Any]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        audit = [
            {
                "ws": ws,
                "action": action,
                "generation": int(generation),
                "owner_key": owner_key,
                "reason": reason,
            }
            for ws, action, generation, owner_key, reason in conn.execute(
                "SELECT entity_id, action, details->>'generation', details->>'owner_key',"
                " details->>'reason' FROM activity_events WHERE company_id = %s AND action IN"
                " ('runtime_lease.created', 'runtime_lease.reclaimed') ORDER BY created_at",
                [company_id],
            ).fetchall()
        ]
        operations = [
            {"id": op_id, "ws": ws, "generation": generation, "issue_id": issue_id}
            for op_id, ws, generation, issue_id in conn.execute(
                "SELECT id::text, execution_workspace_id::text, lease_generation, issue_id::text"
                " FROM workspace_operations WHERE company_id = %s",
                [company_id],
            ).fetchall()
        ]
        leases = [
            {"ws": ws, "generation": generation, "owner_key": owner_key}
            for ws, generation, owner_key in conn.execute(
                "SELECT execution_workspace_id::text, generation, owner_key"
                " FROM execution_workspace_runtime_leases WHERE company_id = %s",
                [company_id],
            ).fetchall()
        ]
        workspaces = dict(
            conn.execute(
                "SELECT id::text, runtime_lease_generation FROM execution_workspaces"
                " WHERE company_id = %s",
                [company_id],
            ).fetchall()
        )
        rejected = conn.execute(
            "SELECT count(*) FROM activity_events WHERE company_id = %s"
            " AND action = 'runtime_lease.superseded_write_rejected'",
            [company_id],
        ).fetchone()[0]
    return {
        "audit": audit,
        "operations": operations,
        "leases": leases,
        "workspaces": workspaces,
        "superseded_writes_audited": rejected,
    }


def server_log_figures(path: Path) -> dict[str, int]:
    """Exception types in the server log (the 500s of the fault windows, worker restarts)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    kinds = Counter(
        m.group(1) for m in re.finditer(r"^([\w.]+(?:Error|Exception)):", text, re.MULTILINE)
    )
    return {
        "tracebacks": text.count("Traceback (most recent call last)"),
        **{f"exception {k}": n for k, n in sorted(kinds.items())},
        "worker_boots": len(re.findall(r"Booting worker", text)),
    }


# --- the run -----------------------------------------------------------------------------------


CLUSTER_DATABASE = "paperclip_chaos"


def cluster_database(cluster: ReplicatedCluster, name: str, env: dict[str, str]) -> str:
    """Create database `name` on the cluster's primary and migrate it (a child process, with
    `env` and the multi-host URL); its URL."""
    cluster.create_database(name)
    url = cluster.url(name)
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT, env={**env, "DATABASE_URL": url}, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"migrate failed:\n{done.stdout}{done.stderr}")
    return url


def cluster_world(env: dict[str, str], config: Config, *, cwd_root: str) -> World:
    """create_world() in a child process on env's DATABASE_URL (tests/ha/world.py)."""
    args = [str(config.agents), cwd_root, str(config.workspaces), str(config.issues_per_agent)]
    done = subprocess.run(
        [sys.executable, "-m", "tests.ha.world", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    data = json.loads(done.stdout)
    return World(
        company_id=data["company_id"],
        board_token=data["board_token"],
        agents=[AgentSpec(**a) for a in data["agents"]],
        workspaces=data["workspaces"],
    )


def _sweep() -> dict[str, Any]:
    from leases.services import runtime_lease_sweep

    report = runtime_lease_sweep()
    return {
        "deleted": report.deleted,
        "examined": report.examined,
        "skipped_locked": report.skipped_locked,
        "survived": report.survived,
    }


def _close_thread_connection() -> None:
    from django.db import connection

    connection.close()


def run_chaos(
    config: Config,
    *,
    workdir: Path,
    log: Callable[[str], None] = say,
    cluster: ReplicatedCluster | None = None,
    node: IsolatedNode | None = None,
) -> Outcome:
    """One chaos run. Without `cluster`: against the database Django is configured for
    (committed data: in pytest, a transactional test). With it: against a database of its
    own on that replicated cluster (the `failover` fault), migrated and seeded by child
    processes, the server inside `node`'s network namespace when given (the `cut_node`
    fault); the `sweep` fault, which runs in this process, is left out then. Every process it
    starts is gone when it returns."""
    from tests.support.processes import child_env

    rng = random.Random(config.seed)
    env = child_env(
        DJANGO_DEBUG="false",
        DJANGO_CONN_MAX_AGE="60",
        DJANGO_ALLOWED_HOSTS=f"127.0.0.1,localhost{f',{node.node_ip}' if node else ''}",
        DJANGO_LOG_LEVEL="ERROR",  # 500s with their tracebacks, not every 409
        PGAPPNAME=SERVER_APPLICATION_NAME,
    )
    if cluster is None:
        world = create_world(config)
        db_url = env["DATABASE_URL"]
    else:
        db_url = cluster_database(cluster, CLUSTER_DATABASE, env)
        reach = node.db_ip if node else "127.0.0.1"
        env["DATABASE_URL"] = cluster.url(CLUSTER_DATABASE, host=reach)
        world = cluster_world(env, config, cwd_root=str(workdir / "ws"))
        config = replace(config, weights={k: w for k, w in config.weights.items() if k != "sweep"})
    server = GunicornServer(
        config,
        env,
        workdir,
        host=node.node_ip if node else "127.0.0.1",
        prefix=node.prefix if node else (),
    )
    fleet: AgentFleet | None = None
    nemesis: Nemesis | None = None
    faults_path = workdir / "faults.jsonl"
    fault_log = FaultLog(faults_path)
    pids: list[int] = []
    started = time.monotonic()
    completed = False
    try:
        server.start()
        log(
            f"gunicorn on {server.base_url} ({config.gunicorn_workers} workers x"
            f" {config.gunicorn_threads} threads), {config.agents} agents,"
            f" {config.workspaces} workspaces, {config.duration:.0f} s, seed {config.seed}"
        )
        fleet = AgentFleet(world, server.base_url, workdir, config)
        for name in fleet.names():
            fleet.start(name, restarted=False)
        nemesis = Nemesis(
            rng=rng,
            fleet=fleet,
            server=server,
            db_url=db_url,
            company_id=world.company_id,
            base_url=server.base_url,
            board_token=world.board_token,
            issue_owner={issue: a.name for a in world.agents for issue in a.issues},
            log=fault_log,
            interval=config.fault_interval,
            weights=config.weights,
            sweep=_sweep if config.weights.get("sweep") else None,
            on_exit=_close_thread_connection,
            cluster=cluster,
            node=node,
        )
        nemesis.start()
        deadline = started + config.duration
        next_report = started + 30
        while time.monotonic() < deadline:
            time.sleep(0.5)
            for name, code in fleet.restart_exited():
                # Not a nemesis kill: an agent died by itself (a bug in the agent); it was
                # restarted, and the faults log and the figures say so.
                fault_log.write(
                    {
                        "kind": "agent_exit",
                        "t": time.monotonic(),
                        "w": time.time(),
                        "agent": name,
                        "returncode": code,
                    }
                )
            if time.monotonic() >= next_report:
                next_report += 30
                faults, _ = read_jsonl(faults_path)
                log(f"  {time.monotonic() - started:5.0f} s: {len(faults)} faults so far")
        completed = True
    finally:
        if nemesis is not None:
            nemesis.stop()
            nemesis.join(timeout=60)
        if fleet is not None:
            fleet.stop_all()
            pids += fleet.pids
        try:
            if completed:
                healthz = server.healthz(within=15)
                final = {"healthz": healthz, **read_final(db_url, world.company_id)}
        finally:
            server.stop()
            pids += server.pids()
    assert fleet is not None
    histories: list[dict[str, Any]] = []
    torn = 0
    for path in fleet.histories():
        records, bad = read_jsonl(path)
        histories += records
        torn += bad
    faults, _ = read_jsonl(faults_path)
    report = check(histories, faults, final, fault_window=config.fault_window)
    figures = {
        "config": {k: v for k, v in asdict(config).items() if k != "weights"},
        "elapsed_seconds": round(time.monotonic() - started, 1),
        **report.figures,
        "torn_history_lines": torn,
        "superseded_writes_audited": final["superseded_writes_audited"],
        "leases_left": len(final["leases"]),
        "healthz_at_end": final["healthz"],
        "nemesis_errors": nemesis.errors if nemesis is not None else [],
        "server_log": server_log_figures(server.log_path),
        "violations": dict(report.by_rule()),
    }
    (workdir / "summary.json").write_text(json.dumps(figures, indent=2, default=str))
    return Outcome(
        report=report,
        summary=render(figures, report),
        figures=figures,
        pids=pids,
        births={pid: BIRTHS[pid] for pid in pids if pid in BIRTHS},
    )


def render(figures: dict[str, Any], report: Report) -> str:
    c = figures["config"]
    lines = [
        f"chaos run: {figures['elapsed_seconds']} s ({c['duration']:.0f} s of load),"
        f" {c['agents']} agents, {c['workspaces']} workspaces, seed {c['seed']},"
        f" gunicorn {c['gunicorn_workers']}x{c['gunicorn_threads']} gthread,"
        f" TTL {c['ttl_seconds']} s",
        f"requests: {figures['requests']} (agent processes started: {figures['agent_starts']},"
        f" torn history lines: {figures['torn_history_lines']})",
    ]
    lines += [f"  {label:<58} {n:>7}" for label, n in figures["outcomes"].items()]
    lines.append(
        f"no answer: {figures['no_answer']} ({figures['no_answer_outside_windows']} outside"
        f" server-fault windows); 5xx: {figures['server_errors']}"
        f" ({figures['server_errors_in_windows']} inside windows,"
        f" {figures['server_errors_sent_after_fault']} sent after the fault had struck);"
        " the windows cover"
        f" {figures['window_share']:.0%} of the run"
    )
    lines.append(
        f"stale-generation probes: {figures['probes']} (accepted: {figures['probes_accepted']});"
        f" refused writes audited: {figures['superseded_writes_audited']}"
    )
    lines.append(
        "first request after SIGCONT: "
        + (", ".join(f"{k} {n}" for k, n in figures["after_sigcont"].items()) or "none")
    )
    lines.append("faults: " + ", ".join(f"{k} {n}" for k, n in figures["faults"].items()))
    lines.append(
        f"generations handed out: {figures['generations_handed_out']}; reclaims by reason: "
        + (", ".join(f"{k} {n}" for k, n in figures["reclaim_reasons"].items()) or "none")
    )
    lines.append(
        f"operations recorded: {figures['operations_recorded']}; leases left:"
        f" {figures['leases_left']}; /healthz at the end: {figures['healthz_at_end']}"
    )
    lines.append("server log: " + ", ".join(f"{k} {n}" for k, n in figures["server_log"].items()))
    if figures["nemesis_errors"]:
        lines.append(f"nemesis errors: {len(figures['nemesis_errors'])}")
        lines += [f"  {e}" for e in figures["nemesis_errors"][:5]]
    lines.append(
        f"violations: {len(report.violations)}"
        + (
            " (" + ", ".join(f"{k} {n}" for k, n in figures["violations"].items()) + ")"
            if report.violations
            else ""
        )
    )
    lines += [v.render() for v in report.violations[:20]]
    lines.append("checker: PASS" if report.ok else "checker: FAIL")
    return "\n".join(lines)


# --- standalone ----------------------------------------------------------------------------------


def _weights(text: str) -> dict[str, float]:
    weights = {}
    for part in filter(None, text.split(",")):
        kind, _, weight = part.partition("=")
        if kind not in DEFAULT_WEIGHTS:
            raise argparse.ArgumentTypeError(f"unknown fault kind {kind!r}")
        weights[kind] = float(weight or 1)
    return {k: w for k, w in weights.items() if w > 0}


def _terminate(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding; cleanup is not interrupted
    raise SystemExit(128 + signum)  # unwinds through every finally: processes, database, dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Chaos test of the runtime leases.")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--workspaces", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=3, help="gunicorn workers")
    parser.add_argument("--threads", type=int, default=2, help="threads per gunicorn worker")
    parser.add_argument(
        "--faults",
        type=_weights,
        default=dict(DEFAULT_WEIGHTS),
        help="kind=weight,... (default: "
        + ",".join(f"{k}={v:g}" for k, v in DEFAULT_WEIGHTS.items())
        + "); weight 0 or a kind left out: never",
    )
    parser.add_argument("--out", type=Path, help="keep histories, faults and summary here")
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    config = Config(
        duration=args.duration,
        agents=args.agents,
        workspaces=args.workspaces,
        seed=args.seed,
        gunicorn_workers=args.workers,
        gunicorn_threads=args.threads,
        weights=args.faults,
    )
    server_url = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres"
    name = os.environ.get("PAPERCLIP_CHAOS_DB", "paperclip_chaos")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        workdir = args.out
    else:
        workdir = Path(tempfile.mkdtemp(prefix="paperclip-chaos-"))
    if CLUSTER_FAULTS & set(config.weights):
        try:
            outcome = _run_on_cluster(config, workdir)
        finally:
            if args.out is None:
                shutil.rmtree(workdir, ignore_errors=True)
        say("")
        say(outcome.summary)
        return 0 if outcome.report.ok else 1
    try:
        with throwaway_database(server_url, name, keep=args.keep_db, log=say) as url:
            os.environ["DATABASE_URL"] = url
            os.environ["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
            # Neither manage.py nor pytest: give the run (and its gunicorn) a throwaway key.
            os.environ.setdefault("DJANGO_SECRET_KEY", "chaos-only")
            import django

            django.setup()
            from django.core.management import call_command
            from django.db import connection

            try:
                say("migrating ...")
                call_command("migrate", verbosity=0)
                outcome = run_chaos(config, workdir=workdir)
            finally:
                connection.close()
    finally:
        if args.out is None:
            shutil.rmtree(workdir, ignore_errors=True)
    say("")
    say(outcome.summary)
    if args.out is not None:
        say(f"histories, faults log, server log and summary.json in {args.out}")
    return 0 if outcome.report.ok else 1


def _run_on_cluster(config: Config, workdir: Path) -> Outcome:
    """The run on a replicated cluster of its own (and its server in a network namespace
    when `cut_node` is weighted), all of it removed afterwards."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
    os.environ.setdefault("DJANGO_SECRET_KEY", "chaos-only")
    cluster = ReplicatedCluster(synchronous=True, log=say)
    node = IsolatedNode(0) if "cut_node" in config.weights else None
    try:
        if node is not None:
            node.create()
        cluster.start()
        # Django is set up only for child_env(); every query goes to the cluster.
        os.environ["DATABASE_URL"] = cluster.url("postgres")
        import django

        django.setup()
        return run_chaos(config, workdir=workdir, cluster=cluster, node=node)
    finally:
        cluster.stop()
        if node is not None:
            node.destroy()


if __name__ == "__main__":
    sys.exit(main())
