"""`python -m paperclip.serve`, the production web server: it serves the application, stops
on SIGTERM, replaces a worker that dies, and exits non-zero when the application cannot load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from django.conf import settings

from paperclip import serve
from tests.support.processes import child_env
from tests.support.servers import free_port, wait_for_server


def test_the_command_runs_granian_on_the_wsgi_application() -> None:
    argv = serve.command(bind="0.0.0.0:9000", workers=3, threads=2)
    assert argv[0].endswith("granian")
    assert argv[-1] == "paperclip.wsgi:application"
    assert {"--interface=wsgi", "--host=0.0.0.0", "--port=9000", "--workers=3"} <= set(argv)
    assert "--blocking-threads=2" in argv
    assert f"--workers={serve.default_workers()}" in serve.command()


def test_the_static_root_is_the_settings_static_root() -> None:
    assert serve.static_root() == settings.STATIC_ROOT


def test_the_collected_static_files_are_served_under_static_and_nothing_else_without_them(
    tmp_path: Path,
) -> None:
    argv = serve.command(static=tmp_path)
    assert {"--static-path-route=/static", f"--static-path-mount={tmp_path}"} <= set(argv)
    assert argv[-1] == "paperclip.wsgi:application"
    assert not [a for a in serve.command() if a.startswith("--static")]


@pytest.mark.parametrize("bind", ["8000", ":8000", "host:", "host:http"])
def test_a_malformed_bind_is_refused(bind: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        serve.command(bind=bind)


def _start(port: int, data_dir: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
    if data_dir is not None:
        env["PAPERCLIP_DATA_DIR"] = str(data_dir)
    return subprocess.Popen(
        [sys.executable, "-m", "paperclip.serve", f"--bind=127.0.0.1:{port}", "--workers=1"],
        cwd=settings.BASE_DIR,
        env=child_env(DJANGO_DEBUG="false", DJANGO_ALLOWED_HOSTS="127.0.0.1", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_it_serves_replaces_a_killed_worker_and_stops_on_sigterm(tmp_path: Path) -> None:
    (tmp_path / "static").mkdir()
    (tmp_path / "static" / "paperclip-probe.css").write_bytes(b"body{}")
    port = free_port()
    server = _start(port, data_dir=tmp_path)
    try:
        conn = wait_for_server(port, server)  # type: ignore[arg-type]
        # The collected static files are served without a proxy: the console is styled.
        conn.request("GET", "/static/paperclip-probe.css")
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b"body{}")
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
