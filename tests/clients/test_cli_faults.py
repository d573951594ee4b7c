"""The agent CLI under faults it must ride out: a write whose answer is lost after the command
ran, a periodic checkpoint whose answer is lost, processes its command leaves behind, and its
own stdout closed by its reader. The real CLI against the live gunicorn and a worker, through
a proxy that injects the faults (`fault_proxy.py`); found in review."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from paperclip.models import ExecutionWorkspace, HeartbeatRun, WorkspaceOperation
from tests.clients.conftest import World
from tests.clients.fault_proxy import Proxy, once
from tests.clients.test_cli_live import AGENT, Cli, kill_group
from tests.leases.factories import expire
from tests.paperclip.worker.test_worker_processes import Worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.xdist_group("cli_faults"),  # a gunicorn of its own, beside the live tests
]


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    found = []
    for process in psutil.process_iter(["status"]):
        with contextlib.suppress(OSError):
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
    return found


def test_a_lost_answer_to_the_exit_operation_does_not_drop_the_runs_work(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    """The server recorded the fenced `exit` operation and the answer was lost: the CLI
    marked the run failed and published nothing, although the command exited 0."""
    proxy = Proxy(gunicorn_url)
    proxy.rules.append(
        once("POST", "/operations", "drop_after", when=lambda body: b'"exit"' in body)
    )
    cli = Cli(proxy.url, world, tmp_path / "work", "sh", "-c", "echo important > work.txt")
    clis.append(cli)
    assert cli.wait() == 0, cli.output()
    assert "the exit operation's outcome is unknown" in cli.output()
    assert HeartbeatRun.objects.get(pk=cli.run_id()).status == "succeeded"
    assert ExecutionWorkspace.objects.get(pk=world.workspace.pk).head_tree is not None
    phases = WorkspaceOperation.objects.filter(heartbeat_run_id=cli.run_id()).values_list(
        "phase", flat=True
    )
    assert list(phases).count("exit") == 1  # recorded once, never sent again


def test_a_lost_answer_to_a_periodic_checkpoint_does_not_stop_the_command(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    """A checkpoint write whose answer was lost (or a database failover outlasting the
    client's retries) ended the run: the command stopped, the run failed, exit 1."""
    proxy = Proxy(gunicorn_url)
    session, go = tmp_path / "session", tmp_path / "go"
    session.mkdir()
    cli = Cli(
        proxy.url,
        world,
        tmp_path / "work",
        "sh",
        "-c",
        'i=0; while [ ! -e "$GO" ]; do i=$((i+1)); echo $i > "$S/s.txt"; sleep 0.2; done;'
        " echo done > out.txt",
        flags=("--session-dir", str(session), "--checkpoint-every", "1"),
        env={"S": str(session), "GO": str(go)},
    )
    clis.append(cli)
    cli.line(r"^paperclip-agent: checkpoint: ")
    proxy.rules.append(once("PUT", "/checkpoint", "drop_after"))
    deadline = time.monotonic() + 30
    while not any("the command goes on" in line for line in cli.err):
        assert time.monotonic() < deadline, cli.output()
        assert cli.proc.poll() is None, cli.output()
        time.sleep(0.1)
    time.sleep(2.5)  # the checkpoints after it go through; the command runs on
    assert cli.proc.poll() is None, cli.output()
    go.touch()
    assert cli.wait() == 0, cli.output()
    assert HeartbeatRun.objects.get(pk=cli.run_id()).status == "succeeded"
    assert (tmp_path / "work" / "out.txt").read_text() == "done\n"


def test_what_the_command_leaves_running_is_stopped_before_the_snapshot(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    """A background writer the command left in its process group went on changing the
    workdir during the snapshot and after it."""
    work = tmp_path / "w"
    cli = Cli(
        gunicorn_url,
        world,
        work,
        "sh",
        "-c",
        "(i=0; while [ $i -lt 400 ]; do i=$((i+1)); echo $i > daemon.txt; sleep 0.05; done)"
        " >/dev/null 2>&1 & sleep 0.5; echo main > main.txt",
    )
    clis.append(cli)
    leader = cli.child_pid()
    try:
        assert cli.wait() == 0, cli.output()
        assert "left processes running in its process group: stopping them" in cli.output()
        assert _group(leader) == []
        before = (work / "daemon.txt").read_text()
        time.sleep(0.3)
        assert (work / "daemon.txt").read_text() == before
    finally:
        kill_group(leader)


def test_a_lost_lease_stops_every_member_of_the_commands_group(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    """The command (the group's leader) ends on SIGTERM; a member ignoring it was never sent
    SIGKILL, and wrote on in the workdir after the CLI said the command was stopped."""
    work = tmp_path / "a"
    first = Cli(
        gunicorn_url,
        world,
        work,
        "sh",
        "-c",
        '(trap "" TERM; while :; do date +%s%N >> bg; sleep 0.1; done) &'
        " while :; do sleep 0.1; done",
    )
    clis.append(first)
    leader = first.child_pid()
    try:
        second = Cli(gunicorn_url, world, tmp_path / "b", "sh", "-c", "echo b > b.txt")
        clis.append(second)
        second.line(r"waiting: workspace lease held by run:")
        os.kill(first.proc.pid, signal.SIGSTOP)
        expire(world.workspace)
        assert second.wait() == 0, second.output()
        os.kill(first.proc.pid, signal.SIGCONT)  # its next renew is refused
        assert first.wait() == 75, first.output()
        assert _group(leader) == []
        size = (work / "bg").stat().st_size
        time.sleep(0.5)
        assert (work / "bg").stat().st_size == size
    finally:
        kill_group(leader)


def test_a_closed_stdout_never_wedges_the_command(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path
) -> None:
    """The CLI's reader went away (`| head`, a lost ssh session): the thread copying the
    command's output died on EPIPE, the command blocked on its full pipe for good, and the
    CLI renewed the lease for ever."""
    work = tmp_path / "w"
    argv = [
        AGENT, "run", "--workspace", str(world.workspace.pk), "--issue", str(world.issue.pk),
        "--workdir", str(work), "--lease-ttl", "60", "--",
        "sh", "-c", "sleep 1; head -c 2000000 /dev/zero | tr '\\0' x; echo; echo done > done.txt",
    ]  # fmt: skip
    env = {**os.environ, "PAPERCLIP_URL": gunicorn_url, "PAPERCLIP_AGENT_KEY": world.key}
    cli = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    assert cli.stdout is not None
    assert cli.stderr is not None
    leader = None
    for raw in cli.stdout:
        if b"started: pid" in raw:
            leader = int(raw.split(b"started: pid ")[1].split()[0])
            break
    assert leader is not None
    cli.stdout.close()  # the reader goes away
    try:
        assert cli.wait(timeout=60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(cli.pid, signal.SIGKILL)
        kill_group(leader)
    assert (work / "done.txt").read_text() == "done\n"
    assert b"Traceback" not in cli.stderr.read()
