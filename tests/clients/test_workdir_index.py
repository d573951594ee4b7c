"""The index's header and rows (issue #42): a header line that says what the stat cache holds
(`count`, `bytes`, `newest_ns`, the `crc` of the rows), then the rows as sorted lines, parsed
only when they are all needed. A run at the head and a watched run that changed nothing
answer from the header; a watched run that changed some files looks up their rows alone and
writes the index again with only those lines changed; a racily clean row is still read
again; rows that cannot be parsed only mean a full scan; and an index written by the first
or second version is still read.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from paperclip_client import workdir
from paperclip_client.trees import blob_name
from paperclip_client.workdir import Rows, watch_state
from paperclip_client.workdir import index as index_module
from tests.clients.test_watch import Watcher, full_tree, settled, take, tree_of, watch, watchers
from tests.clients.test_workdir import SERVER, WORKSPACE, FakeStore, check_out, make, old
from tests.clients.test_workdir import take as take_plain

__all__ = ["watchers"]  # the fixture, used by name


def index_file(root: Path) -> Path:
    return root / ".paperclip" / workdir.INDEX


def lines_of(body: bytes) -> dict[str, list[object]]:
    """Version 3's rows: a line each, `<path as JSON>\\t<row as JSON>`, sorted."""
    pairs = [line.split(b"\t") for line in body.splitlines()]
    assert [k for k, _v in pairs] == sorted(k for k, _v in pairs)
    return {json.loads(k): json.loads(v) for k, v in pairs}


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
    rows = lines_of(rest)
    assert json.loads(head) == {
        "version": 3,
        "id": json.loads(head)["id"],
        "tree": first.tree,
        "server": SERVER,
        "workspace": WORKSPACE,
        "count": 2,
        "bytes": 8,
        "newest_ns": max(row[1] for row in rows.values()),  # type: ignore[index]
        "crc": zlib.crc32(rest),
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
     ("server", None), ("id", 7), ("count", -1), ("version", 4), ("crc", "1"), ("crc", None)],
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
    [
        b'{"a": [3, 1',
        b"[]",
        b'{"a": [3, 1, 420, 5]}',
        b'{"a": "x"}',
        b"",
        b"{}",
        b'"a"\t[3,1,420,5,"x",6]\n',
        b'"a"\t[3,1,420,5,"x",6]',
    ],
)
def test_rows_that_cannot_be_read_are_an_empty_stat_cache(tmp_path: Path, rows: bytes) -> None:
    """Truncated, not rows, or not the header's rows (`{}` while the header counts one, a
    row whose line is not the one the header's checksum was taken of)."""
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
    assert header(agent)["version"] == 3


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

    (root / "d1/f1").write_text("changed")  # a change looks up its rows: none parsed
    result, line = take(store, root)
    assert line == "watcher: 1 directory changed (1 file read)"
    assert parses == []
    assert result.tree == full_tree(root)
    assert header(root)["count"] == 20


def rows_on_disk(root: Path) -> dict[str, tuple[int, int, int, int, str]]:
    """What the stat cache should say of every file now: size, mtime, mode, inode, digest."""
    found = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".paperclip") or not path.is_file():
            continue
        info = path.stat()
        digest = blob_name(path.read_bytes())
        found[rel] = (info.st_size, info.st_mtime_ns, info.st_mode & 0o7777, info.st_ino, digest)
    return found


def test_a_watched_change_looks_up_and_writes_only_its_own_rows(
    tmp_path: Path, watchers: list[Watcher], parses: list[int]
) -> None:
    """An edit, a new file, a deletion and a rename: the scan looks up those rows alone (the
    others are never parsed), and the index written after it is the old one's lines with
    exactly those lines changed: every other line byte for byte as it was, the header's
    count and bytes the new stat cache's, each row what the file on disk is."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, tree_of(root))
    for path in root.rglob("f*"):
        old(path)
    watch(watchers, root)
    settled(store, root)
    before = lines_of(index_file(root).read_bytes().split(b"\n", 1)[1])
    index_module._last_index = None
    parses.clear()
    (root / "d1/f1").write_text("edited, longer than before")
    (root / "d0/new").write_text("new")
    (root / "d2/f3").unlink()
    (root / "d3/f0").rename(root / "d1/moved")
    for path in ("d1/f1", "d0/new"):
        old(root / path)  # not racily clean: the next run reads nothing
    result, line = take(store, root)
    assert line == "watcher: 4 directories changed (3 files read)"
    assert parses == []
    assert result.tree == full_tree(root)
    body = index_file(root).read_bytes().split(b"\n", 1)[1]
    after = lines_of(body)
    on_disk = rows_on_disk(root)
    assert set(after) == set(on_disk)
    assert {p: (*r[:4], r[4]) for p, r in after.items()} == on_disk  # type: ignore[misc]
    changed = {"d1/f1", "d0/new", "d2/f3", "d3/f0", "d1/moved"}
    assert {p: r for p, r in after.items() if p not in changed} == {
        p: r for p, r in before.items() if p not in changed
    }
    head = header(root)
    assert (head["count"], head["bytes"]) == (20, sum(r[0] for r in on_disk.values()))
    assert (result.files, result.bytes) == (head["count"], head["bytes"])
    assert head["crc"] == zlib.crc32(body)
    assert isinstance(head["newest_ns"], int)
    assert head["newest_ns"] >= max(r[1] for r in on_disk.values())
    index_module._last_index = None
    result, line = take(store, root)  # the index written in part vouches for the rest
    assert line == "watcher: 0 directories changed (0 files read)"
    assert result.tree == full_tree(root)


def test_an_index_of_the_second_version_is_still_read(
    tmp_path: Path, watchers: list[Watcher], parses: list[int]
) -> None:
    """Its rows one JSON object: a change parses them once, and the index is written again
    whole as version 3, its stat cache still vouching for the files not changed."""
    store, root = FakeStore(), tmp_path / "w"
    make(root, tree_of(root))
    for path in root.rglob("f*"):
        old(path)
    watch(watchers, root)
    settled(store, root)
    head, rest = index_file(root).read_bytes().split(b"\n", 1)
    as_two = {k: v for k, v in json.loads(head).items() if k != "crc"} | {"version": 2}
    rows = json.dumps(lines_of(rest), separators=(",", ":")).encode()
    rewrite(root, json.dumps(as_two).encode() + b"\n" + rows)
    index_module._last_index = None
    parses.clear()
    (root / "d1/f1").write_text("edited")
    old(root / "d1/f1")
    result, line = take(store, root)
    assert line == "watcher: 1 directory changed (1 file read)"
    assert parses == [1]
    assert result.tree == full_tree(root)
    assert (header(root)["version"], header(root)["count"]) == (3, 20)
    assert set(lines_of(index_file(root).read_bytes().split(b"\n", 1)[1])) == set(
        rows_on_disk(root)
    )
    index_module._last_index = None
    result, line = take(store, root)
    assert line == "watcher: 0 directories changed (0 files read)"


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


@pytest.mark.parametrize("rows", [b'{"d0/f0": [1', b"{}", b"", b'"d0/f0"\t[1,2,420,3,"x",4]\n'])
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


def test_the_directory_blobs_are_a_line_each_and_the_first_version_is_still_read(
    tmp_path: Path, watchers: list[Watcher]
) -> None:
    store, root = FakeStore(), tmp_path / "w"
    make(root, tree_of(root))
    watch(watchers, root)
    settled(store, root)
    path = root / ".paperclip" / workdir.DIRS
    head, rest = path.read_bytes().split(b"\n", 1)
    tree = header(root)["tree"]
    assert json.loads(head) == {"version": 2, "tree": tree}
    blobs = dict(line.split(b"\t") for line in rest.splitlines())
    assert all(blob_name(blob) == name.decode() for name, blob in blobs.items())
    assert len(blobs) == 5  # the root and d0 to d3
    loaded = index_module.load_dirs(root)
    assert loaded == {k.decode(): v for k, v in blobs.items()}
    as_one = {"tree": tree, "dirs": {k: v.decode() for k, v in loaded.items()}}
    path.write_bytes(json.dumps(as_one, ensure_ascii=False).encode())
    assert index_module.load_dirs(root) == loaded
    (root / "d1/f1").write_text("edited")
    result, line = take(store, root)
    assert line == "watcher: 1 directory changed (1 file read)"
    assert result.tree == full_tree(root)
    assert path.read_bytes().startswith(b'{"version": 2,')
    path.write_bytes(head + b"\n" + rest[:-1])  # its last newline lost: not read
    assert index_module.load_dirs(root) == {}


def test_a_full_scan_parses_the_rows_at_once_and_many_lookups_end_in_a_parse(
    tmp_path: Path, parses: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A search per row costs more than a parse of all of them once many rows are wanted: a
    full scan parses them before it reads, and lookups past `LOOKUPS_BEFORE_PARSE` parse."""
    searches: list[str] = []
    real = index_module.find

    def find(body: bytes, start: int, key: bytes) -> tuple[int, int]:
        searches.append(key.decode())
        return real(body, start, key)

    monkeypatch.setattr(index_module, "find", find)
    root = tmp_path / "w"
    make(root, {f"d/f{i}": f"file {i}" for i in range(10)})
    take_plain(FakeStore(), root)
    index_module._last_index = None
    parses.clear()
    index = workdir.load_index(root)
    assert index is not None
    assert workdir.scan(root, max_blob_bytes=10**6, index=index, warn=print).hashed == 0
    assert (parses, searches) == ([1], [])

    index_module._last_index = None
    parses.clear()
    monkeypatch.setattr(index_module, "LOOKUPS_BEFORE_PARSE", 3)
    index = workdir.load_index(root)
    assert index is not None
    found = [index.rows.lookup(f"d/f{i}") for i in range(6)]
    assert all(row is not None and row[0] == len(f"file {i}") for i, row in enumerate(found))
    assert (parses, len(searches)) == ([1], 3)
