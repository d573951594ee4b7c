"""The README's Python example runs as written against a live server and worker, and its work
reaches the workspace head (it once posted no tree, so the result took the legacy copy-back,
which is off: `workspace_copyback_not_allowed`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from paperclip.models import ExecutionWorkspace, RunSnapshot
from tests.clients.conftest import World
from tests.paperclip.worker.test_worker_processes import Worker

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    text = README.read_text()
    start = text.index("Agents written in Python can use")
    found = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert found is not None
    return found.group(1)


def test_the_readme_library_example_publishes_its_work(
    gunicorn_url: str, worker: Worker, world: World, tmp_path: Path
) -> None:
    workdir, session_dir = tmp_path / "work", tmp_path / "session"
    workdir.mkdir()
    session_dir.mkdir()
    lost: list[str] = []
    names = {
        "url": gunicorn_url,
        "key": world.key,
        "ws": str(world.workspace.pk),
        "issue": str(world.issue.pk),
        "workdir": workdir,
        "session_dir": session_dir,
        "stop_everything": lost.append,
    }
    exec(compile(_example(), str(README), "exec"), names)  # noqa: S102 - the README's own code
    assert lost == []
    head = ExecutionWorkspace.objects.get(pk=world.workspace.pk).head_tree
    snapshot = RunSnapshot.objects.get(run__issue_id=world.issue.pk)
    assert head == snapshot.tree
    assert snapshot.files == 1  # build.log
