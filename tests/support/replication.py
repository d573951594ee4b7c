"""A primary and a streaming standby, built from the machine's PostgreSQL binaries, for the
failover tests (docs/ha.md#how-it-is-tested).

`ReplicatedCluster` runs `initdb` for the primary, starts it, clones it with
`pg_basebackup -R` (which writes the standby's `primary_conninfo` and `standby.signal`),
starts the standby and waits until it streams, synchronously when asked (the primary names it
in `synchronous_standby_names`, so a commit returns only once the standby has flushed it).
`crash_primary()` SIGKILLs every process of the primary at once (what a power cut does to the
database: no shutdown checkpoint, connections reset); `promote()` runs `pg_ctl promote`.
`url(db)` is the multi-host URL the nodes use, in libpq form with
`target_session_attrs=read-write`, primary first.

PostgreSQL refuses to run as root: as root, the servers run as the `postgres` system user
(which the Debian packages create) in a directory it owns. No Django import: the cluster is
built before any node starts.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import psycopg

from tests.support.servers import free_port

STANDBY_NAME = "standby1"
NAMESPACE_SUBNETS = "10.231.0.0/16"  # tests/support/netns.py


def postgres_bindir() -> Path:
    """The newest server binaries under the Debian packages' directory, or the ones beside the
    `pg_ctl` on PATH."""
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if candidates:
        return candidates[-1].parent
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    raise RuntimeError("no PostgreSQL server binaries (pg_ctl) on this machine")


def _server_user() -> pwd.struct_passwd | None:
    """The user the servers run as: `postgres` when this process is root, else ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError as exc:
        raise RuntimeError("running as root, and there is no `postgres` user to run as") from exc


@dataclass
class Node:
    name: str
    port: int
    datadir: Path
    log: Path

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=3"

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.datadir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


class ReplicatedCluster:
    def __init__(
        self,
        *,
        synchronous: bool,
        log: Callable[[str], None] = print,
        base_dir: Path | None = None,
    ) -> None:
        self.synchronous = synchronous
        self.log = log
        self.bindir = postgres_bindir()
        self.user = _server_user()
        self.root = Path(tempfile.mkdtemp(prefix="paperclip-ha-", dir=base_dir))
        # Named, not by role: the roles swap at every failover (rebuild_standby).
        self.primary, self.standby = (
            Node(name, free_port(), self.root / name, self.root / f"{name}.log")
            for name in ("pg1", "pg2")
        )
        if self.user is not None:
            os.chown(self.root, self.user.pw_uid, self.user.pw_gid)

    # --- running the binaries -------------------------------------------------------------

    def _demote(self) -> None:  # runs in the child, before exec
        if self.user is not None:
            os.setgid(self.user.pw_gid)
            os.setuid(self.user.pw_uid)

    def _run(self, tool: str, *args: str, timeout: float = 120) -> None:
        result = subprocess.run(
            [str(self.bindir / tool), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=self._demote,
            cwd=self.root,
            env={**os.environ, "LC_ALL": "C.UTF-8", "PGCONNECT_TIMEOUT": "5"},
        )
        if result.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{result.stdout}{result.stderr}")

    def _start(self, node: Node) -> None:
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(node.datadir), "-l", str(node.log))
        role = "primary" if node is self.primary else "standby"
        self.log(f"{node.name} started on port {node.port} ({role})")

    # --- life cycle -----------------------------------------------------------------------

    def start(self) -> ReplicatedCluster:
        primary, standby = self.primary, self.standby
        self._run(
            "initdb", "-D", str(primary.datadir), "-U", "postgres", "-A", "trust", "-E", "UTF8"
        )
        settings = [
            # Every address: nodes in a network namespace of their own reach the servers
            # through the host's end of their veth pair (tests/support/netns.py).
            "listen_addresses = '*'",
            f"port = {primary.port}",
            f"unix_socket_directories = '{self.root}'",
            "wal_level = replica",
            "max_wal_senders = 5",
            "max_connections = 200",
            "hot_standby = on",
            "fsync = on",
            "synchronous_commit = on",
            "wal_sender_timeout = 10s",
            "wal_receiver_status_interval = 1s",
            f"synchronous_standby_names = '{STANDBY_NAME if self.synchronous else ''}'",
            "shared_buffers = 32MB",
        ]
        with (primary.datadir / "postgresql.conf").open("a") as conf:
            conf.write("\n# paperclip failover test\n" + "\n".join(settings) + "\n")
        with (primary.datadir / "pg_hba.conf").open("a") as hba:
            hba.write(
                f"host replication all 127.0.0.1/32 trust\nhost all all {NAMESPACE_SUBNETS} trust\n"
            )
        self._start(primary)
        self._clone(primary, standby)
        self._start(standby)
        self.wait_streaming()
        return self

    def _clone(self, source: Node, target: Node) -> None:
        """`target` becomes a standby of `source`: `pg_basebackup -R` (primary_conninfo and
        standby.signal), then its own port."""
        self._run(
            "pg_basebackup",
            "-d",
            f"host=127.0.0.1 port={source.port} user=postgres application_name={STANDBY_NAME}",
            "-D",
            str(target.datadir),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
        )
        with (target.datadir / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"port = {target.port}\n")

    def wait_streaming(self, within: float = 60) -> None:
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + within
        state = None
        while time.monotonic() < deadline:
            with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
                row = conn.execute(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                    [STANDBY_NAME],
                ).fetchone()
            state = row
            if row is not None and row[0] == "streaming" and row[1] == want:
                self.log(f"standby streaming ({want})")
                return
            time.sleep(0.2)  # polling the replication status view
        raise RuntimeError(f"the standby is not streaming {want} after {within} s: {state}")

    def url(self, dbname: str, host: str = "127.0.0.1") -> str:
        """The multi-host URL of `dbname`, both servers reached at `host`."""
        hosts = f"{host}:{self.primary.port},{host}:{self.standby.port}"
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write"

    def create_database(self, name: str) -> None:
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def crash_primary(self) -> None:
        """SIGKILL the primary's postmaster and every one of its processes at once."""
        pid = self.primary.postmaster_pid()
        if pid is None:
            raise RuntimeError("the primary is not running")
        try:
            postmaster = psutil.Process(pid)
            victims = [postmaster, *postmaster.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=10)
        self.log(f"primary {self.primary.name} (postmaster {pid}) killed with SIGKILL")

    def pause_replication(self) -> None:
        """SIGSTOP the primary's WAL sender: what the primary commits from now on is not
        shipped (with asynchronous replication, commits still return), and goes with it when
        it is killed. Nothing is left in flight in a socket buffer to be read later."""
        # The primary names its WAL senders itself; walking the postmaster's children by
        # command line raced with a backend exiting at that moment (a zombie has none).
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            pids = [row[0] for row in conn.execute("SELECT pid FROM pg_stat_replication")]
        if not pids:
            raise RuntimeError("the primary has no WAL sender")
        for pid in pids:
            psutil.Process(pid).send_signal(signal.SIGSTOP)

    def promote(self) -> None:
        """Promote the standby. It inherited `synchronous_standby_names` from the primary and
        has no standby of its own: it stops waiting for one, as Patroni does when the last
        synchronous standby is gone (without `synchronous_mode_strict`), or as a third node
        taking the synchronous role would allow (docs/ha.md#synchronous-replication)."""
        self._run("pg_ctl", "promote", "-w", "-t", "60", "-D", str(self.standby.datadir))
        with psycopg.connect(self.standby.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")
            conn.execute("SELECT pg_reload_conf()")
        self.log(f"standby {self.standby.name} promoted")

    def rebuild_standby(self) -> None:
        """After a promotion: the crashed primary's place is taken by a fresh standby of the
        new primary (its data directory cloned again, on the same port), synchronous when the
        cluster is, so that the next failover finds a standby again."""
        old, new = self.primary, self.standby
        shutil.rmtree(old.datadir, ignore_errors=True)
        self._clone(new, old)
        self.primary, self.standby = new, old
        self._start(old)
        if self.synchronous:
            with psycopg.connect(new.dsn, autocommit=True) as conn:
                conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
                conn.execute("SELECT pg_reload_conf()")
        self.wait_streaming()

    def timeline(self, node: Node) -> int:
        """The timeline `node` writes on (it changes at the promotion, before any checkpoint)."""
        with psycopg.connect(node.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT pg_walfile_name(pg_current_wal_lsn())").fetchone()
        if row is None:
            raise RuntimeError(f"{node.name}: no WAL position")
        return int(str(row[0])[:8], 16)

    def stop(self) -> None:
        for node in (self.standby, self.primary):
            pid = node.postmaster_pid()
            if pid is None or not psutil.pid_exists(pid):
                continue
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "stop", "-m", "immediate", "-D", str(node.datadir), timeout=30)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def replicated_cluster(
    *, synchronous: bool, log: Callable[[str], None] = print
) -> Iterator[ReplicatedCluster]:
    cluster = ReplicatedCluster(synchronous=synchronous, log=log)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
