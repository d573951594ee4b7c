"""The nemesis: a thread of the runner that injects one fault at a time, at random intervals,
and appends each to the faults log (JSONL) with monotonic and wall times.

Kinds (weights in `DEFAULT_WEIGHTS`):

- `kill_agent`: SIGKILL a random agent process, then start it again (same agent, key and
  issues: its next claim renews whatever lease it still holds).
- `sigstop_holder`: SIGSTOP the agent holding a live lease, wait a second (a request it sent
  just before is served), make its leases expire, wait a few seconds (others reclaim),
  SIGCONT. The API's smallest TTL is 60 s, longer than a short run
  can afford to wait, so the expiry is forced through the database clock: `UPDATE ... SET
  expires_at = now() - 1 s` on the stopped agent's leases, exactly what 60 s of silence would
  do. When it resumes, the agent still believes it holds its generation; its writes must be
  refused once someone reclaimed.
- `pg_terminate`: `pg_terminate_backend` of some of the server's backends (the server runs
  with `PGAPPNAME=chaos-server`, so only its connections are picked).
- `kill_worker`: SIGKILL a gunicorn worker; the master starts a new one.
- `issue_done`: end a lease holder's issue through the API as the board (PATCH status `done`,
  sometimes `cancelled` or `hidden: true`): its lease turns stale and can be reclaimed. Agents
  reopen their issues (PATCH `in_progress`) so that the run keeps going.
- `expire_lease`: make one live lease expire through the database clock while its holder
  keeps running: a holder whose renewals come late. Others may reclaim while the old holder
  is still writing; from then on its writes must be refused.
- `sweep`: the runtime-lease sweep runs concurrently (not a fault: another actor).
- `failover` (a replicated cluster only, tests/support/replication.py): SIGKILL the
  primary, promote the standby a second later, then clone a new standby from the new primary
  in the old one's place, so that the next failover finds one. Synchronous replication: no
  acknowledged grant may be lost.
- `cut_node` (the server in a network namespace only, tests/support/netns.py): cut the
  web node off from the database for a few seconds (a blackhole route inside its namespace:
  its clients still reach it), then heal.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psycopg

from tests.support.netns import IsolatedNode
from tests.support.replication import ReplicatedCluster

DEFAULT_WEIGHTS: dict[str, float] = {
    "kill_agent": 2,
    "sigstop_holder": 3,
    "pg_terminate": 2,
    "kill_worker": 1,
    "issue_done": 2,
    "expire_lease": 3,
    "sweep": 1,
    "failover": 1,
    "cut_node": 1,
}
# Faults that need a replicated cluster and a server in a network namespace of its own.
CLUSTER_FAULTS = frozenset({"failover", "cut_node"})
SERVER_APPLICATION_NAME = "chaos-server"


class Fleet(Protocol):
    def names(self) -> list[str]: ...
    def pid(self, name: str) -> int | None: ...
    def kill(self, name: str) -> int | None: ...
    def start(self, name: str, *, restarted: bool) -> int: ...


class Server(Protocol):
    def worker_pids(self) -> list[int]: ...


class FaultLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self.lock, self.path.open("a") as fh:
            fh.write(line)


class Nemesis(threading.Thread):
    def __init__(
        self,
        *,
        rng: random.Random,
        fleet: Fleet,
        server: Server,
        db_url: str,
        company_id: str,
        base_url: str,
        board_token: str,
        issue_owner: dict[str, str],
        log: FaultLog,
        interval: tuple[float, float] = (1.0, 4.0),
        weights: dict[str, float] | None = None,
        sweep: Callable[[], dict[str, Any]] | None = None,
        on_exit: Callable[[], None] | None = None,
        cluster: ReplicatedCluster | None = None,
        node: IsolatedNode | None = None,
    ) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.rng = rng
        self.fleet = fleet
        self.server = server
        self.db_url = db_url
        self.company_id = company_id
        self.base_url = base_url
        self.board_token = board_token
        self.issue_owner = issue_owner
        self.log = log
        self.interval = interval
        self.weights = dict(DEFAULT_WEIGHTS if weights is None else weights)
        if sweep is None:
            self.weights.pop("sweep", None)
        self.sweep_fn = sweep
        self.cluster = cluster
        self.node = node
        if cluster is None:
            self.weights.pop("failover", None)
        if node is None:
            self.weights.pop("cut_node", None)
        self.on_exit = on_exit
        self.stop_event = threading.Event()
        self.conn: psycopg.Connection[Any] | None = None
        self.errors: list[str] = []

    # --- plumbing ---------------------------------------------------------------------------
    def stop(self) -> None:
        self.stop_event.set()

    def db(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed:
            self.conn = psycopg.connect(
                self.db_url, autocommit=True, application_name="chaos-nemesis"
            )
        return self.conn

    def record(self, kind: str, t: float, w: float, **details: Any) -> None:
        self.log.write({"kind": kind, "t": t, "w": w, **details})

    def run(self) -> None:
        kinds = list(self.weights)
        weights = [self.weights[k] for k in kinds]
        try:
            while kinds and not self.stop_event.wait(self.rng.uniform(*self.interval)):
                kind = self.rng.choices(kinds, weights)[0]
                try:
                    getattr(self, kind)()
                except Exception as exc:  # a failed injection is reported, not fatal
                    self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                    self.record(
                        "nemesis_error", time.monotonic(), time.time(), error=self.errors[-1]
                    )
                    if self.conn is not None:
                        self.conn.close()
                        self.conn = None
        finally:
            if self.conn is not None:
                self.conn.close()
            if self.on_exit is not None:
                self.on_exit()

    def holders(self) -> list[dict[str, Any]]:
        """Live leases whose owner is one of our agents' issues."""
        rows = (
            self.db()
            .execute(
                "SELECT execution_workspace_id::text, generation, owner_key"
                " FROM execution_workspace_runtime_leases"
                " WHERE company_id = %s AND expires_at > now()",
                [self.company_id],
            )
            .fetchall()
        )
        out = []
        for ws, generation, owner_key in rows:
            issue = owner_key.removeprefix("issue:")
            if owner_key.startswith("issue:") and issue in self.issue_owner:
                out.append(
                    {
                        "ws": ws,
                        "generation": generation,
                        "owner_key": owner_key,
                        "issue": issue,
                        "agent": self.issue_owner[issue],
                    }
                )
        return out

    # --- faults -----------------------------------------------------------------------------
    def kill_agent(self) -> None:
        name = self.rng.choice(self.fleet.names())
        t, w = time.monotonic(), time.time()
        pid = self.fleet.kill(name)
        self.stop_event.wait(self.rng.uniform(0.3, 2.0))
        new_pid = self.fleet.start(name, restarted=True)
        self.record(
            "kill_agent", t, w, t_end=time.monotonic(), agent=name, pid=pid, new_pid=new_pid
        )

    def sigstop_holder(self) -> None:
        holders = self.holders()
        if holders:
            target = self.rng.choice(holders)
            name = target["agent"]
        else:
            target, name = None, self.rng.choice(self.fleet.names())
        pid = self.fleet.pid(name)
        if pid is None:
            return
        t, w = time.monotonic(), time.time()
        os.kill(pid, signal.SIGSTOP)
        try:
            # A request the agent sent just before it stopped is still being served; let it
            # finish first, or its renew would undo the expiry.
            self.stop_event.wait(1.0)
            owner_keys = [f"issue:{i}" for i, a in self.issue_owner.items() if a == name]
            expired = (
                self.db()
                .execute(
                    "UPDATE execution_workspace_runtime_leases"
                    " SET expires_at = now() - interval '1 second'"
                    " WHERE company_id = %s AND owner_key = ANY(%s)"
                    " RETURNING execution_workspace_id::text, generation, owner_key",
                    [self.company_id, owner_keys],
                )
                .fetchall()
            )
            t_expired = time.monotonic()
            self.stop_event.wait(self.rng.uniform(3.0, 8.0))
        finally:
            os.kill(pid, signal.SIGCONT)
        self.record(
            "sigstop_holder",
            t,
            w,
            t_end=time.monotonic(),
            t_expired=t_expired,
            agent=name,
            pid=pid,
            target=target,
            expired=[{"ws": ws, "generation": g, "owner_key": k} for ws, g, k in expired],
        )

    def pg_terminate(self) -> None:
        conn = self.db()
        backends = conn.execute(
            "SELECT pid, state FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = %s"
            " AND pid <> pg_backend_pid()",
            [SERVER_APPLICATION_NAME],
        ).fetchall()
        if not backends:
            return
        chosen = self.rng.sample(backends, self.rng.randint(1, max(1, len(backends) // 2)))
        t, w = time.monotonic(), time.time()
        done = [
            {
                "pid": pid,
                "state": state,
                "terminated": bool(
                    conn.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone()[0]
                ),
            }
            for pid, state in chosen
        ]
        self.record("pg_terminate", t, w, t_end=time.monotonic(), backends=done, of=len(backends))

    def kill_worker(self) -> None:
        workers = self.server.worker_pids()
        if not workers:
            return
        pid = self.rng.choice(workers)
        t, w = time.monotonic(), time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.record("kill_worker", t, w, t_end=time.monotonic(), pid=pid, of=len(workers))

    def issue_done(self) -> None:
        holders = self.holders()
        if not holders:
            return
        target = self.rng.choice(holders)
        change = self.rng.choices(
            [{"status": "done"}, {"status": "cancelled"}, {"hidden": True}], [70, 15, 15]
        )[0]
        t, w = time.monotonic(), time.time()
        request = urllib.request.Request(  # noqa: S310 - our own local server
            f"{self.base_url}/api/issues/{target['issue']}",
            data=json.dumps(change).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self.board_token}",
                "Content-Type": "application/json",
            },
        )
        status: int | None
        error = None
        try:
            with urllib.request.urlopen(request, timeout=20) as response:  # noqa: S310
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError as exc:
            status, error = None, f"{type(exc).__name__}: {exc}"
        self.record(
            "issue_done",
            t,
            w,
            t_end=time.monotonic(),
            target=target,
            change=change,
            status=status,
            error=error,
        )

    def expire_lease(self) -> None:
        holders = self.holders()
        if not holders:
            return
        target = self.rng.choice(holders)
        t, w = time.monotonic(), time.time()
        expired = (
            self.db()
            .execute(
                "UPDATE execution_workspace_runtime_leases"
                " SET expires_at = now() - interval '1 second'"
                " WHERE execution_workspace_id = %s AND generation = %s",
                [target["ws"], target["generation"]],
            )
            .rowcount
        )
        self.record("expire_lease", t, w, t_end=time.monotonic(), target=target, expired=expired)

    def failover(self) -> None:
        assert self.cluster is not None
        t, w = time.monotonic(), time.time()
        killed = self.cluster.primary.name
        self.cluster.crash_primary()
        if self.conn is not None:
            self.conn.close()  # its server is gone; the next db() finds the new primary
            self.conn = None
        self.stop_event.wait(1.0)
        self.cluster.promote()
        t_promoted = time.monotonic()
        timeline = self.cluster.timeline(self.cluster.standby)
        self.cluster.rebuild_standby()
        self.record(
            "failover",
            t,
            w,
            t_end=t_promoted,
            t_rebuilt=time.monotonic(),
            killed=killed,
            promoted=self.cluster.primary.name,
            timeline=timeline,
        )

    def cut_node(self) -> None:
        assert self.node is not None
        t, w = time.monotonic(), time.time()
        self.node.cut()
        try:
            self.stop_event.wait(self.rng.uniform(2.0, 6.0))
        finally:
            self.node.heal()
        self.record("cut_node", t, w, t_end=time.monotonic(), node=self.node.name)

    def sweep(self) -> None:
        assert self.sweep_fn is not None
        t, w = time.monotonic(), time.time()
        result = self.sweep_fn()
        self.record("sweep", t, w, t_end=time.monotonic(), **result)
