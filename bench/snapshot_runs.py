"""What the snapshot benches share (bench/snapshots.py, bench/snapshots_cas.py,
bench/snapshots_scale.py): the database, the server,
worker and CLI processes they start, the world each round runs in, and the checks of a tree's
files. Not part of the test suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.rss import RssSampler  # noqa: E402 - after the path setup
from tests.support.servers import stop_process  # noqa: E402

AGENT = str(Path(sys.executable).with_name("paperclip-agent"))
MB = 1024 * 1024
RUN_TIMEOUT = 1800.0


def log(message: str = "") -> None:
    print(message, flush=True)


def compile_client() -> None:
    """The client's modules compiled to bytecode, as an installed CLI has them: pip compiles a
    package when it installs it, and Python writes an editable one's bytecode at its first
    import, unless PYTHONDONTWRITEBYTECODE is set (as on this project's CI machines and
    sandboxes), where every start of the CLI would compile the client's modules again, about
    30 ms of its start here that a user's CLI never pays. Done once, before anything is timed."""
    import compileall

    compileall.compile_dir(ROOT / "clients" / "python" / "paperclip_client", quiet=1)


def prepare(bench_url: str, scratch: Path) -> dict[str, str]:
    """Django set up on the throwaway database (migrated), its data directory in `scratch`:
    the environment the server and the worker start with."""
    os.environ["DATABASE_URL"] = bench_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "paperclip.settings"
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
    data = scratch / "data"
    data.mkdir()
    os.environ["PAPERCLIP_DATA_DIR"] = str(data)
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    log("migrating ...")
    call_command("migrate", verbosity=0)
    connection.close()
    return {
        **os.environ,
        "DJANGO_CONN_MAX_AGE": "600",
        "DJANGO_DEBUG": "false",
        "DJANGO_ALLOWED_HOSTS": "127.0.0.1,localhost",
    }


# --- processes ------------------------------------------------------------------------------


@contextmanager
def subprocess_running(
    label: str, argv: list[str], env: dict[str, str], *, logfile: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process, its output into `logfile` (else inherited), stopped on leaving."""
    with ExitStack() as files:
        out = files.enter_context(logfile.open("ab")) if logfile is not None else None
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=out)
        try:
            yield proc
        finally:
            stop_process(proc, timeout=30)
            log(f"{label} (pid {proc.pid}) stopped")


@contextmanager
def serving(
    kind: str,
    env: dict[str, str],
    logs: Path,
    *,
    label: str = "",
    worker_prefix: list[str] | None = None,
) -> Iterator[tuple[str, RssSampler]]:
    """The HTTP server (`kind`) and a worker running with `env`, their output in `logs`
    (`server<label>.log`, `worker<label>.log`): the server's URL and a sampler of its RSS."""
    from tests.support.servers import free_port, wait_for_server

    port = free_port()
    argv = server_argv(kind, port)
    with ExitStack() as stack:
        log(f"starting {kind}{label}: {Path(argv[0]).name} {' '.join(argv[1:])}")
        server = stack.enter_context(
            subprocess_running(f"{kind}{label}", argv, env, logfile=logs / f"server{label}.log")
        )
        wait_for_server(port, server, request_timeout=30).close()
        stack.enter_context(
            subprocess_running(
                f"worker{label}",
                [*(worker_prefix or [sys.executable]), "manage.py", "run_worker"],
                env,
                logfile=logs / f"worker{label}.log",
            )
        )
        sampler = stack.enter_context(RssSampler(server.pid))
        yield f"http://127.0.0.1:{port}", sampler


def server_argv(kind: str, port: int) -> list[str]:
    if kind == "gunicorn":
        return [
            str(Path(sys.executable).with_name("gunicorn")),
            "paperclip.wsgi:application",
            f"--bind=127.0.0.1:{port}",
            "--workers=2",
            "--worker-class=gthread",
            "--threads=4",
            "--keep-alive=30",
            "--log-level=warning",
        ]
    from paperclip import serve

    return serve.command(bind=f"127.0.0.1:{port}")


@dataclass
class CliRun:
    """One `paperclip-agent run -- true`: its wall time, its output lines with the time each
    arrived (from the start), and the uploaded bytes its `snapshot:` line reports."""

    seconds: float = 0.0
    lines: list[tuple[float, str]] = field(default_factory=list)

    def at(self, prefix: str) -> float:
        return next((t for t, line in self.lines if line.startswith(prefix)), float("nan"))

    def uploaded(self) -> int:
        for _t, line in self.lines:
            if m := re.match(r"snapshot: \S+ \d+ files, \d+ bytes, (\d+) bytes uploaded", line):
                return int(m.group(1))
        raise RuntimeError("no snapshot line:\n" + "\n".join(line for _t, line in self.lines))

    def head(self) -> str:
        for _t, line in self.lines:
            if m := re.match(r"snapshot: (sha256:[0-9a-f]{64}) ", line):
                return m.group(1)
        raise RuntimeError("no snapshot line:\n" + "\n".join(line for _t, line in self.lines))


def start_watcher(workdir: Path) -> subprocess.Popen[str]:
    """`paperclip-agent watch` on the workdir, once it watches every directory."""
    proc = subprocess.Popen(
        [AGENT, "watch", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "directories watched" not in line:
        proc.kill()
        raise RuntimeError(f"paperclip-agent watch did not start: {line}")
    return proc


def scan_line(run: CliRun) -> str:
    """How the CLI read the workdir: its `watcher:` or `full scan:` line."""
    return next((t for _at, t in run.lines if t.startswith(("watcher:", "full scan:"))), "?")


def run_cli(
    url: str, world: World, workdir: Path, sampler: RssSampler, profile: Path | None
) -> CliRun:
    prefix = (
        [sys.executable, "-m", "cProfile", "-o", str(profile), AGENT]
        if profile is not None
        else [AGENT]
    )
    argv = [
        *prefix, "run",
        "--workspace", world.workspace_id,
        "--issue", world.issue_id,
        "--workdir", str(workdir),
        "--lease-ttl", "600",
        "--", "true",
    ]  # fmt: skip
    result = CliRun()
    started = time.perf_counter()
    proc = subprocess.Popen(
        argv,
        env={**os.environ, "PAPERCLIP_URL": url, "PAPERCLIP_AGENT_KEY": world.key},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sampler.cli = psutil.Process(proc.pid)
    assert proc.stdout is not None
    for line in proc.stdout:
        text = line.rstrip("\n")
        result.lines.append((time.perf_counter() - started, text.removeprefix("paperclip-agent: ")))
    code = proc.wait(timeout=RUN_TIMEOUT)
    result.seconds = time.perf_counter() - started
    sampler.cli = None
    if code != 0:
        raise RuntimeError(
            f"paperclip-agent exited {code}:\n" + "\n".join(t for _, t in result.lines)
        )
    return result


def wait_materialized(workspace_id: str, head: str, timeout: float = RUN_TIMEOUT) -> None:
    """Until the workspace's cwd holds `head` (the materialization job recorded it)."""
    from django.db import connection

    from paperclip.models import ExecutionWorkspace

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = ExecutionWorkspace.objects.values("head_tree", "cwd_tree").get(pk=workspace_id)
        connection.close()  # no transaction or snapshot kept between polls
        if row["head_tree"] == head and row["cwd_tree"] == head:
            return
        time.sleep(0.02)  # polling a row another process writes
    raise RuntimeError(f"the cwd did not reach {head} within {timeout:.0f}s")


def job_seconds(worker_log: Path, head: str) -> str:
    """The worker's own timing of the last finalization and of the materialization of
    `head` (its job log lines; the job's line follows the commit the bench polls for, so it
    is waited for a moment)."""
    deadline = time.monotonic() + 5.0
    while True:
        text = worker_log.read_text(errors="replace")
        final = re.findall(r"finalize_run succeeded in ([0-9.]+) s: committed", text)
        made = re.findall(
            rf"materialize_workspace succeeded in ([0-9.]+) s: materialized {head} ", text
        )
        if made or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # the worker writes its log line after its transaction
    return (
        f"finalize job {final[-1] if final else '?'} s,"
        f" materialize job {made[-1] if made else '?'} s"
    )


# --- fixtures -------------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    key: str
    workspace_id: str
    issue_id: str
    cwd: Path


def make_world(n: int, cwd: Path) -> World:
    from paperclip.credentials import agent_key_create
    from paperclip.models import Agent, Company, ExecutionWorkspace, Issue

    company = Company.objects.create(name=f"bench-{n}")
    agent = Agent.objects.create(company=company, name=f"bench-agent-{n}")
    cwd.mkdir()
    workspace = ExecutionWorkspace.objects.create(company=company, name=f"bench-{n}", cwd=str(cwd))
    issue = Issue.objects.create(
        company=company,
        title=f"bench {n}",
        status=Issue.Status.IN_PROGRESS,
        assignee_agent=agent,
        execution_workspace=workspace,
    )
    return World(
        key=agent_key_create(agent_id=agent.pk).secret,
        workspace_id=str(workspace.pk),
        issue_id=str(issue.pk),
        cwd=cwd,
    )


def dir_blobs(workdir: Path) -> dict[str, int]:
    """The directory blobs of the tree the workdir last held (the client's dirs.json), by
    name, with their sizes."""
    from paperclip_client.workdir.index import load_dirs  # the client's reading of its file

    return {name: len(blob) for name, blob in load_dirs(workdir).items()}


def same_files(a: Path, b: Path) -> bool:
    done = subprocess.run(
        ["diff", "-r", "--no-dereference", "--exclude=.paperclip", str(a), str(b)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0
