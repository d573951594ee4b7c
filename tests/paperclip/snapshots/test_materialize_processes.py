"""Materializing a large change in child processes (paperclip/snapshots/processes.py): the same
tree as one process writes, the children's work counted, a child that fails or is killed
leaves the caller to finish exactly the tree, and a caller whose check fails (its lock lost)
leaves no child writing behind it. Real spawned processes, real files."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.materialize import Materializer, MaterializeReport, materialize
from paperclip.snapshots.processes import Processes
from paperclip.snapshots.trees import Entry
from tests.paperclip.snapshots.test_materialize import Store, held_apart, make_tree


class FileStore(Store):
    """`Store` whose blobs are also plain files, as the filesystem backend's are."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        root.mkdir()

    def file(self, name: str) -> str | None:
        path = self.root / name.removeprefix("sha256:")
        if not path.exists():
            path.write_bytes(self.blobs[name])
        return str(path)


def layout(tops: int = 6, per: int = 5, tag: bytes = b"") -> dict[str, bytes]:
    return {
        f"top{t}/sub{s}/f{f}": b"%d %d %d %s" % (t, s, f, tag)
        for t in range(tops)
        for s in range(2)
        for f in range(per)
    }


def materialized(
    destination: Path,
    target: dict[str, Entry],
    previous: dict[str, Entry] | None,
    store: FileStore,
    *,
    blob_file: Callable[[str], str | None] | None = None,
    check: Callable[[], None] = lambda: None,
    apart: bool = False,
) -> tuple[MaterializeReport, list[set[str]]]:
    split = Processes(count=2, blob_file=blob_file or store.file, min_files=1)
    delegated: list[set[str]] = []

    def spy(work: Materializer, where: str) -> set[str]:
        delegated.append(split(work, where))
        return delegated[-1]

    alike: dict[str, list[dict[str, Any]]] = {}
    if apart and previous is not None:
        target, previous, alike = held_apart(target, previous)
    report = materialize(
        destination=str(destination),
        target=target,
        previous=previous,
        alike=alike,
        open_blob=store.open,
        check=check,
        check_every=0.01,
        split=spy,
    )
    return report, delegated


def test_children_write_the_tree_one_process_would(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    spec = layout() | {"top-file": b"at the root", "link": ("link", "top0/sub0/f0")}
    target = make_tree(spec, store)
    report, delegated = materialized(tmp_path / "dest", target, None, store)
    # Each top-level directory (10 files) is more than a quarter of a child's share (61 / 8):
    # split into its two subdirectories, which the children write.
    assert delegated == [{f"top{t}/sub{s}" for t in range(6) for s in range(2)}]
    assert read_tree(str(tmp_path / "dest")) == target
    assert report.written == 61  # the children's 60 files counted with the caller's one
    assert report.directories == 18
    assert not store.opened or store.opened == [target["top-file"].digest]


def test_a_later_change_with_removals_in_children(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    before = make_tree(layout() | {"top0/gone": b"x", "top9/only/here": b"y"}, store)
    materialized(tmp_path / "dest", before, None, store)
    (tmp_path / "dest" / "top1" / "stray").write_bytes(b"not in any tree")
    after = make_tree(layout(tag=b"v2") | {"top2/new/deep": b"z"}, store)
    report, delegated = materialized(tmp_path / "dest", after, before, store)
    assert {path.partition("/")[0] for path in delegated[0]} == {f"top{t}" for t in range(6)}
    assert read_tree(str(tmp_path / "dest")) == after
    assert report.written == 61
    assert report.removed >= 4  # top0/gone, top1/stray, top9 and what it held


@pytest.mark.parametrize("mode", [0o755, 0o500], ids=["plain", "read-only-dir"])
def test_one_large_directory_is_split_below_it(tmp_path: Path, mode: int) -> None:
    """A workspace with one top-level directory (a repository's `src/`, say): the children
    write its subdirectories; the directories above them are made first and get their mode,
    and their own files are written, by the caller."""
    store = FileStore(tmp_path / "store")
    spec: dict[str, object] = {
        f"src/pkg{p}/mod{m}/f{f}.py": b"%d %d %d" % (p, m, f)
        for p in range(3)
        for m in range(4)
        for f in range(10)
    }
    spec |= {"src/README": b"top", "src/pkg1/__init__.py": b"", "src/pkg1": ("dir", mode)}
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "src").write_bytes(b"a file where the tree has a directory")
    target = make_tree(spec, store)
    report, delegated = materialized(tmp_path / "dest", target, None, store)
    assert delegated[0]
    assert all(path.count("/") >= 1 for path in delegated[0])  # below src/
    assert read_tree(str(tmp_path / "dest")) == target
    assert report.written == 122
    assert report.removed == 1  # the file that stood where src/ goes
    assert report.directories == 1 + 3 + 12


def test_a_child_that_fails_leaves_the_caller_to_write_everything(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = FileStore(tmp_path / "store")
    target = make_tree(layout(), store)
    lost = target["top3/sub1/f2"].digest

    def blob_file(name: str) -> str | None:
        path = store.file(name)
        return str(tmp_path / "nowhere") if name == lost else path

    with caplog.at_level(logging.WARNING, logger="paperclip.snapshots.processes"):
        report, delegated = materialized(
            tmp_path / "dest", target, None, store, blob_file=blob_file
        )
    assert delegated == [set()]
    assert "FileNotFoundError" in caplog.text
    assert read_tree(str(tmp_path / "dest")) == target
    assert report.written >= 1


def test_a_child_killed_part_way_leaves_the_caller_to_finish(tmp_path: Path) -> None:
    """One blob is a FIFO no one writes: the child that opens it blocks until killed."""
    store = FileStore(tmp_path / "store")
    target = make_tree(layout(), store)
    stuck = target["top0/sub0/f0"].digest
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    killed: list[int] = []

    def kill_the_stuck_child() -> None:
        """The other child writes its 30 small files in well under 2 s; the stuck one blocks
        until it is killed."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not killed:
            time.sleep(2)
            for child in multiprocessing.active_children():
                if child.pid:
                    os.kill(child.pid, signal.SIGKILL)
                    killed.append(child.pid)

    killer = threading.Thread(target=kill_the_stuck_child)
    killer.start()
    try:
        _, delegated = materialized(
            tmp_path / "dest",
            target,
            None,
            store,
            blob_file=lambda name: str(fifo) if name == stuck else store.file(name),
        )
    finally:
        killer.join()
    assert killed
    assert delegated == [set()]
    assert read_tree(str(tmp_path / "dest")) == target


def test_a_failed_check_kills_the_children_before_it_propagates(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    target = make_tree(layout(tops=8, per=200), store)
    calls: list[float] = []

    class LockLost(Exception):
        pass

    def check() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:  # before the first change, then between the children's work
            raise LockLost

    with pytest.raises(LockLost):
        materialized(tmp_path / "dest", target, None, store, check=check)
    assert multiprocessing.active_children() == []
    written = sorted(p for p in (tmp_path / "dest").rglob("*"))
    time.sleep(0.3)
    assert sorted(p for p in (tmp_path / "dest").rglob("*")) == written  # nothing writes on


def test_a_small_change_stays_in_one_process(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    target = make_tree(layout(), store)
    split = Processes(count=2, blob_file=store.file, min_files=1000)
    materialize(
        destination=str(tmp_path / "dest"),
        target=target,
        previous=None,
        open_blob=store.open,
        split=split,
    )
    assert len(store.opened) == 60  # every blob read here, none by a child
    assert read_tree(str(tmp_path / "dest")) == target


def test_files_the_previous_tree_held_alike_do_not_count_toward_the_children(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later change of a few files in large directories is a small change: the files of
    those directories that did not change are only compared with the disk, so they neither
    count toward `min_files` nor make this process work out how to deal the directories."""
    from paperclip.snapshots import processes

    store = FileStore(tmp_path / "store")
    before = make_tree(layout(per=20), store)
    destination = tmp_path / "dest"
    materialize(destination=str(destination), target=before, previous=None, open_blob=store.open)
    changed = layout(per=20)
    for top in range(6):  # one file in each top-level directory: 6 to write of 240
        changed[f"top{top}/sub0/f0"] = b"changed %d" % top
    after = make_tree(changed, store)
    dealt: list[object] = []
    split_dirs = processes._split
    monkeypatch.setattr(
        processes,
        "_split",
        lambda *a: dealt.append(a) or split_dirs(*a),  # type: ignore[func-returns-value]
    )
    split = Processes(count=2, blob_file=store.file, min_files=100)
    report = materialize(
        destination=str(destination),
        target=after,
        previous=before,
        open_blob=store.open,
        split=split,
    )
    assert (report.written, dealt) == (6, [])
    assert read_tree(str(destination)) == after


@pytest.mark.parametrize("disturbed", [False, True], ids=["as-written", "changed-by-hand"])
def test_children_compare_the_files_held_alike(tmp_path: Path, disturbed: bool) -> None:
    """The files both trees hold alike go to the child writing their directory, which
    compares them with the disk by `lstat`. One changed by hand needs a blob the child was
    not given (only the change's are): the child fails and the caller writes the tree."""
    store = FileStore(tmp_path / "store")
    old = make_tree(layout(), store)
    materialized(tmp_path / "dest", old, None, store)
    new_spec = layout() | {
        f"top{t}/sub{s}/f0": b"v2 %d %d" % (t, s) for t in range(6) for s in range(2)
    }
    new = make_tree(new_spec, store)
    if disturbed:
        (tmp_path / "dest" / "top0" / "sub0" / "f3").unlink()
        (tmp_path / "dest" / "top1" / "sub1" / "f2").write_bytes(b"resized by hand")
    report, delegated = materialized(tmp_path / "dest", new, old, store, apart=True)
    assert read_tree(str(tmp_path / "dest")) == new
    assert report.written == 12 + 2 * disturbed
    if disturbed:
        assert delegated == [set()]
    else:
        assert delegated == [{f"top{t}/sub{s}" for t in range(6) for s in range(2)}]
        assert report.unchanged >= 48  # the four files held alike in each of 12 directories
