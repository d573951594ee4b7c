"""Throwaway databases and live servers for the benches and the chaos test (no Django import:
they run before Django is set up, or in plain child processes)."""

from __future__ import annotations

import http.client
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg


def with_db_name(url: str, name: str) -> str:
    """`url` with its database name replaced."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@contextmanager
def throwaway_database(
    server_url: str,
    name: str,
    *,
    keep: bool,
    log: Callable[[str], None] = print,
    template: str | None = None,
) -> Iterator[str]:
    """Create database `name` afresh on `server_url`'s server (a copy of database `template`
    when given: nobody may be connected to it), yield its URL, drop it after (unless `keep`),
    reporting each step through `log`."""
    admin_url = with_db_name(server_url, "postgres")
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if template is None:
            conn.execute(f'CREATE DATABASE "{name}"')
        else:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    log(f"created database {name}" + ("" if template is None else f" (a copy of {template})"))
    try:
        yield with_db_name(server_url, name)
    finally:
        if keep:
            log(f"kept database {name}")
        else:
            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            log(f"dropped database {name}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class NoDelayHTTPConnection(http.client.HTTPConnection):
    """http.client writes the request head and body in two send() calls; without
    TCP_NODELAY, Nagle's algorithm holds the body back until the head is ACKed, and the
    server's delayed ACK turns every POST into a multi-millisecond stall."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def wait_for_server(
    port: int, server: subprocess.Popen[bytes], *, request_timeout: float = 10
) -> NoDelayHTTPConnection:
    """A connection to the server on `port` once its /healthz answers 200 (within 60 s: a
    loaded 2-core machine has been seen to need more than 30 s to start gunicorn's workers);
    RuntimeError if the server process exits first or never answers."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"gunicorn exited with {server.returncode}")
        try:
            conn = NoDelayHTTPConnection("127.0.0.1", port, timeout=request_timeout)
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                return conn
        except OSError:
            pass
        time.sleep(0.1)  # polling a starting server; not synchronisation between workers
    raise RuntimeError("gunicorn did not become healthy within 60s")


def stop_process(process: subprocess.Popen[bytes], *, timeout: float = 15) -> None:
    """SIGTERM `process` and wait up to `timeout` seconds for it to exit, then SIGKILL it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class AutovacuumStandIn:
    """What autovacuum would do to the bench's tables, for a server that runs without it.

    This project's CI and development machines run PostgreSQL with `autovacuum = off`;
    production servers never do. Without it, a table the bench updates without pause keeps
    every dead row version (a renew is a HOT update now, whose dead versions page pruning
    reclaims, but the raw baseline's upserts and every claim are not), and its statistics stay
    those of the last explicit ANALYZE, so a prepared statement keeps the generic plan it was
    given while the table was nearly empty (a Seq Scan) however far the table grows.
    `due()` runs `VACUUM (ANALYZE)` on `tables` when the server's autovacuum is off and at least
    `autovacuum_naptime` has passed since the last run: the launcher's own cadence, not more
    often. On a server with autovacuum on it does nothing; the server does it.
    """

    def __init__(
        self, url: str, tables: tuple[str, ...], *, log: Callable[[str], None] = print
    ) -> None:
        self._url = url
        self._tables = tables
        with psycopg.connect(url, autocommit=True) as conn:
            on = conn.execute("SELECT current_setting('autovacuum')::bool").fetchone()
            nap = conn.execute(
                "SELECT extract(epoch FROM current_setting('autovacuum_naptime')::interval)"
            ).fetchone()
        self.active = not (on and on[0])
        self.naptime = float(nap[0]) if nap else 60.0
        self._last = time.monotonic()
        self.runs = 0
        if self.active:
            log(
                f"the server runs with autovacuum off: the bench vacuums {', '.join(tables)} "
                f"itself, at most every {self.naptime:.0f} s (autovacuum_naptime)"
            )

    def due(self) -> None:
        if not self.active or time.monotonic() - self._last < self.naptime:
            return
        with psycopg.connect(self._url, autocommit=True) as conn:
            for table in self._tables:
                conn.execute(f"VACUUM (ANALYZE) {table}")
        self._last = time.monotonic()
        self.runs += 1
