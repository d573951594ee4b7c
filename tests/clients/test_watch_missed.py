"""Changes a watched snapshot once missed (each test failed before its fix), each checked
against a full scan of the same disk state: edits in a directory the watcher could not watch
for a while, a tracked path the ignore rules match in a directory read whole again, and a
write through a new hard link of a tracked file whose new name is left out of the tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from paperclip_client import trees, workdir
from tests.clients.test_watch import (
    CLIENT_PATH,
    FakeStore,
    Watcher,
    full_tree,
    make,
    settled,
    take,
    watch,
    watchers,
)

__all__ = ["watchers"]  # the fixture, used by name

# The watcher with inotify_add_watch failing (ENOSPC, `fs.inotify.max_user_watches` reached)
# for the directory `d1` while the file named by PROBE_BLOCK exists: watches used up by
# other programs, later freed.
BLOCKING_ENTRY = """
import errno, os, sys
sys.argv[0] = 'paperclip-agent'
from paperclip_client.workdir import watching
real = watching.Inotify.add
def add(self, path, mask):
    if path.endswith('/d1') and os.path.exists(os.environ['PROBE_BLOCK']):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return real(self, path, mask)
watching.Inotify.add = add
from paperclip_client.cli import entry
entry()
"""


class BlockingWatcher(Watcher):
    def __init__(self, root: Path, block: Path) -> None:
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BLOCKING_ENTRY, "watch", "--workdir", str(root)],
            env={**os.environ, "PYTHONPATH": CLIENT_PATH, "PROBE_BLOCK": str(block)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline()
        while "directories watched" not in self.first:
            assert self.first, "the watcher did not start"
            self.first = self.proc.stdout.readline()


def test_edits_in_a_directory_that_was_unwatchable_are_in_the_next_snapshot(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """A directory that cannot be watched (max_user_watches) makes every answer `full`; the
    token of such a `full` answer was vouched for once a later walk succeeded, although the
    directory had no watch between that token and the walk: edits made there were missed."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {f"d{i}/f": f"content {i}" for i in range(3)})
    block = tmp_path / "block"
    block.write_text("")
    w = BlockingWatcher(root, block)
    watchers.append(w)
    _first, line = take(store, root)
    assert line.startswith("full scan: "), line  # no index yet
    _second, line = take(store, root)
    assert "cannot be watched" in line, line  # still blind: full again
    (root / "d1/f").write_text("edited while d1 had no watch")  # no event: d1 unwatched
    block.unlink()  # watches freed: the next walk succeeds
    result, line = take(store, root)
    assert b"edited while d1 had no watch" in store.blobs.values(), line
    assert result.tree == full_tree(root), line


def test_a_tracked_path_the_ignore_rules_match_in_a_directory_moved_back_in_is_kept(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """`d/a.log` is tracked (in the last tree) and `*.log` is ignored. `d` moved away and back
    (as a tool that rebuilds a directory and renames it into place does) is read whole by the
    partial scan with the plain rules: `d/a.log` was left out, so the snapshot published its
    deletion (and lost its edit), where the full scan keeps the tracked path."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/a.log": "first", "d/f": "f", "e/g": "g"})
    watch(watchers, root)
    take(store, root)
    (root / ".paperclipignore").write_text("*.log\n")
    result, line = take(store, root)
    assert line == "full scan: the ignore rules changed"
    assert "d/a.log" in result.scan.entries
    os.rename(root / "d", root / "d.new")
    (root / "d.new/a.log").write_text("second, tracked")
    os.rename(root / "d.new", root / "d")
    # The reference: the full scan of the same disk state with the same index.
    full = workdir.scan(
        root, max_blob_bytes=64 * 1024 * 1024, index=workdir.load_index(root), warn=lambda _: None
    )
    assert "d/a.log" in full.entries
    result, line = take(store, root)
    entries = workdir.read_tree(result.tree, lambda names: {n: store.blobs[n] for n in names})
    assert "d/a.log" in entries, f"{line}: {sorted(entries)}"
    assert entries["d/a.log"].digest == trees.blob_name(b"second, tracked"), line
    assert result.tree == full.tree, line


def test_a_write_through_a_hard_link_in_an_ignored_directory_is_in_the_next_snapshot(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """`ln d/f build/f` with `build/` ignored (a build tool linking sources into its output
    directory, `cp -al src build/`): the new name is never read by a partial scan (its
    directory is not in the tree), so the new hard link is never noticed, and a write in place
    through `build/f` is an event in `build` alone. `d/f` changed on disk, and the snapshot
    kept its old content, where a full scan (its stat changed) reads it again."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "original", "e/g": "g", "build/out": "o", ".paperclipignore": "build/\n"})
    watch(watchers, root)
    settled(store, root)
    os.link(root / "d/f", root / "build/f")
    with open(root / "build/f", "r+b") as handle:  # written in place, through the other name
        handle.write(b"EDITED!!")
    assert (root / "d/f").read_bytes() == b"EDITED!!"
    result, line = take(store, root)
    assert b"EDITED!!" in store.blobs.values(), line
    assert result.tree == full_tree(root), line


def test_a_write_through_an_ignored_hard_link_in_the_same_directory_is_in_the_next_snapshot(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """As above with the new name ignored by a file rule (`ln d/f d/f.log`, `*.log`): every
    event names `d/f.log`, which the partial scan leaves out without looking at its stat, so
    `d/f` (same inode) is never read again."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "original", "e/g": "g", ".paperclipignore": "*.log\n"})
    watch(watchers, root)
    settled(store, root)
    os.link(root / "d/f", root / "d/f.log")
    _result, line = take(store, root)  # the link alone: nothing changed yet
    with open(root / "d/f.log", "r+b") as handle:
        handle.write(b"EDITED!!")
    result, line = take(store, root)
    assert b"EDITED!!" in store.blobs.values(), line
    assert result.tree == full_tree(root), line


def test_hard_links_among_files_left_out_keep_the_partial_scan(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """A package manager's store linked into an ignored directory (pnpm's `node_modules`):
    files with other hard links, none of them tracked, need no full scan."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "tracked", ".paperclipignore": "node_modules/\n"})
    shared = tmp_path / "pnpm-store"
    shared.mkdir()
    for i in range(3):
        (shared / f"p{i}").write_text(f"package {i}")
    watch(watchers, root)
    settled(store, root)
    (root / "node_modules" / "pkg").mkdir(parents=True)
    for i in range(3):
        os.link(shared / f"p{i}", root / "node_modules" / "pkg" / f"p{i}")
    (root / "d/f").write_text("tracked, edited")
    result, line = take(store, root)
    assert line.startswith("watcher: "), line
    assert result.tree == full_tree(root)


def test_a_directory_built_again_orders_its_names_as_the_full_scan_does(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """Names sorted by their UTF-8 bytes, across one-, two-, three- and four-byte
    characters: the partial scan's order is the full scan's."""
    store, root = FakeStore(), tmp_path / "w"
    names = ["Z", "a", "é", "z", "\u00ff", "\u0100", "\uffee", "\U0001f600", "ä", "~"]
    make(root, {f"d/{name}": name for name in names})
    watch(watchers, root)
    take(store, root)
    (root / "d" / "é").write_text("edited")
    (root / "d" / "\U0001f601").write_text("new")
    result, line = take(store, root)
    assert line.startswith("watcher: "), line
    assert result.tree == full_tree(root)


def test_a_hard_link_in_a_new_directory_whose_name_is_not_utf8_is_noticed(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """A directory left out of the tree because its name is not UTF-8 is as much outside the
    tree as an ignored one: a tracked file's new hard link made in it and written through
    before its watch (the watcher paused, as when it is slow to read) is found there too."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "original", "e/g": "g"})
    w = watch(watchers, root)
    settled(store, root)
    w.pause()  # the directory and its link are made before the watcher reads the events
    odd = os.path.join(os.fsencode(root), b"\xff")
    os.mkdir(odd)
    os.link(root / "d/f", os.path.join(odd, b"f"))
    with open(os.path.join(odd, b"f"), "r+b") as handle:  # written through the hidden name
        handle.write(b"EDITED!!")
    w.resume()
    assert (root / "d/f").read_bytes() == b"EDITED!!"
    result, line = take(store, root)
    assert b"EDITED!!" in store.blobs.values(), line
    assert result.tree == full_tree(root), line


def test_a_hard_link_in_a_new_ignored_directory_made_before_its_watch_is_noticed(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """A new ignored directory, filled before the watcher reads its events: looked into."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "original", "e/g": "g", ".paperclipignore": "build/\n"})
    w = watch(watchers, root)
    settled(store, root)
    w.pause()
    (root / "build").mkdir()
    os.link(root / "d/f", root / "build/f")
    with open(root / "build/f", "r+b") as handle:
        handle.write(b"EDITED!!")
    w.resume()
    result, line = take(store, root)
    assert b"EDITED!!" in store.blobs.values(), line
    assert result.tree == full_tree(root), line


def test_a_write_through_a_hard_link_whose_name_is_not_utf8_is_in_the_next_snapshot(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """`ln d/f d/$'\\xff'`: the new name is left out of the tree (not UTF-8) by
    `_name_wanted`, before `_collect_entry` could put it into `unread`, so its stat is
    never looked at (unlike an ignored name, `ln d/f d/f.log`): a write through it is an
    event of that name alone, and `d/f` is never read again."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "original", "e/g": "g"})
    watch(watchers, root)
    settled(store, root)
    odd = os.path.join(os.fsencode(root / "d"), b"\xff")
    os.link(root / "d/f", odd)
    _result, line = take(store, root)  # the link alone: nothing changed yet
    with open(odd, "r+b") as handle:  # written in place, through the left-out name
        handle.write(b"EDITED!!")
    assert (root / "d/f").read_bytes() == b"EDITED!!"
    result, line = take(store, root)
    assert b"EDITED!!" in store.blobs.values(), line
    assert result.tree == full_tree(root), line
