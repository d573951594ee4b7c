"""Checkout against trees another agent (or a server gone wrong) could hand the CLI: one
naming the CLI's own state directory, one that names millions of paths from a few blobs, and
a head move that must not carry a racily clean stat row into the new index; and a move of
files across hundreds of directories, which crashed the checkout (docs/snapshots.md#for-agents)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from paperclip_client import workdir
from paperclip_client.trees import Entry, TreeError, blob_name, encode_dir
from paperclip_client.workdir import checking_out
from tests.clients.test_workdir import FakeStore, check_out


def put_tree(store: FakeStore, spec: dict[str, Any]) -> str:
    """A tree in the store: {name: bytes (a file) | dict (a directory)}."""
    entries = []
    for name, value in spec.items():
        if isinstance(value, dict):
            entries.append(Entry(name=name, type="dir", mode=0o755, digest=put_tree(store, value)))
        else:
            store.blobs[blob_name(value)] = value
            entries.append(
                Entry(name=name, type="file", mode=0o644, size=len(value), digest=blob_name(value))
            )
    data = encode_dir(entries)
    store.blobs[blob_name(data)] = data
    return blob_name(data)


def test_a_tree_naming_the_state_directory_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """Checked out, it replaced the index with the tree's bytes: every later checkout was
    refused as local changes, and discarding them removed the state directory whole."""
    store = FakeStore()
    planted = put_tree(store, {"a": b"a\n", ".paperclip": {"index.json": b"junk"}})
    with pytest.raises(TreeError) as refused:
        check_out(store, tmp_path / "work", planted)
    assert (refused.value.path, refused.value.reason) == (".paperclip", "reserved_name")
    assert not (tmp_path / "work" / "a").exists()
    honest = put_tree(store, {"a": b"a\n", "sub": {".paperclip": b"a name like any other\n"}})
    check_out(store, tmp_path / "work", honest)  # only the root's is the CLI's
    assert (tmp_path / "work" / "sub" / ".paperclip").read_bytes() == b"a name like any other\n"


def test_a_tree_of_shared_directories_is_refused_past_the_entry_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 blobs named 12.6 million paths (216 s in the walk alone, unbounded)."""
    store = FakeStore()
    below = put_tree(store, {})
    for _ in range(12):
        data = encode_dir(
            [
                Entry(name="a", type="dir", mode=0o755, digest=below),
                Entry(name="b", type="dir", mode=0o755, digest=below),
            ]
        )
        store.blobs[blob_name(data)] = data
        below = blob_name(data)
    monkeypatch.setattr(checking_out, "MAX_TREE_ENTRIES", 1_000)
    with pytest.raises(TreeError) as refused:
        check_out(store, tmp_path / "work", below)
    assert refused.value.reason == "too_many_entries"


def test_a_head_move_does_not_vouch_for_a_row_that_was_racily_clean(tmp_path: Path) -> None:
    """A file rewritten in place, same size, in the old index's timestamp tick: the old index
    would have read it again; its row, carried into the index the checkout wrote, vouched
    for the old content, and the snapshot lost the change."""
    store = FakeStore()
    work = tmp_path / "work"
    first = put_tree(store, {"f": b"original", "g": b"g1"})
    second = put_tree(store, {"f": b"original", "g": b"g2"})
    check_out(store, work, first)
    index = work / ".paperclip" / "index.json"
    tick = workdir.load_index(work).files["f"][1]  # type: ignore[union-attr]
    os.utime(index, ns=(tick, tick))  # the index written in the file's tick
    with open(work / "f", "r+b") as handle:
        handle.write(b"MODIFIED")
    os.utime(work / "f", ns=(tick, tick))
    check_out(store, work, second)  # only g changes
    time.sleep(0.01)
    result = workdir.snapshot(store, work, say=lambda _: None, warn=lambda _: None)
    assert result.scan.entries["f"].digest == blob_name(b"MODIFIED")
    assert result.tree != second


def test_files_moved_across_hundreds_of_directories_are_checked_out(tmp_path: Path) -> None:
    """Each moved file is copied from where the workdir holds it, which opens that directory:
    past the directory cache's size it closed the descriptor the file was being written in,
    and the rename failed (EBADF), leaving a temporary file and the journal behind."""
    store = FakeStore()
    work = tmp_path / "work"
    base: dict[str, Any] = {f"d{i:03d}": {"f": b"old %d" % i} for i in range(300)}
    base |= {f"e{i:03d}": {"sub": {"g": b"moved %d" % i}} for i in range(300)}
    check_out(store, work, put_tree(store, base))
    moved = put_tree(store, {f"d{i:03d}": {"f": b"moved %d" % i} for i in range(300)})
    check_out(store, work, moved)
    assert (work / "d299" / "f").read_bytes() == b"moved 299"
    assert not (work / ".paperclip" / "checkout.json").exists()
    assert not [p for p in work.rglob("*") if p.name.startswith(".paperclip-tmp-")]


def test_discarding_a_removed_directory_with_subdirectories_makes_them_all_again(
    tmp_path: Path,
) -> None:
    """`a` removed by hand, the head changing `a/b/c`: with --discard-local-changes `a` was
    made again but not `a/b` (FileNotFoundError)."""
    store = FakeStore()
    work = tmp_path / "work"
    check_out(store, work, put_tree(store, {"a": {"b": {"c": b"1"}}}))
    for path in (work / "a" / "b" / "c", work / "a" / "b", work / "a"):
        path.unlink() if path.is_file() else path.rmdir()
    second = put_tree(store, {"a": {"b": {"c": b"2"}}})
    with pytest.raises(workdir.LocalChanges):
        check_out(store, work, second)
    check_out(store, work, second, discard=True)
    assert (work / "a" / "b" / "c").read_bytes() == b"2"


def test_setuid_setgid_and_sticky_bits_in_a_tree_are_not_written(tmp_path: Path) -> None:
    """Another agent's tree (through the head) asked for a world-writable setuid file, which
    the CLI, often root, wrote as such. The bits are dropped, and the file so written is not
    local work when the head changes it next."""
    store = FakeStore()
    work = tmp_path / "work"
    tool = b"#!/bin/sh\n"
    data = encode_dir(
        [Entry(name="tool", type="file", mode=0o6777, size=len(tool), digest=blob_name(tool))]
    )
    store.blobs[blob_name(tool)], store.blobs[blob_name(data)] = tool, data
    sticky = encode_dir([Entry(name="shared", type="dir", mode=0o1777, digest=blob_name(data))])
    store.blobs[blob_name(sticky)] = sticky
    check_out(store, work, blob_name(sticky))
    assert (work / "shared" / "tool").stat().st_mode & 0o7777 == 0o777
    assert (work / "shared").stat().st_mode & 0o7777 == 0o777
    changed = put_tree(store, {"shared": {"tool": b"#!/bin/sh\nexit 0\n"}})
    check_out(store, work, changed)  # not refused as local changes
    assert (work / "shared" / "tool").read_bytes() == b"#!/bin/sh\nexit 0\n"
