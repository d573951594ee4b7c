"""The index's second version (issue #42): a header line that says what the stat cache holds
(`count`, `bytes`, `newest_ns`), then the rows, parsed only when they are needed. A run at the
head and a watched run that changed nothing answer from the header; a racily clean row is
still read again; rows that cannot be parsed only mean a full scan; and an index written by
the first version is still read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from paperclip_client import workdir
from paperclip_client.workdir import Rows, watch_state
from paperclip_client.workdir import index as index_module
from tests.clients.test_watch import Watcher, full_tree, settled, take, tree_of, watch, watchers
from tests.clients.test_workdir import SERVER, WORKSPACE, FakeStore, check_out, make, old
from tests.clients.test_workdir import take as take_plain

__all__ = ["watchers"]  # the fixture, used by name


def index_file(root: Path) -> Path:
    return root / ".paperclip" / workdir.INDEX


def header(root: Path) -> dict[str, object]:
    line = index_file(root).read_bytes().split(b"\n", 1)[0]
    found = json.loads(line)
    assert isinstance(found, dict)
    return found


def rewrite(root: Path, data: bytes) -> None:
    """The index file's bytes replaced, its mtime kept (so that nothing becomes racy)."""
    info = os.stat(index_file(root))
    index_file(root).write_bytes(data)
    os.utime(index_file(root), ns=(info.st_atime_ns, info.st_mtime_ns))


def as_version_1(root: Path) -> None:
    """The index rewritten as the client wrote it before version 2: one JSON object."""
    index = workdir.load_index(root)
    assert index is not None
    body = {
        "version": 1,
        "id": index.id,
        "tree": index.tree,
        "server": index.server,
        "workspace": index.workspace,
        "files": index.files,
    }
    rewrite(root, json.dumps(body, separators=(",", ":")).encode())


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every parse of an index's rows (`Rows.get` on rows not yet parsed), counted."""
    counted: list[int] = []
    real = Rows.get

    def get(self: Rows) -> dict[str, workdir.Stat]:
        if not self.parsed:
            counted.append(1)
        return real(self)

    monkeypatch.setattr(Rows, "get", get)
    monkeypatch.setattr(index_module, "_last_index", None)
    return counted


# --- the format ------------------------------------------------------------------------------


def test_the_header_summarizes_the_rows_and_the_rows_wait(
    tmp_path: Path, parses: list[int]
) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one", "c/d": "three"})
    first = take_plain(FakeStore(), root)
    data = index_file(root).read_bytes()
    head, rest = data.split(b"\n", 1)
    rows = json.loads(rest)
    assert json.loads(head) == {
        "version": 2,
        "id": json.loads(head)["id"],
        "tree": first.tree,
        "server": SERVER,
        "workspace": WORKSPACE,
        "count": 2,
        "bytes": 8,
        "newest_ns": max(row[1] for row in rows.values()),
        "racy_ns": json.loads(head)["racy_ns"],  # when the scan started
    }
    assert json.loads(head)["racy_ns"] <= index_file(root).stat().st_mtime_ns
    parses.clear()
    index = workdir.load_index(root)
    assert index is not None
    assert (index.count, index.bytes, index.tree) == (2, 8, first.tree)
    assert not index.rows.parsed
    assert parses == []
    assert set(index.files) == {"a", "c/d"}
    assert parses == [1]


@pytest.mark.parametrize(
    ("field", "value"),
    [("count", "2"), ("bytes", None), ("newest_ns", 1.5), ("count", True), ("tree", 3),
     ("server", None), ("id", 7), ("count", -1), ("version", 3)],
)  # fmt: skip
def test_a_header_field_of_the_wrong_type_makes_the_index_unreadable(
    tmp_path: Path, field: str, value: object
) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one"})
    take_plain(FakeStore(), root)
    head, rest = index_file(root).read_bytes().split(b"\n", 1)
    rewrite(root, json.dumps({**json.loads(head), field: value}).encode() + b"\n" + rest)
    assert workdir.load_index(root) is None


@pytest.mark.parametrize(
    "rows",
    [b'{"a": [3, 1', b"[]", b'{"a": [3, 1, 420, 5]}', b'{"a": "x"}', b"", b"{}"],
)
def test_rows_that_cannot_be_read_are_an_empty_stat_cache(tmp_path: Path, rows: bytes) -> None:
    """Truncated, not rows, or not the header's rows (`{}` while the header counts one)."""
    root = tmp_path / "w"
    make(root, {"a": "one"})
    first = take_plain(FakeStore(), root)
    head = index_file(root).read_bytes().split(b"\n", 1)[0]
    rewrite(root, head + b"\n" + rows)
    index = workdir.load_index(root)
    assert index is not None
    assert (index.tree, index.count) == (first.tree, 1)
    assert (index.files, index.rows.unreadable) == ({}, True)
    assert workdir.scan(root, max_blob_bytes=10**6, index=index, warn=print).hashed == 1


def test_racy_is_exactly_some_rows_mtime_not_older_than_the_index(tmp_path: Path) -> None:
    root = tmp_path / "w"
    make(root, {"a": "one", "b": "two"})
    take_plain(FakeStore(), root)
    index = workdir.load_index(root)
    assert index is not None
    newest = max(row[1] for row in index.files.values())
    assert index.newest_ns == newest
    for written, racy in [(newest - 1, True), (newest, True), (newest + 1, False)]:
        index.written_ns = written
        assert index.racy() is racy is any(row[1] >= written for row in index.files.values())
    empty = workdir.Index(tree=None, server=SERVER, workspace=WORKSPACE, written_ns=-(2**62))
    assert not empty.racy()


# --- the first version -----------------------------------------------------------------------


def test_an_index_of_the_first_version_is_still_read(tmp_path: Path) -> None:
    """A workdir checked out by the client before version 2: at the head its local work is
    not refused (an unreadable index would make every local change a conflict), its stat
    cache still vouches for its files, and a checkout of a new head overwrites only what the
    last-held tree had."""
    store = FakeStore()
    one = tmp_path / "one"
    make(one, {"a": "a1", "d/b": "b1"})
    t1 = take_plain(store, one).tree
    two = tmp_path / "two"
    check_out(store, two, t1)
    (two / "a").write_bytes(b"a2")
    t2 = take_plain(store, two).tree
    agent = tmp_path / "agent"
    check_out(store, agent, t1)
    as_version_1(agent)
    assert index_file(agent).read_bytes().startswith(b'{"version":1,')
    index = workdir.load_index(agent)
    assert index is not None
    assert (index.tree, index.count, index.bytes) == (t1, 2, 4)
    assert index.newest_ns == max(row[1] for row in index.files.values())
    assert workdir.scan(agent, max_blob_bytes=10**6, index=index, warn=print).hashed == 0

    (agent / "d" / "b").write_bytes(b"local work")
    at_head = check_out(store, agent, t1)
    assert (at_head.files, at_head.fetched, at_head.written) == (2, 0, 0)
    done = check_out(store, agent, t2)  # "a" is the last-held tree's: no conflict
    assert done.tree == t2
    assert (agent / "a").read_bytes() == b"a2"
    assert (agent / "d" / "b").read_bytes() == b"local work"
    assert header(agent)["version"] == 2


# --- with the watcher ------------------------------------------------------------------------


def test_a_watched_run_that_changed_nothing_never_parses_the_rows(
    tmp_path: Path, watchers: list[Watcher], parses: list[int]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    files = tree_of(root)
    make(root, files)
    watch(watchers, root)
    settled(store, root)
    info = os.stat(index_file(root))
    data = index_file(root).read_bytes()
    index_module._last_index = None  # as a new process
    parses.clear()
    at_head = check_out(store, root, workdir.load_index(root).tree)  # type: ignore[union-attr]
    assert (at_head.files, at_head.written) == (20, 0)
    result, line = take(store, root)
    assert line == "watcher: 0 directories changed (0 files read)"
    assert parses == []
    assert isinstance(result.scan.stats, Rows)
    assert not result.scan.stats.parsed
    assert (result.files, result.bytes) == (20, sum(len(str(v)) for v in files.values()))
    after = os.stat(index_file(root))
    assert (after.st_ino, after.st_mtime_ns) == (info.st_ino, info.st_mtime_ns)
    assert index_file(root).read_bytes() == data

    (root / "d1/f1").write_text("changed")  # a change parses them once, and writes them
    result, line = take(store, root)
    assert line == "watcher: 1 directory changed (1 file read)"
    assert parses == [1]
    assert result.tree == full_tree(root)
    assert header(root)["count"] == 20


def test_a_racily_clean_row_is_read_again_with_the_header(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    """A file changed in the index file's timestamp tick, its size and mtime kept, and no
    event about it: the header's `newest_ns` says a row is racy, so the rows are looked at
    and the file read again; the index is then rewritten, and the next run reads nothing."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, {"d/f": "AAAA", "e/g": "g"})
    old(root / "d/f")
    watch(watchers, root)
    settled(store, root)
    mtime = (root / "d/f").stat().st_mtime_ns
    (root / "d/f").write_text("BBBB")
    os.utime(root / "d/f", ns=(mtime, mtime))
    state = watch_state.load_state(root)
    assert state is not None
    answer = watch_state.ask(root, state.token)
    assert isinstance(answer, watch_state.Answer)
    state.token = answer.token  # the watcher vouches for the write: only the racy rule is left
    watch_state.save_state(root, state)
    os.utime(index_file(root), ns=(mtime, mtime))  # the index written in the file's tick
    index_module._last_index = None
    index = workdir.load_index(root)
    assert index is not None
    assert not index.rows.parsed
    result, line = take(store, root)
    assert line == "watcher: 0 directories changed (1 file read)"
    assert result.tree == full_tree(root)
    assert b"BBBB" in store.blobs.values()
    assert os.stat(index_file(root)).st_mtime_ns > mtime  # rewritten
    _result, line = take(store, root)
    assert line == "watcher: 0 directories changed (0 files read)"


@pytest.mark.parametrize("rows", [b'{"d0/f0": [1', b"{}"])
def test_rows_that_cannot_be_read_mean_a_full_scan_that_loses_nothing(
    tmp_path: Path, watchers: list[Watcher], rows: bytes
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, tree_of(root))
    watch(watchers, root)
    settled(store, root)
    head = index_file(root).read_bytes().split(b"\n", 1)[0]
    rewrite(root, head + b"\n" + rows)
    (root / "d2/f3").write_text("edited after the index was spoiled")
    old(root / "d2/f3")  # not in the tick the scan starts in (racily clean: read once more)
    result, line = take(store, root)
    assert line == "full scan: the stat cache in index.json could not be read"
    assert result.tree == full_tree(root)
    assert result.scan.hashed == 20  # nothing vouched for by the spoiled rows
    assert b"edited after the index was spoiled" in store.blobs.values()
    assert header(root)["count"] == 20  # written again whole
    _result, line = take(store, root)
    assert line == "watcher: 0 directories changed (0 files read)"
    (root / "d0/f0").write_text("and again")
    result, line = take(store, root)
    assert line == "watcher: 1 directory changed (1 file read)"
    assert result.tree == full_tree(root)
