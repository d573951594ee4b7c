"""`paperclip-agent run` with `paperclip-agent watch` on its workdir, against a live gunicorn and
a real worker: the run's checkout at the head keeps the watcher's token, the later runs read
only what changed, and what they publish is the workdir (materialized in the workspace's cwd).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.trees import build
from tests.clients.conftest import World
from tests.clients.test_cli_live import Cli, materialized
from tests.clients.test_watch import Watcher
from tests.paperclip.worker.test_worker_processes import Worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.embedded,
    pytest.mark.xdist_group("gunicorn"),
]

SCAN = r"^paperclip-agent: (watcher: .*|full scan: .*)$"
SNAPSHOT = r"^paperclip-agent: snapshot: (sha256:[0-9a-f]{64}) "


def run(url: str, world: World, workdir: Path, script: str) -> tuple[str, str]:
    """One run of `sh -c script`: how it scanned, and the tree it published."""
    cli = Cli(url, world, workdir, "sh", "-c", script)
    assert cli.wait() == 0, cli.output()
    return cli.line(SCAN).group(1), cli.line(SNAPSHOT).group(1)


def test_runs_with_the_watcher_publish_what_the_workdir_holds(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path
) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    watcher = Watcher(workdir)
    try:
        scanned, first = run(gunicorn_url, world, workdir, "mkdir -p src/a; echo one > src/a/f")
        assert scanned == "full scan: no index yet"  # the empty head's checkout wrote none
        edit = "echo two > src/a/f; mkdir -p new/deep; echo d > new/deep/d"
        scanned, second = run(gunicorn_url, world, workdir, edit)
        assert scanned.startswith("watcher: "), scanned  # the checkout at the head kept it
        workspace = materialized(world.workspace, worker)
        assert workspace.head_tree == second != first
        assert build(read_tree(str(world.dest)))[0] == second
        assert (world.dest / "src/a/f").read_text() == "two\n"
        assert (world.dest / "new/deep/d").read_text() == "d\n"
        scanned, third = run(gunicorn_url, world, workdir, "true")
        assert scanned == "watcher: 0 directories changed (0 files read)"
        assert third == second
    finally:
        assert "watch: stopped" in watcher.stop()
