"""`python -m paperclip.serve`, the production web server: it serves the application, stops
on SIGTERM, replaces a worker that dies, and exits non-zero when the application cannot load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from django.conf import settings

from paperclip import serve
from paperclip.testing.processes import child_env
from paperclip.testing.servers import free_port, wait_for_server


def test_the_command_runs_granian_on_the_wsgi_application() -> None:
    argv = serve.command(bind="0.0.0.0:9000", workers=3, threads=2)
    assert argv[0].endswith("granian")
    assert argv[-1] == "paperclip.wsgi:application"
    assert {"--interface=wsgi", "--host=0.0.0.0", "--port=9000", "--workers=3"} <= set(argv)
    assert "--blocking-threads=2" in argv
    assert f"--workers={serve.default_workers()}" in serve.command()


@pytest.mark.parametrize("bind", ["8000", ":8000", "host:", "host:http"])
def test_a_malformed_bind_is_refused(bind: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        serve.command(bind=bind)


def _start(port: int, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "paperclip.serve", f"--bind=127.0.0.1:{port}", "--workers=1"],
        cwd=settings.BASE_DIR,
        env=child_env(DJANGO_DEBUG="false", DJANGO_ALLOWED_HOSTS="127.0.0.1", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_it_serves_replaces_a_killed_worker_and_stops_on_sigterm() -> None:
    port = free_port()
    server = _start(port)
    try:
        conn = wait_for_server(port, server)  # type: ignore[arg-type]
        conn.close()
        # exec: the process started is the server itself, with one worker child.
        assert "granian" in " ".join(psutil.Process(server.pid).cmdline())
        (worker,) = psutil.Process(server.pid).children()
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            children = psutil.Process(server.pid).children()
            if children and children[0].pid != worker.pid:
                break
            time.sleep(0.2)  # polling the process table for the replacement
        else:
            pytest.fail("no new worker replaced the killed one")
        wait_for_server(port, server).close()  # type: ignore[arg-type]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=40) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_it_exits_non_zero_when_the_application_cannot_load() -> None:
    server = _start(free_port(), DJANGO_SECRET_KEY="")
    try:
        assert server.wait(timeout=60) != 0
        output = server.stdout.read().decode() if server.stdout else ""
        assert "DJANGO_SECRET_KEY" in output
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
