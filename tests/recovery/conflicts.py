"""A held run and the runs that commit after its hold, for the tests of conflict resolutions
(docs/snapshots.md#conflicts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rest_framework.test import APIClient

from paperclip.models import ExecutionWorkspace
from paperclip.snapshots.store.reads import cas_load
from paperclip.snapshots.trees import walk
from recovery.models import IssueRecoveryAction
from recovery.services import Acquired, run_finalize
from tests.recovery.factories import Binding, make_binding
from tests.recovery.snapshots import Files, snapshot_result, store_tree

BASE: Files = {"README.md": b"hello\n", "src/main.py": b"print('hi')\n"}
NOTE = "the reviewer approved this run's README"


def in_workspace(first: Binding, files: Files, *, base: str | None) -> Binding:
    """Another agent's run on another issue of the same workspace, with an accepted result
    naming a snapshot of `files` started from `base`."""
    other = make_binding(company=first.company)
    other.run.execution_workspace = first.workspace
    other.run.save(update_fields=["execution_workspace"])
    other.issue.execution_workspace = first.workspace
    other.issue.save(update_fields=["execution_workspace"])
    assert other.result is not None
    snapshot_result(other.run, other.result, store_tree(first.company.pk, files), base)
    return other


def finalize(b: Binding) -> Any:
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired), outcome
    return outcome.value


def head_of(b: Binding) -> str | None:
    head: str | None = ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree
    return head


def files_of(b: Binding, tree: str | None) -> dict[str, bytes]:
    assert tree is not None
    walked = walk(tree, lambda n: cas_load(company_id=b.company.pk, digest=n, max_bytes=1 << 26))
    files: dict[str, bytes] = {}
    for path, entry in walked.entries.items():
        if entry.type == "file":
            assert entry.digest is not None
            data = cas_load(company_id=b.company.pk, digest=entry.digest, max_bytes=1 << 26)
            assert data is not None
            files[path] = data
    return files


def held_then_two_commits(tmp_path: Path) -> tuple[Binding, str]:
    """Run A (README changed, a.txt added, src/main.py removed) is held: run X changed README
    first. Then runs B (b.txt) and C (c.txt, notes/guide.md) commit after the hold. Returns A's
    binding and its tree."""
    first = make_binding()
    base = store_tree(first.company.pk, BASE)
    first.workspace.cwd = str(tmp_path / "cwd")
    first.workspace.head_tree = base
    first.workspace.save(update_fields=["cwd", "head_tree"])
    ours: Files = {"README.md": b"A's README\n", "a.txt": b"a\n"}
    a_tree = store_tree(first.company.pk, ours)
    assert first.result is not None
    snapshot_result(first.run, first.result, a_tree, base)
    x = in_workspace(first, {**BASE, "README.md": b"X's README\n"}, base=base)
    assert finalize(x).status == "committed"
    assert finalize(first).status == "held"
    after_x = head_of(first)
    b_run = in_workspace(
        first, {**BASE, "README.md": b"X's README\n", "b.txt": b"b\n"}, base=after_x
    )
    assert finalize(b_run).status == "committed"
    c_files: Files = {
        **BASE,
        "README.md": b"X's README\n",
        "b.txt": b"b\n",
        "c.txt": b"c\n",
        "notes/guide.md": b"guide\n",
    }
    c_run = in_workspace(first, c_files, base=head_of(first))
    assert finalize(c_run).status == "committed"
    return first, a_tree


def live_hold(b: Binding) -> IssueRecoveryAction:
    return IssueRecoveryAction.objects.get(
        cause="workspace_head_conflict", evidence__runId=str(b.run.pk), status="active"
    )


def resolve(board: APIClient, b: Binding, resolution: str, **extra: Any) -> Any:
    hold = live_hold(b)
    return board.post(
        f"/api/issues/{b.issue.pk}/recovery-actions/resolve-workspace-conflict",
        {
            "action_id": str(hold.pk),
            "run_id": str(b.run.pk),
            "resolution": resolution,
            "note": NOTE,
            **extra,
        },
        format="json",
    )
