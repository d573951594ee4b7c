"""What an agent can put in a tree or a cwd never blocks a workspace for good, never makes the
worker read outside the cwd or block, and never makes `cwd_tree` claim what the disk does not
hold (docs/snapshots.md#materialization, #adopting-an-existing-cwd; found in review)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from paperclip.models import ExecutionWorkspace
from paperclip.snapshots import adopt as adopt_module
from paperclip.snapshots.adopt import CwdUnadoptable, workspace_cwd_adopt
from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.head import workspace_materialize
from paperclip.snapshots.store.reads import cas_load
from paperclip.snapshots.trees import Entry, build
from paperclip_client.workdir.checking_out import read_tree as cli_read_tree
from tests.helpers import assert_error
from tests.leases.api.test_snapshots import Runner, _stored_root
from tests.recovery.factories import make_binding
from tests.recovery.snapshots import put_blob, store_tree

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_symlink_target_no_filesystem_writes_is_refused_at_registration(
    make_agent_client: Any,
) -> None:
    """A target of 4,096 bytes stays inside the tree by its text, and Linux refuses to make
    such a link (ENAMETOOLONG): accepted, the tree failed every materialization, and every
    later head keeping the link too, for good."""
    runner = Runner(make_agent_client)
    readme = put_blob(runner.company.pk, b"hello\n")
    entries = {
        "README": Entry(name="README", type="file", mode=0o644, size=6, digest=readme),
        "l": Entry(name="l", type="symlink", target="./" * 2047 + "RE"),
    }
    error = assert_error(
        runner.register(_stored_root(runner, entries)), 400, "snapshot_tree_invalid"
    )
    assert error["details"] == {"path": "l", "reason": "symlink_target_too_long"}
    longest = {**entries, "l": Entry(name="l", type="symlink", target="./" * 2046 + "REA")}
    assert len(longest["l"].target) == 4095
    assert runner.register(_stored_root(runner, longest)).status_code == 201


def test_a_directory_above_an_unchanged_one_replaced_by_a_link_is_written_back(
    tmp_path: Path,
) -> None:
    """`a` changes (so the round walks it) while `a/b` does not; `a` replaced by a link to a
    place that has a `b` passed the check of unexpanded directories (which followed the
    link), the round made `a` again with an empty `b`, and recorded the head as held."""
    b = make_binding()
    company = b.company.pk
    one = store_tree(company, {"a/b/f": b"precious\n", "a/c": b"1\n"})
    two = store_tree(company, {"a/b/f": b"precious\n", "a/c": b"2\n"})
    cwd = tmp_path / "cwd"
    ExecutionWorkspace.objects.filter(pk=b.workspace.pk).update(cwd=str(cwd), head_tree=one)
    assert workspace_materialize(workspace_id=b.workspace.pk).status == "materialized"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "b").mkdir(parents=True)
    os.rename(cwd / "a", tmp_path / "a_moved")
    os.symlink(elsewhere, cwd / "a")
    ExecutionWorkspace.objects.filter(pk=b.workspace.pk).update(head_tree=two)
    assert workspace_materialize(workspace_id=b.workspace.pk).status == "materialized"
    assert ExecutionWorkspace.objects.get(pk=b.workspace.pk).cwd_tree == two
    assert (cwd / "a" / "b" / "f").read_bytes() == b"precious\n"
    assert build(read_tree(str(cwd)))[0] == two
    assert os.listdir(elsewhere / "b") == []  # nothing written through the link


def test_adoption_leaves_the_agent_clis_state_directory_out(tmp_path: Path) -> None:
    """A cwd that is also an agent CLI's workdir holds `.paperclip/` (its index): adopted,
    the head named it at its root, which registration refuses and every CLI refuses to check
    out, and merges kept it."""
    cwd = tmp_path / "cwd"
    (cwd / ".paperclip").mkdir(parents=True)
    (cwd / ".paperclip" / "index.json").write_text('{"tree": null}\n')
    (cwd / "README.md").write_text("hello\n")
    b = make_binding()
    ExecutionWorkspace.objects.filter(pk=b.workspace.pk).update(cwd=str(cwd))
    root = workspace_cwd_adopt(company_id=b.company.pk, workspace_id=b.workspace.pk)
    assert root is not None

    def load_many(names: list[str]) -> dict[str, bytes]:
        found = {n: cas_load(company_id=b.company.pk, digest=n, max_bytes=1 << 20) for n in names}
        return {n: data for n, data in found.items() if data is not None}

    assert sorted(cli_read_tree(root, load_many)) == ["README.md"]
    assert (cwd / ".paperclip" / "index.json").exists()


def test_adoption_never_blocks_on_a_file_swapped_for_a_fifo(tmp_path: Path) -> None:
    """The walk hashed `a.txt`; then it became a FIFO: the upload opened it by path, following
    links and blocking, and the worker hung for good."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "a.txt").write_text("hello\n")
    b = make_binding()
    ExecutionWorkspace.objects.filter(pk=b.workspace.pk).update(cwd=str(cwd))
    real = adopt_module.read_tree

    def swapped_after_the_walk(root: str, **kwargs: Any) -> Any:
        entries = real(root, **kwargs)
        os.unlink(cwd / "a.txt")
        os.mkfifo(cwd / "a.txt")
        return entries

    def hung(_signum: int, _frame: Any) -> None:
        raise TimeoutError("adoption blocked opening the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        with (
            mock.patch.object(adopt_module, "read_tree", swapped_after_the_walk),
            pytest.raises(CwdUnadoptable, match=r"a\.txt: changed while the cwd was adopted"),
        ):
            workspace_cwd_adopt(company_id=b.company.pk, workspace_id=b.workspace.pk)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree is None


def test_a_cwd_nested_deeper_than_a_tree_may_be_is_not_adopted(tmp_path: Path) -> None:
    """300 nested directories were adopted as a head that no walk accepts (`too_deep`)."""
    cwd = tmp_path / "cwd"
    deep = cwd.joinpath(*["d"] * 300)
    deep.mkdir(parents=True)
    (deep / "f").write_text("x\n")
    b = make_binding()
    ExecutionWorkspace.objects.filter(pk=b.workspace.pk).update(cwd=str(cwd))
    with pytest.raises(CwdUnadoptable, match="too_deep"):
        workspace_cwd_adopt(company_id=b.company.pk, workspace_id=b.workspace.pk)
    assert ExecutionWorkspace.objects.get(pk=b.workspace.pk).head_tree is None
