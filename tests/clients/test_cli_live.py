"""`paperclip-agent run` as real processes against a live multi-worker gunicorn and a real
`manage.py run_worker`, with real child commands: the happy path (checkout, command, snapshot,
commit, the tree published to the workspace head and materialized into its cwd by the worker),
a checkpoint restored by `--resume`, `kill -9` followed by a reclaim after the TTL, and a CLI
paused past its TTL that, once resumed, is refused, stops its command and exits 75 without any
write accepted after the reclaim.

The TTL is passed on the database clock (`tests.leases.factories.expire`: the lease's
`expires_at` is moved into the past, which is what waiting out the 60 s minimum TTL would do,
without the wait); every other wait is on a condition: an output line, an exit, a row.

`Cli`, `worker_env`, `materialized` and `kill_group` serve tests/clients/test_cli_snapshots_hosts.py
too.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import psutil
import pytest
from django.db import connection

from checkpoints.models import NativeRunnerCheckpoint
from paperclip.models import (
    ActivityEvent,
    CasBlob,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunResult,
    WorkspaceOperation,
)
from tests.clients.conftest import World, make_world
from tests.leases.factories import expire
from tests.paperclip.factories import HeartbeatRunFactory
from tests.paperclip.worker.test_worker_processes import Worker, wait_for
from tests.recovery.snapshots import store_tree
from tests.support.servers import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.embedded,
    pytest.mark.xdist_group("gunicorn"),
]

AGENT = str(Path(sys.executable).with_name("paperclip-agent"))
TIMEOUT = 60.0


class Cli:
    """One `paperclip-agent run` process in its own session; its output drained by threads.

    `prefix` goes before the agent's argv (e.g. `unshare -m ... sh -c '...' sh`, which ends
    with `exec "$@"`): the process is then the agent itself once the prefix has set up."""

    def __init__(
        self,
        url: str,
        world: World,
        workdir: Path,
        *command: str,
        flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        env = env or {}
        self.out: list[str] = []
        self.err: list[str] = []
        self.proc = subprocess.Popen(
            [
                *prefix, AGENT, "run",
                "--workspace", str(world.workspace.pk),
                "--issue", str(world.issue.pk),
                "--workdir", str(workdir),
                "--lease-ttl", "60",
                *flags, "--", *command,
            ],
            env={**os.environ, "PAPERCLIP_URL": url, "PAPERCLIP_AGENT_KEY": world.key, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._drain, args=(stream, sink), daemon=True).start()

    @staticmethod
    def _drain(stream: object, sink: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            sink.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(["-- stdout", *self.out, "-- stderr", *self.err])

    def line(self, pattern: str) -> re.Match[str]:
        """Wait for a stdout line matching `pattern`."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            for text in list(self.out):
                if m := re.search(pattern, text):
                    return m
            if self.proc.poll() is not None and not any(re.search(pattern, t) for t in self.out):
                time.sleep(0.2)  # the drain threads may still be reading the last lines
                if not any(re.search(pattern, t) for t in self.out):
                    break
            time.sleep(0.05)
        raise AssertionError(f"no line /{pattern}/\n{self.output()}")

    def run_id(self) -> str:
        return self.line(r"^run: ([0-9a-f-]{36})$").group(1)

    def child_pid(self) -> int:
        return int(self.line(r"started: pid (\d+)").group(1))

    def wait(self) -> int:
        try:
            code = self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the CLI did not exit\n{self.output()}") from None
        time.sleep(0.1)  # let the drain threads take the last lines
        return code

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def kill_group(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def db_now() -> object:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def materialized(workspace: ExecutionWorkspace, *watched: Worker) -> ExecutionWorkspace:
    """Wait until the worker has materialized the workspace's (non-empty) head into its cwd:
    a run's commit only defers that job, so the cwd may still lag when the CLI exits."""

    def done() -> bool:
        workspace.refresh_from_db()
        return workspace.head_tree is not None and workspace.cwd_tree == workspace.head_tree

    wait_for(done, "the head materialized into the cwd", *watched)
    return workspace


def files(root: Path) -> dict[str, bytes | None]:
    return {
        p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes()
        for p in sorted(root.rglob("*"))
    }


def test_a_command_runs_is_published_committed_materialized_and_resumed_by_a_successor(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    session = tmp_path / "session"
    script = (
        'echo hi > out.txt; mkdir -p "$S/notes/deep" "$S/empty-dir";'
        ' printf "x\\000y" > "$S/notes/deep/bin"; : > "$S/empty"; echo done'
    )
    first = Cli(
        gunicorn_url, world, tmp_path / "work", "sh", "-c", script,
        flags=("--session-dir", str(session)), env={"S": str(session)},
    )  # fmt: skip
    clis.append(first)
    assert first.wait() == 0, first.output()
    run_id = first.run_id()
    assert first.out.index(f"run: {run_id}") < next(
        i for i, line in enumerate(first.out) if "started: pid" in line
    )
    assert "done" in first.out
    tree = first.line(r"^paperclip-agent: snapshot: (sha256:[0-9a-f]{64}) 1 files, ").group(1)
    assert first.out[-1] == (
        f"paperclip-agent: finalization: committed; the run's tree {tree} published to the"
        " workspace head"
    ), first.output()
    assert first.err == []
    assert materialized(world.workspace, worker).head_tree == tree
    assert files(world.dest) == {"out.txt": b"hi\n"}
    run = HeartbeatRun.objects.get(pk=run_id)
    assert run.status == HeartbeatRun.Status.SUCCEEDED
    phases = list(
        WorkspaceOperation.objects.filter(heartbeat_run_id=run_id)
        .order_by("started_at")
        .values_list("phase", "status", "exit_code")
    )
    assert phases[:2] == [("start", "running", None), ("exit", "succeeded", 0)]
    result = NativeRunResult.objects.get(run_id=run_id)
    assert "done" in result.result_json["result"]["summary"]

    restored = tmp_path / "restored"
    second = Cli(
        gunicorn_url, world, tmp_path / "work2", "sh", "-c", 'od -c "$R/notes/deep/bin"; exit 3',
        flags=("--session-dir", str(restored), "--resume", run_id), env={"R": str(restored)},
    )  # fmt: skip
    clis.append(second)
    assert second.wait() == 3, second.output()  # the command's own status
    assert any(f"restored 2 file(s) of run {run_id}" in line for line in second.out)
    assert files(restored) == files(session)
    assert any("x  \\0   y" in line for line in second.out), second.output()
    successor = HeartbeatRun.objects.get(pk=second.run_id())
    assert successor.status == HeartbeatRun.Status.FAILED


def test_after_a_merge_the_cli_names_the_merged_head_as_published_not_its_own_tree(
    gunicorn_url: str,
    worker: Worker,
    world: World,
    tmp_path: Path,
    clis: list[Cli],
    live_cas_dir: Path,
    settings: Any,
) -> None:
    """Another run's commit moves the head while this run's command works (forced: the
    command waits for a file the test writes after moving the head): the server publishes
    the merge of both sides, and that merged tree is what the CLI names."""
    go = tmp_path / "go"
    cli = Cli(
        gunicorn_url, world, tmp_path / "work", "sh", "-c",
        'echo ours > ours.txt; while [ ! -e "$GO" ]; do sleep 0.05; done',
        env={"GO": str(go)},
    )  # fmt: skip
    clis.append(cli)
    cli.child_pid()  # checked out (the empty head) and started
    settings.PAPERCLIP_CAS_DIR = live_cas_dir
    theirs = store_tree(world.workspace.company_id, {"theirs.txt": b"theirs\n"})
    ExecutionWorkspace.objects.filter(pk=world.workspace.pk).update(head_tree=theirs)
    go.touch()
    assert cli.wait() == 0, cli.output()
    ours = cli.line(r"^paperclip-agent: snapshot: (sha256:[0-9a-f]{64}) 1 files, ").group(1)
    head = materialized(world.workspace, worker)
    assert head.head_tree not in (ours, theirs)
    assert str(head.head_run_id) == cli.run_id()
    assert cli.out[-1] == (
        f"paperclip-agent: finalization: committed; published {head.head_tree} to the"
        f" workspace head: the run's tree {ours} merged with another run's changes"
    ), cli.output()
    assert files(world.dest) == {"ours.txt": b"ours\n", "theirs.txt": b"theirs\n"}


def test_after_kill_9_another_cli_reclaims_the_lease_once_its_ttl_has_passed(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    first = Cli(gunicorn_url, world, tmp_path / "a", "sleep", "300")
    clis.append(first)
    orphan = first.child_pid()
    try:
        first_run = first.run_id()
        os.kill(first.proc.pid, signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        second = Cli(gunicorn_url, world, tmp_path / "b", "sh", "-c", "echo b > b.txt")
        clis.append(second)
        second.line(rf"waiting: workspace lease held by run:{first_run}")
        assert second.proc.poll() is None
        # Who holds the issue is said before any waiting for the workspace lease.
        said = [i for i, line in enumerate(second.out) if line.startswith("paperclip-agent: ")]
        holder_line = next(
            i
            for i in said
            if f"is held by run {first_run} (agent {world.agent.pk}" in second.out[i]
        )
        waiting_line = next(i for i in said if "waiting: workspace lease" in second.out[i])
        assert holder_line < waiting_line, second.output()
        assert re.search(
            r"running\), last renewed \d{4}-.*; it counts as orphaned from \d{4}-.*"
            r"\(our own predecessor in this workspace",
            second.out[holder_line],
        ), second.output()
        expire(world.workspace)  # the 60 s TTL passes on the database clock
        assert second.wait() == 0, second.output()
    finally:
        kill_group(orphan)
    assert any(f"predecessor: run {first_run}" in line for line in second.out), second.output()
    materialized(world.workspace, worker)
    assert (world.dest / "b.txt").read_text() == "b\n"
    assert HeartbeatRun.objects.get(pk=first_run).status == HeartbeatRun.Status.INTERRUPTED
    assert HeartbeatRun.objects.get(pk=second.run_id()).status == HeartbeatRun.Status.SUCCEEDED


def test_another_agents_live_run_holding_the_issue_is_named_before_any_wait_and_refused(
    gunicorn_url: str, world: World, tmp_path: Path
) -> None:
    other = HeartbeatRunFactory(company=world.issue.company, issue=world.issue)
    Issue.objects.filter(pk=world.issue.pk).update(execution_run=other, checkout_run=other)
    cli = Cli(gunicorn_url, world, tmp_path / "a", "true")
    assert cli.wait() == 1, cli.output()
    said = [line for line in cli.out if line.startswith("paperclip-agent: ")]
    assert said[0] == (
        f"paperclip-agent: issue: {world.issue.pk} is held by run {other.pk} (agent"
        f" {other.agent_id}, running), last renewed never; it holds no lease, so it is never"
        " judged orphaned: it must end, or the board interrupt it"
    ), cli.output()
    assert any(f"issue: held by run {other.pk} (agent {other.agent_id})" in s for s in said)
    assert any("issue_execution_locked" in line for line in cli.err), cli.output()
    assert not any("started:" in line for line in cli.out)


def test_a_cli_paused_past_its_ttl_is_refused_stops_its_command_and_exits_75(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    session = tmp_path / "session"
    first = Cli(
        gunicorn_url, world, tmp_path / "a", "sh", "-c",
        'while :; do date +%s%N >> "$S/ticks"; sleep 0.1; done',
        flags=("--session-dir", str(session), "--checkpoint-every", "2"),
        env={"S": str(session)},
    )  # fmt: skip
    clis.append(first)
    child = first.child_pid()
    first_run = first.run_id()
    # Paused just after a checkpoint, two seconds before the next one: not in the middle of a
    # write (one sent before the pause and finished after it would be a write of its own time).
    first.line(r"^paperclip-agent: checkpoint: ")
    os.kill(first.proc.pid, signal.SIGSTOP)  # the CLI only: its command keeps running
    deadline = time.monotonic() + TIMEOUT
    while psutil.Process(first.proc.pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = Cli(gunicorn_url, world, tmp_path / "b", "sh", "-c", "echo b > b.txt")
    clis.append(second)
    second.line(rf"waiting: workspace lease held by run:{first_run}")  # paused, not yet stale
    expire(world.workspace)  # paused past its TTL, on the database clock
    assert second.wait() == 0, second.output()
    assert any(f"predecessor: run {first_run}" in line for line in second.out), second.output()
    reclaimed = db_now()

    os.kill(first.proc.pid, signal.SIGCONT)
    assert first.wait() == 75, first.output()
    assert len(first.err) == 1, first.output()
    assert "lost the lease" in first.err[0]
    assert "Traceback" not in first.output()
    assert not psutil.pid_exists(child)  # stopped (and reaped) before the CLI exited

    # nothing the paused CLI sent after the reclaim was accepted
    assert not WorkspaceOperation.objects.filter(
        heartbeat_run_id=first_run, started_at__gt=reclaimed
    ).exists()
    assert not NativeRunnerCheckpoint.objects.filter(
        run_id=first_run, updated_at__gt=reclaimed
    ).exists()
    assert not NativeRunResult.objects.filter(run_id=first_run).exists()
    assert not ActivityEvent.objects.filter(run_id=first_run, created_at__gt=reclaimed).exists()
    assert list(
        WorkspaceOperation.objects.filter(heartbeat_run_id=first_run).values_list("phase")
    ) == [("start",)]
    assert HeartbeatRun.objects.get(pk=first_run).status == HeartbeatRun.Status.INTERRUPTED
    materialized(world.workspace, worker)
    assert (world.dest / "b.txt").read_text() == "b\n"


def test_bad_flags_a_refused_key_and_an_unreachable_server_give_one_line(
    gunicorn_url: str, tmp_path: Path
) -> None:
    world = make_world(tmp_path)
    base = [AGENT, "run", "--workspace", str(world.workspace.pk), "--issue", str(world.issue.pk)]
    cases = [
        ([AGENT, "run", "--issue", "x", "--", "true"], {}, 2, "--workspace"),
        ([*base, "--lease-ttl", "5", "--", "true"], {}, 2, "--lease-ttl"),
        ([*base, "--url", gunicorn_url, "--key", world.key], {}, 2, "COMMAND"),
        ([*base, "--url", f"http://127.0.0.1:{free_port()}", "--", "true"], {}, 69, "reach"),
        ([*base, "--url", gunicorn_url, "--key", "pcak_bad.key", "--", "true"], {}, 1, "refused"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAPERCLIP_")}
    for argv, extra, code, word in cases:
        done = subprocess.run(
            argv, env={**env, "PAPERCLIP_AGENT_KEY": world.key, **extra},
            capture_output=True, text=True, timeout=TIMEOUT, check=False,
        )  # fmt: skip
        assert done.returncode == code, (argv, done.stdout, done.stderr)
        assert done.stdout == ""
        lines = done.stderr.splitlines()
        assert len(lines) == 1, (argv, done.stderr)
        assert word in lines[0]
        assert "Traceback" not in done.stderr


def test_a_workdir_whose_index_names_a_collected_blob_uploads_it_when_registration_refuses(
    gunicorn_url: str,
    worker: Worker,
    world: World,
    tmp_path: Path,
    clis: list[Cli],
    live_cas_dir: Path,
) -> None:
    """A later run does not ask the store about the blobs its workdir's index names; when one
    of them is gone after all, registration's `snapshot_blobs_missing` makes it ask and upload.
    (The second run adds a symlink, so its registration walks the whole tree: one against the
    head trusts the head's blobs to be stored, and this test takes one away by hand.)"""
    work = tmp_path / "work"
    first = Cli(gunicorn_url, world, work, "sh", "-c", "echo kept > kept.txt")
    clis.append(first)
    assert first.wait() == 0, first.output()
    materialized(world.workspace, worker)
    kept = "sha256:" + hashlib.sha256(b"kept\n").hexdigest()
    assert CasBlob.objects.filter(company_id=world.workspace.company_id, digest=kept).delete()[0]
    (live_cas_dir / str(world.workspace.company_id) / kept[7:9] / kept[7:]).unlink()

    second = Cli(gunicorn_url, world, work, "sh", "-c", "echo new > new.txt; ln -s new.txt link")
    clis.append(second)
    assert second.wait() == 0, second.output()
    assert any("index named; uploading them" in line for line in second.out), second.output()
    materialized(world.workspace, worker)
    assert files(world.dest) == {
        "kept.txt": b"kept\n",
        "new.txt": b"new\n",
        "link": b"new\n",
    }
    assert os.readlink(world.dest / "link") == "new.txt"
    assert CasBlob.objects.filter(company_id=world.workspace.company_id, digest=kept).exists()
