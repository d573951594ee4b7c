"""Workspace snapshots with real processes: `paperclip-agent run` against a live gunicorn and a
real `manage.py run_worker`, the agent's workdir on a filesystem that only the agent can see.

- Agents on another host: each CLI runs in its own mount namespace with a private tmpfs
  mounted on its workdir, so the host (the server and the worker) sees an empty directory at
  that path; the work reaches the workspace through the API alone (checkout, snapshot,
  publish, materialization), and the next agent starts from it.
- A run that starts from an empty workdir and deletes nothing leaves the workspace as it was
  (the old copy-back made the workspace exactly the run's workdir: empty).
- kill -9 of the CLI in the middle of its upload, then a rerun that uploads only the rest.
- kill -9 of the worker in the middle of a materialization, then an exact tree after the next
  attempt by another worker.
- Two companies kept apart in the store, through the real server.

The private mounts need `unshare -m` (root, or a user namespace): elsewhere these tests skip,
but under CI=true a missing `unshare` or a refused mount fails them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
from django.db.models import Sum

from paperclip.models import CasBlob, ExecutionWorkspace, HeartbeatRun
from paperclip.snapshots.dirfd import TEMP_MARK
from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.trees import blob_name, build
from paperclip_client import Client
from paperclip_client.errors import NotFound
from tests.clients.conftest import World, make_world, worker_env
from tests.clients.test_cli_live import Cli, kill_group, materialized
from tests.leases.factories import expire
from tests.paperclip.worker.test_worker_processes import Worker, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.embedded,
    pytest.mark.xdist_group("gunicorn"),
]

TREE = r"(sha256:[0-9a-f]{64})"
CHECKOUT = rf"^paperclip-agent: checkout: ({TREE[1:-1]}|empty) (\d+) files, (\d+) bytes fetched$"
SNAPSHOT = rf"^paperclip-agent: snapshot: {TREE} (\d+) files, (\d+) bytes, (\d+) bytes uploaded$"
# The agent runs with a tmpfs mounted on its workdir in a mount namespace of its own: the
# mount is invisible outside it, as a sandbox's filesystem on another machine would be.
PRIVATE = (
    "unshare", "-m", "--propagation", "private",
    "sh", "-c", 'mount -t tmpfs tmpfs "$PRIVATE_DIR" && exec "$@"', "sh",
)  # fmt: skip


def unavailable(reason: str) -> None:
    """Skip for want of private mounts, except under CI, where they are required."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture
def private_mounts(tmp_path: Path) -> None:
    """Private tmpfs mounts work here (root or user namespaces, and `unshare` installed)."""
    if shutil.which("unshare") is None:
        unavailable("`unshare` (util-linux) is not installed")
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        [*PRIVATE, "touch", str(probe / "inside")],
        env={**os.environ, "PRIVATE_DIR": str(probe)},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        unavailable(f"a private tmpfs mount was refused: {done.stderr.strip()}")
    assert list(probe.iterdir()) == []  # the file went to the private tmpfs, not here


def private_cli(url: str, world: World, workdir: Path, *command: str) -> Cli:
    """A CLI whose --workdir is a private tmpfs: the host keeps seeing `workdir` empty."""
    workdir.mkdir()
    return Cli(url, world, workdir, *command, env={"PRIVATE_DIR": str(workdir)}, prefix=PRIVATE)


def on_disk(root: Path) -> str:
    """The tree `root` holds, named as the server names trees."""
    return build(read_tree(str(root)))[0]


def fetched(cli: Cli) -> tuple[str, int, int]:
    m = cli.line(CHECKOUT)
    return m.group(1), int(m.group(2)), int(m.group(3))


def snapshotted(cli: Cli) -> tuple[str, int, int, int]:
    m = cli.line(SNAPSHOT)
    return m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))


def head(workspace: ExecutionWorkspace) -> str | None:
    """The workspace's head now: it moves in the transaction that commits the run, so it is
    final once the CLI has said `finalization: committed` (its cwd may still lag)."""
    workspace.refresh_from_db()
    return workspace.head_tree


def blob_bytes(workspace: ExecutionWorkspace) -> tuple[int, int]:
    """How many blobs the workspace's company stores, and their bytes."""
    rows = CasBlob.objects.filter(company_id=workspace.company_id)
    return rows.count(), int(rows.aggregate(total=Sum("size"))["total"] or 0)


def test_agents_on_other_hosts_hand_the_workspace_on_through_the_api(
    gunicorn_url: str,
    worker: Worker,
    world: World,
    tmp_path: Path,
    clis: list[Cli],
    private_mounts: None,
) -> None:
    write_first = (
        "echo one > one.txt; mkdir -p sub/deeper; printf 'deep\\000' > sub/deeper/deep.bin;"
        " ln -s sub/deeper/deep.bin link"
    )
    first = private_cli(gunicorn_url, world, tmp_path / "host-a", "sh", "-c", write_first)
    clis.append(first)
    assert first.wait() == 0, first.output()
    assert fetched(first) == ("empty", 0, 0)
    tree1, files1, bytes1, uploaded1 = snapshotted(first)
    assert (files1, bytes1) == (2, len(b"one\n") + len(b"deep\0"))
    assert uploaded1 > bytes1  # the contents and the three directories' blobs
    assert list((tmp_path / "host-a").iterdir()) == []  # the host never saw the work
    assert head(world.workspace) == tree1
    assert materialized(world.workspace, worker).head_tree == tree1
    assert world.workspace.head_run_id is not None
    assert str(world.workspace.head_run_id) == first.run_id()

    check_and_write = (
        'test "$(cat one.txt)" = one && test -L link && test "$(readlink link)" ='
        " sub/deeper/deep.bin && cmp link sub/deeper/deep.bin && echo two > two.txt"
    )
    second = private_cli(gunicorn_url, world, tmp_path / "host-b", "sh", "-c", check_and_write)
    clis.append(second)
    assert second.wait() == 0, second.output()  # run 1's files were there, checked out
    # From an empty workdir the checkout fetched every blob of the head: what run 1 uploaded.
    assert fetched(second) == (tree1, files1, uploaded1)
    tree2, files2, bytes2, uploaded2 = snapshotted(second)
    assert (files2, bytes2) == (3, bytes1 + len(b"two\n"))
    assert list((tmp_path / "host-b").iterdir()) == []
    assert head(world.workspace) == tree2

    workspace = materialized(world.workspace, worker)
    assert workspace.head_tree == tree2 != tree1
    assert workspace.cwd_tree == tree2
    root, dirs = build(read_tree(str(world.dest)))
    assert root == tree2  # the cwd on the host holds exactly the head
    assert uploaded2 == len(b"two\n") + len(dirs[tree2])  # two.txt and the new root only
    assert (world.dest / "one.txt").read_text() == "one\n"
    assert (world.dest / "two.txt").read_text() == "two\n"
    assert os.readlink(world.dest / "link") == "sub/deeper/deep.bin"
    assert (world.dest / "sub" / "deeper" / "deep.bin").read_bytes() == b"deep\0"


def test_a_run_from_an_empty_workdir_that_deletes_nothing_keeps_the_workspace(
    gunicorn_url: str,
    worker: Worker,
    world: World,
    tmp_path: Path,
    clis: list[Cli],
    private_mounts: None,
) -> None:
    first = private_cli(gunicorn_url, world, tmp_path / "a", "sh", "-c", "echo kept > kept.txt")
    clis.append(first)
    assert first.wait() == 0, first.output()
    tree, *_ = snapshotted(first)
    assert head(world.workspace) == tree
    assert materialized(world.workspace, worker).head_tree == tree

    idle = private_cli(gunicorn_url, world, tmp_path / "b", "true")
    clis.append(idle)
    assert idle.wait() == 0, idle.output()
    assert fetched(idle)[:2] == (tree, 1)  # the head came in before the command
    assert snapshotted(idle) == (tree, 1, len(b"kept\n"), 0)  # the same tree, nothing sent
    assert head(world.workspace) == tree
    workspace = materialized(world.workspace, worker)
    assert workspace.head_tree == tree
    assert str(workspace.head_run_id) == first.run_id()  # nothing to publish: head unmoved
    assert HeartbeatRun.objects.get(pk=idle.run_id()).status == HeartbeatRun.Status.SUCCEEDED
    assert on_disk(world.dest) == tree
    assert (world.dest / "kept.txt").read_text() == "kept\n"


def test_a_cli_killed_mid_upload_is_followed_by_a_run_that_uploads_only_the_rest(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    count, size = 200, 256 * 1024
    for i in range(count):
        (workdir / f"f{i:03}.bin").write_bytes(os.urandom(size))

    # One request at a time: with several, every batch of this tree may be on the wire when
    # the first lands, and finish after the kill. The rerun uses the default pool.
    first = Cli(gunicorn_url, world, workdir, "true", flags=("--transfers", "1"))
    clis.append(first)
    first_run = first.run_id()
    # Stopped as soon as some blobs are stored, then killed: before the upload ends.
    wait_for(lambda: blob_bytes(world.workspace)[0] > 0 or first.proc.poll() is not None, "blobs")
    with_blobs = blob_bytes(world.workspace)
    os.killpg(first.proc.pid, signal.SIGSTOP)
    assert not any(re.search(SNAPSHOT, line) for line in first.out), first.output()
    kill_group(first.proc.pid)
    assert first.wait() == -signal.SIGKILL
    stored_blobs, stored_bytes = blob_bytes(world.workspace)
    assert stored_blobs >= with_blobs[0] > 0
    assert stored_bytes < count * size, "the upload ended before the kill: make it larger"

    second = Cli(gunicorn_url, world, workdir, "true")
    clis.append(second)
    second.line(rf"waiting: workspace lease held by run:{first_run}")
    expire(world.workspace)  # the dead run's 60 s TTL passes on the database clock
    assert second.wait() == 0, second.output()
    assert any(f"predecessor: run {first_run}" in line for line in second.out), second.output()
    tree, files, total_content, uploaded = snapshotted(second)
    assert (files, total_content) == (count, count * size)
    _, total = blob_bytes(world.workspace)  # the files' blobs and the root directory's
    assert 0 < uploaded <= total - stored_bytes  # only what was still missing
    assert HeartbeatRun.objects.get(pk=first_run).status == HeartbeatRun.Status.INTERRUPTED
    assert materialized(world.workspace, worker).head_tree == tree
    assert on_disk(world.dest) == tree


def test_a_worker_killed_mid_materialization_leaves_the_next_attempt_an_exact_tree(
    gunicorn_url: str, live_cas_dir: Path, world: World, tmp_path: Path, clis: list[Cli]
) -> None:
    workdir = tmp_path / "work"
    (workdir / "dir").mkdir(parents=True)
    (workdir / "dir" / "link").symlink_to("../f0000")
    for i in range(3000):
        (workdir / f"f{i:04}").write_bytes(os.urandom(2048))
    cwd = world.dest

    def files_in_cwd() -> int:
        return sum(1 for e in os.scandir(cwd) if e.is_file() and TEMP_MARK not in e.name)

    first_worker = Worker(**worker_env(live_cas_dir))
    try:
        cli = Cli(gunicorn_url, world, workdir, "true")
        clis.append(cli)
        wait_for(lambda: files_in_cwd() > 0, "materialization to begin", first_worker)
        first_worker.signal(signal.SIGSTOP)  # frozen mid-way, then killed
        written = files_in_cwd()
        first_worker.signal(signal.SIGKILL)
        first_worker.proc.wait()
    finally:
        first_worker.stop()
    assert cli.wait() == 0, cli.output()  # the run committed before its materialization
    tree, files, *_ = snapshotted(cli)
    assert files == 3000
    world.workspace.refresh_from_db()
    assert world.workspace.head_tree == tree
    assert world.workspace.cwd_tree != tree
    assert 0 < written < 3000, written
    assert on_disk(cwd) != tree  # partial

    second_worker = Worker(**worker_env(live_cas_dir))  # FAST: stalled jobs, reconciles
    try:
        workspace = materialized(world.workspace, second_worker)
    finally:
        second_worker.stop()
    assert workspace.cwd_tree == tree
    assert on_disk(cwd) == tree  # exactly the head
    assert not [p for p in cwd.rglob("*") if TEMP_MARK in p.name]
    assert os.readlink(cwd / "dir" / "link") == "../f0000"


def test_another_companys_agent_can_neither_read_nor_probe_a_blob(
    gunicorn_url: str, tmp_path: Path
) -> None:
    a, b = make_world(tmp_path, "a"), make_world(tmp_path, "b")
    assert a.workspace.company_id != b.workspace.company_id
    data = os.urandom(1000)
    name = blob_name(data)
    with Client(gunicorn_url, a.key) as alice, Client(gunicorn_url, b.key) as bob:
        assert alice.cas_put(name, data, len(data)).created
        assert alice.cas_get_bytes(name) == data
        assert alice.cas_find_missing([name]) == []
        with pytest.raises(NotFound):
            bob.cas_get_bytes(name)
        assert bob.cas_find_missing([name]) == [name]
    answer = httpx.get(
        f"{gunicorn_url}/api/cas/blobs/{name}", headers={"Authorization": f"Bearer {b.key}"}
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"
    assert data not in answer.content
    assert list(CasBlob.objects.filter(digest=name).values_list("company_id", flat=True)) == [
        a.workspace.company_id
    ]
