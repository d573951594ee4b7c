"""Two web nodes and a worker that share only PostgreSQL and a bucket (docs/snapshots.md,
object storage): every snapshot flow through real processes, and a blob corrupted in the
bucket never served as itself.

Each web node (a gunicorn) and the worker has a data directory of its own, so nothing of a
blob can pass through a shared disk; the agents' workdirs are private tmpfs mounts (as in
test_cli_snapshots_hosts.py). The bucket is a real `rclone serve s3`.

- An agent on node 1 uploads and publishes; the worker materializes the head into the `cwd`.
- An agent on node 2 checks that head out from an empty workdir (blobs from the bucket),
  changes it and publishes; the worker materializes; node 2 lists the history and the diff.
- A blob damaged in the bucket behind the plane's back (same size, other bytes): a later run
  that names it without uploading it (the store says it has it) publishes, and the worker's
  materialization refuses it (the `cwd` never holds the damaged bytes, the failure is
  recorded); a checkout of it fails naming the blob.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from paperclip.models import ExecutionWorkspace
from paperclip_client import Client
from tests.chaos.run import Config, GunicornServer
from tests.clients.conftest import World
from tests.clients.test_cli_live import Cli, materialized
from tests.clients.test_cli_snapshots_hosts import (
    fetched,
    head,
    private_cli,
    private_mounts,  # noqa: F401 - a fixture
    snapshotted,
)
from tests.paperclip.worker.test_worker_processes import Worker, wait_for
from tests.support.processes import child_env
from tests.support.s3 import S3Server

# Not in the "gunicorn" xdist group: it starts servers of its own, not the session's one.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def s3_env(server: S3Server, prefix: str, data_dir: Path, redirect: str) -> dict[str, str]:
    data_dir.mkdir(parents=True)
    return {
        "PAPERCLIP_DATA_DIR": str(data_dir),
        "PAPERCLIP_CAS_DIR": str(data_dir / "cas"),  # set, and never used by the s3 backend
        "PAPERCLIP_CAS_BACKEND": "s3",
        "PAPERCLIP_CAS_S3_BUCKET": server.bucket,
        "PAPERCLIP_CAS_S3_PREFIX": prefix,
        "PAPERCLIP_CAS_S3_ENDPOINT_URL": server.endpoint,
        "AWS_ACCESS_KEY_ID": server.access_key,
        "AWS_SECRET_ACCESS_KEY": server.secret_key,
        "AWS_REGION": server.region,
        "PAPERCLIP_CAS_S3_REDIRECT": redirect,
    }


class Plane:
    def __init__(self, server: S3Server, root: Path, redirect: str) -> None:
        self.s3 = server
        self.prefix = f"n{uuid.uuid4().hex[:10]}/cas/"
        self.nodes: list[GunicornServer] = []
        for name in ("node-1", "node-2"):
            env = child_env(
                DJANGO_DEBUG="false",
                DJANGO_ALLOWED_HOSTS="127.0.0.1,localhost",
                DJANGO_LOG_LEVEL="ERROR",
                **s3_env(server, self.prefix, root / name, redirect),
            )
            (root / f"{name}-run").mkdir()
            node = GunicornServer(
                Config(gunicorn_workers=1, gunicorn_threads=4), env, root / f"{name}-run"
            )
            node.start()
            self.nodes.append(node)
        self.worker = Worker(**s3_env(server, self.prefix, root / "worker", redirect))

    def object(self, company_id: object, digest: str) -> Path:
        hexdigest = digest.removeprefix("sha256:")
        key = f"{self.prefix}{company_id}/{hexdigest[:2]}/{hexdigest}"
        return self.s3.object_path(key)

    def stop(self) -> None:
        self.worker.stop()
        for node in self.nodes:
            node.stop()


# "true", as shipped: blob reads of at least PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES answered with a
# redirect to the bucket; "false": every byte passes through the web nodes.
@pytest.fixture(params=["true", "false"])
def plane(s3_server: S3Server, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Plane]:
    running = Plane(s3_server, tmp_path / "plane", request.param)
    try:
        yield running
    finally:
        running.stop()


def blob_name(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.usefixtures("private_mounts")
def test_two_nodes_and_a_worker_share_only_the_database_and_the_bucket(
    plane: Plane, world: World, tmp_path: Path
) -> None:
    node1, node2 = (node.base_url for node in plane.nodes)
    clis: list[Cli] = []
    try:
        first = private_cli(
            node1, world, tmp_path / "a", "sh", "-c", "echo one > one.txt; mkdir d; echo x > d/x"
        )
        clis.append(first)
        assert first.wait() == 0, first.output()
        tree1, files1, _bytes1, _up1 = snapshotted(first)
        assert files1 == 2
        workspace = materialized(world.workspace, plane.worker)
        assert workspace.cwd_tree == tree1
        assert (world.dest / "one.txt").read_text() == "one\n"
        assert plane.object(workspace.company_id, blob_name(b"one\n")).is_file()  # in the bucket

        second = private_cli(
            node2, world, tmp_path / "b", "sh", "-c",
            'test "$(cat one.txt)" = one && test "$(cat d/x)" = x && echo two > two.txt',
        )  # fmt: skip
        clis.append(second)
        assert second.wait() == 0, second.output()  # node 2 served node 1's blobs
        assert fetched(second)[:2] == (tree1, 2)
        tree2 = snapshotted(second)[0]
        assert head(world.workspace) == tree2
        assert materialized(world.workspace, plane.worker).cwd_tree == tree2
        assert (world.dest / "two.txt").read_text() == "two\n"

        with Client(node2, world.key) as client:
            moves = client.workspace_history(str(world.workspace.pk))["results"]
            assert [move["tree"] for move in moves] == [tree2, tree1]
            diff = client.workspace_diff(str(world.workspace.pk), tree1, tree2)
            assert [(c["path"], c["change"]) for c in diff["changes"]] == [("two.txt", "added")]

            # A blob in the store whose object is damaged behind the plane's back.
            good = b"four\n"
            client.cas_put(blob_name(good), good, len(good))
        damaged = plane.object(world.workspace.company_id, blob_name(good))
        damaged.write_bytes(b"FOUR\n")  # same size, other bytes

        third = private_cli(node1, world, tmp_path / "c", "sh", "-c", "printf 'four\\n' > four.txt")
        clis.append(third)
        assert third.wait() == 0, third.output()
        tree3, _files3, _bytes3, uploaded3 = snapshotted(third)
        assert uploaded3 < len(good) + 1000  # four.txt was not uploaded: the store "has" it
        assert head(world.workspace) == tree3

        def refused() -> bool:
            workspace = ExecutionWorkspace.objects.get(pk=world.workspace.pk)
            return workspace.materialize_error is not None

        wait_for(refused, "the materialization refusing the damaged blob", plane.worker)
        workspace = ExecutionWorkspace.objects.get(pk=world.workspace.pk)
        assert blob_name(good) in (workspace.materialize_error or "")
        assert workspace.cwd_tree != tree3
        assert not (world.dest / "four.txt").exists()  # never the damaged bytes, at its path

        fourth = private_cli(node2, world, tmp_path / "d", "true")
        clis.append(fourth)
        assert fourth.wait() != 0  # its checkout meets the damaged blob
        assert blob_name(good) in fourth.output()
    finally:
        for cli in clis:
            if cli.proc.poll() is None:
                cli.kill()
