"""The client's state in `<workdir>/.paperclip/`: the index (the tree the workdir last held
and its stat cache), the directory blobs of that tree, and the blobs the index vouches for.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import stat
import threading
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

from paperclip_client.workdir.rowlines import (
    encode_all,
    encode_key,
    find,
    loads_all,
    row_at,
    splice,
)

STATE_DIR = ".paperclip"
INDEX = "index.json"
DIRS = "dirs.json"
JOURNAL = "checkout.json"
INDEX_VERSION = 3  # versions 2 (the rows one JSON object) and 1 (one with "files") are read
# Rows found by a search in the sorted lines (about 20 us each for 50,000 rows) before the
# rest are parsed at once instead (about 1.5 us a row): a scan that reads many files.
LOOKUPS_BEFORE_PARSE = 2_000
DIRS_VERSION = 2  # version 1 (`{"tree", "dirs": {name: text}}`) is still read
type Stat = list[Any]  # [size, mtime_ns, mode, ino, digest or [chunks], ctime_ns]


# --- the index -------------------------------------------------------------------------------


class Rows:
    """The stat cache's rows (path -> Stat), parsed from the index file's bytes the first
    time they are all wanted (`get`): a run that changed nothing answers from the header
    alone, and one that changed some files finds their rows one by one (`lookup`, in the
    sorted lines of version 3: `rowlines`). Shared, never changed, by the copies of an index
    (`dataclasses.replace`, `load_index`'s cache). Rows that cannot be parsed, or that do not
    agree with the header's count, bytes, newest mtime and checksum, are `{}` and
    `unreadable`: an empty stat cache only means files are read again."""

    __slots__ = (
        "_crc", "_expect", "_found", "_lines", "_lock", "_raw", "_rows", "_sound", "_start",
        "unreadable",
    )  # fmt: skip

    def __init__(
        self,
        raw: bytes = b"{}",
        start: int = 0,
        expect: tuple[int, int, int] | None = None,
        *,
        crc: int | None = None,
    ) -> None:
        self._raw = raw  # the rows are `raw[start:]` (the file's bytes are not copied)
        self._start = start
        self._expect = expect  # (count, bytes, newest_ns) as the header says
        self._lines = crc is not None  # version 3: sorted lines, under the header's checksum
        self._crc = crc
        self._sound: bool | None = None  # the checksum, once checked
        self._rows: dict[str, Stat] | None = None
        self._found: dict[str, Stat | None] = {}  # rows looked up in the lines, by path
        self._lock = threading.Lock()
        self.unreadable = False

    @classmethod
    def of(cls, rows: dict[str, Stat]) -> Rows:
        """Rows already parsed (a version 1 index); malformed ones are unreadable."""
        held = cls()
        held._take(rows)
        return held

    @property
    def parsed(self) -> bool:
        return self._rows is not None

    def get(self) -> dict[str, Stat]:
        rows = self._rows
        if rows is None:
            with self._lock:
                if self._rows is None:
                    with gc_paused():
                        body = self._raw[self._start :]
                        if not self._lines:
                            self._take(_json(body))
                        else:
                            self._take(loads_all(body) if self._check() else None)
                rows = self._rows
                assert rows is not None  # noqa: S101 - set by _take
        return rows

    def lookup(self, path: str) -> Stat | None:
        """The row of `path`: in sorted lines not yet parsed, found by a search over them
        (the checksum checked at the first), else from the parsed rows."""
        with self._lock:
            raw, start, rows = self._raw, self._start, self._rows
            sound = rows is None and self._lines and self._check()
        if rows is not None:
            return rows.get(path)
        if not self._lines:
            return self.get().get(path)
        if not sound:
            return None  # unreadable: `_check` made the rows `{}`
        if path in self._found:  # a scan, its summary and its writing look each one up
            return self._found[path]
        if len(self._found) >= max(LOOKUPS_BEFORE_PARSE, (self._expect or (0,))[0] // 25):
            return self.get().get(path)  # a full scan's: one parse is cheaper than searches
        line, end = find(raw, start, encode_key(path))
        row = row_at(raw, line, end) if end >= 0 else None
        self._found[path] = row
        return row

    def readable(self) -> bool:
        """Whether the rows can be used, found out as cheaply as the format allows (the
        checksum of sorted lines; a parse of the rows of version 2)."""
        if self._lines and self._rows is None:
            with self._lock:
                if self._rows is None:
                    return self._check()
        self.get()
        return not self.unreadable

    def summary(self) -> tuple[int, int, int]:
        """(count, bytes, newest_ns): the header's (its newest an upper bound: see
        `save_state`), or the parsed rows' when there is no header."""
        if self.unreadable:
            return 0, 0, 0
        if self._expect is not None:
            return self._expect
        return summarize(self.get()) or (0, 0, 0)

    def spliced(self, changes: Mapping[str, Stat | None]) -> tuple[bytes, tuple[int, int, int]]:
        """The sorted lines with `changes` put in (None: the path is gone), and their
        summary; raises `NotSpliced` when these rows are not lines that can be (version 2,
        parsed already, or unreadable): the whole stat cache is written instead."""
        with self._lock:
            raw, start = self._raw, self._start
            if not self._lines or self._rows is not None or not self._check():
                raise NotSpliced
            assert self._expect is not None  # noqa: S101 - a header has them
            count, size, newest = self._expect
        ordered = sorted((encode_key(p), row) for p, row in changes.items())
        body, replaced = splice(raw, start, ordered)
        pairs = zip(replaced, (row for _key, row in ordered), strict=True)
        return body, _summary_after((count, size, newest), pairs)

    def _check(self) -> bool:
        """(Lock held.) The sorted lines against the header's checksum, once: rows that do
        not match it are unreadable (`{}`)."""
        if self._sound is None:
            self._sound = zlib.crc32(memoryview(self._raw)[self._start :]) == self._crc
            if not self._sound:
                self._take(None)
        return self._sound

    def _take(self, data: object) -> None:
        summary = summarize(data) if isinstance(data, dict) else None
        expect = self._expect
        if summary is None or (
            expect is not None and (summary[:2] != expect[:2] or summary[2] > expect[2])
        ):
            self.unreadable = True
            self._rows = {}
        else:
            assert isinstance(data, dict)  # noqa: S101 - summarized
            self._rows = data
        self._raw, self._start = b"", 0


class NotSpliced(Exception):
    """The rows are not sorted lines that a change can be put into."""


class RowChanges:
    """The stat cache after a partial scan: the index's rows (`base`, never changed) with
    the rows read again (`update`) and the paths gone (`pop`). Its summary and its writing
    look up only the paths it changed."""

    __slots__ = ("base", "put", "removed")

    def __init__(self, base: Rows) -> None:
        self.base = base
        self.put: dict[str, Stat] = {}
        self.removed: set[str] = set()

    def pop(self, path: str, default: object = None) -> None:
        self.put.pop(path, None)
        self.removed.add(path)

    def update(self, rows: Mapping[str, Stat]) -> None:
        self.put.update(rows)
        self.removed.difference_update(rows)

    def changes(self) -> dict[str, Stat | None]:
        return {**dict.fromkeys(self.removed), **self.put}

    def get(self) -> dict[str, Stat]:
        """Every row (the base's parsed: a copy of them with the changes)."""
        rows = dict(self.base.get())
        for path in self.removed:
            rows.pop(path, None)
        rows.update(self.put)
        return rows

    def summary(self) -> tuple[int, int, int]:
        """(count, bytes, newest_ns), the newest an upper bound (a row gone may have been
        the newest: the header then only says "racy" where a parse would not)."""
        pairs = ((self.base.lookup(p), row) for p, row in self.changes().items())
        return _summary_after(self.base.summary(), pairs)

    def unchanged(self) -> bool:
        """Whether every change leaves the base's row as it was."""
        return all(self.base.lookup(p) == row for p, row in self.changes().items())


def _summary_after(
    summary: tuple[int, int, int], replaced: Iterable[tuple[Stat | None, Stat | None]]
) -> tuple[int, int, int]:
    """(count, bytes, newest_ns) of rows after each (old row, new row) of `replaced` (None: no
    such row); the newest an upper bound, as an old row's mtime is never taken back."""
    count, size, newest = summary
    for was, row in replaced:
        if was is not None:
            count, size = count - 1, size - was[0]
        if row is not None:
            count, size, newest = count + 1, size + row[0], max(newest, row[1])
    return count, size, newest


def summarize(rows: Mapping[str, Stat]) -> tuple[int, int, int] | None:
    """(count, bytes, newest_ns) of stat cache rows: how many, the sum of their sizes, the
    largest mtime (0 when there is none); None when a row is not [size, mtime_ns, mode, ino,
    content, ctime_ns] (or the same without the ctime, as written before it was kept) with
    integer size and mtime."""
    if not rows:
        return 0, 0, 0
    total = 0
    newest: object = None
    try:
        for row in rows.values():
            if len(row) not in (5, 6):
                return None
            size, mtime = row[0], row[1]
            total += size
            if newest is None or mtime > newest:
                newest = mtime
    except (TypeError, ValueError, KeyError):
        return None
    if not (_is_int(total) and _is_int(newest)):
        return None
    return len(rows), total, newest


def _is_int(value: object) -> TypeGuard[int]:
    return type(value) is int


@dataclass(slots=True)
class Index:
    """The tree the workdir last held and its stat cache (`files`, parsed on demand), with
    the header's summary of it: `count` rows, `bytes` (the sum of their sizes) and
    `newest_ns` (their largest mtime)."""

    tree: str | None
    server: str
    workspace: str
    rows: Rows = field(default_factory=Rows)
    # Entries whose mtime is not older are re-hashed: the index file's mtime, or the time its
    # snapshot's scan started (`racy_ns`, the header's) when that is earlier.
    written_ns: int = 0
    id: str = ""  # new at each write: what the watcher's state (`watch.json`) goes with
    count: int = 0
    bytes: int = 0
    newest_ns: int = 0
    racy_ns: int | None = None

    @property
    def files(self) -> dict[str, Stat]:
        """The stat cache: path -> [size, mtime_ns, mode, ino, digest or [chunks]]."""
        return self.rows.get()

    def racy(self) -> bool:
        """Whether some entry is racily clean: modified in or after the index file's
        timestamp tick (its mtime not older than `written_ns`), so that every scan reads it
        again until the index is rewritten."""
        return self.count > 0 and self.newest_ns >= self.written_ns

    def cached(self, path: str, st: os.stat_result) -> str | tuple[str, ...] | None:
        """The content `path` had when it was last read, if its stat says it is unchanged:
        size, mtime, mode, inode and ctime (which no program can set back: a rewrite in place
        that keeps the size and restores the mtime, as `cp -p` does, still moves it; a row
        without one, written before it was kept, means the file is read again)."""
        row = self.rows.lookup(path)
        if (
            row is None
            or row[0] != st.st_size
            or row[1] != st.st_mtime_ns
            or row[2] != stat.S_IMODE(st.st_mode)
            or row[3] != st.st_ino
            or len(row) < 6
            or row[5] != st.st_ctime_ns
            or st.st_mtime_ns >= self.written_ns
        ):
            return None
        content = row[4]
        return tuple(content) if isinstance(content, list) else content

    def records(
        self,
        *,
        tree: str | None,
        server: str,
        workspace: str,
        files: Rows | RowChanges | Mapping[str, Stat],
    ) -> bool:
        """Whether this index already says exactly that: the same tree for the same server
        and workspace, the same stat cache, and no entry racily clean. Rewriting it then
        would change nothing but its mtime. Given its own `Rows` (a partial scan that read
        nothing), or changes of them that leave each row as it was, that is answered from
        the header and the changed rows, without parsing the others."""
        if (
            self.tree != tree
            or self.server != server
            or self.workspace != workspace
            or self.racy()
            or self.rows.unreadable
        ):
            return False
        if files is self.rows:
            return True
        if isinstance(files, RowChanges):
            return files.base is self.rows and files.unchanged() and not self.rows.unreadable
        rows = files.get() if isinstance(files, Rows) else files
        return self.files == rows and not self.rows.unreadable


def state_path(workdir: Path) -> Path:
    return workdir / STATE_DIR


# The index last read by this process, by the identity of the file it was read from (device,
# inode, size, mtime, ctime): the CLI's checkout and snapshot read the same file, and a
# rewrite (a new file renamed over it) or any write in place changes the identity.
_last_index: tuple[tuple[object, ...], Index] | None = None
_last_index_lock = threading.Lock()


def load_index(workdir: Path) -> Index | None:
    """The workdir's index, or None when it is missing or unreadable. Only its header is
    parsed (its rows when first wanted); a file read again unchanged is not read again: its
    `rows` are shared, never to be changed by callers."""
    global _last_index  # a one-entry cache
    path = state_path(workdir) / INDEX
    try:
        with path.open("rb") as handle:
            info = os.fstat(handle.fileno())
            identity = (
                str(path),
                info.st_dev,
                info.st_ino,
                info.st_size,
                info.st_mtime_ns,
                info.st_ctime_ns,
            )
            last = _last_index
            if last is not None and last[0] == identity:
                return replace(last[1])  # its own copy: a caller may move `written_ns`
            data = handle.read()
    except OSError:
        return None
    index = parse_index(data)
    if index is None:
        return None
    index.written_ns = (
        info.st_mtime_ns if index.racy_ns is None else min(info.st_mtime_ns, index.racy_ns)
    )
    with _last_index_lock:
        _last_index = (identity, index)
    return replace(index)


def parse_index(data: bytes) -> Index | None:
    """An index file's bytes: version 3 (a header line, then the rows as sorted lines, kept
    unparsed), version 2 (a header line, then the rows as one JSON object, kept unparsed) or
    version 1 (one JSON object holding the rows as "files", parsed whole)."""
    newline = data.find(b"\n")
    with gc_paused():  # a version 1 file has no newline: the "header" is all of it
        header = _json(data[:newline] if newline >= 0 else data)
    if isinstance(header, dict) and header.get("version") in (2, 3) and newline >= 0:
        return _version_2(header, data, newline + 1)
    if newline >= 0:  # not a version 2 header: the file is one JSON object
        with gc_paused():
            header = _json(data)
    if isinstance(header, dict) and header.get("version") == 1:
        return _version_1(header)
    return None


def _json(data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _version_2(header: dict[str, Any], data: bytes, start: int) -> Index | None:
    """Version 2 or 3: the same header, version 3's with the checksum of its lines."""
    tree, server, workspace, index_id = (
        header.get(k) for k in ("tree", "server", "workspace", "id")
    )
    count, size, newest = (header.get(k) for k in ("count", "bytes", "newest_ns"))
    if not (tree is None or isinstance(tree, str)):
        return None
    if not (isinstance(server, str) and isinstance(workspace, str) and isinstance(index_id, str)):
        return None
    if not (_is_int(count) and _is_int(size) and _is_int(newest)) or count < 0 or size < 0:
        return None
    racy = header.get("racy_ns")
    if not (racy is None or _is_int(racy)):
        return None
    crc = header.get("crc") if header["version"] == 3 else None
    if header["version"] == 3 and not _is_int(crc):
        return None
    return Index(
        tree=tree,
        server=server,
        workspace=workspace,
        rows=Rows(data, start, (count, size, newest), crc=crc),
        id=index_id,
        count=count,
        bytes=size,
        newest_ns=newest,
        racy_ns=racy,
    )


def _version_1(data: dict[str, Any]) -> Index | None:
    files, tree = data.get("files"), data.get("tree")
    if not isinstance(files, dict) or not (tree is None or isinstance(tree, str)):
        return None
    rows = Rows.of(files)
    count, size, newest = summarize(rows.get()) or (0, 0, 0)
    return Index(
        tree=tree,
        server=str(data.get("server")),
        workspace=str(data.get("workspace")),
        rows=rows,
        id=str(data.get("id") or ""),
        count=count,
        bytes=size,
        newest_ns=newest,
    )


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a pass over every file allocates (an index
    of 50,000 rows, a scan): it would otherwise traverse the growing heap again and again,
    about a sixth of a scan's time, for reference cycles that these passes do not make."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def write_atomic(path: Path, data: bytes | Iterable[bytes]) -> None:
    """`data` (or its pieces, written in turn) as the file `path`, in place of what it was
    only once written whole."""
    path.parent.mkdir(exist_ok=True)
    temp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    with temp.open("wb") as handle:
        if isinstance(data, bytes):
            handle.write(data)
        else:
            handle.writelines(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


@gc_paused()
def save_state(
    workdir: Path,
    *,
    tree: str | None,
    server: str,
    workspace: str,
    files: Rows | RowChanges | Mapping[str, Stat],
    dirs: Mapping[str, bytes],
    racy_ns: int | None = None,
) -> str:
    """Record that the workdir holds `tree` (its directory blobs `dirs`), with the stat cache
    `files`: the directory blobs first, the index last (the index names the tree). Returns
    the new index's id. `racy_ns`: when the scan that read `files` started (`fs_now`): a row
    not older is racily clean, although the index file is written later (after the upload
    and the registration), since a write in the row's timestamp tick after the scan read the
    file leaves its stat as the row says. Changes of an index's sorted lines (`RowChanges`)
    are put into a copy of its bytes; the header's `newest_ns` is then an upper bound (a row
    gone may have been the newest), which only makes the racy rule read more."""
    write_atomic(state_path(workdir) / DIRS, _dirs_bytes(tree, dirs))
    try:
        if not isinstance(files, RowChanges):
            raise NotSpliced
        body, (count, size, newest) = files.base.spliced(files.changes())
    except NotSpliced:
        rows = files.get() if isinstance(files, Rows | RowChanges) else dict(files)
        summary = summarize(rows)
        if summary is None:  # never from a scan or a checkout: a missing row is read again
            rows = {p: r for p, r in rows.items() if summarize({p: r}) is not None}
            summary = summarize(rows)
        count, size, newest = summary or (0, 0, 0)
        body = encode_all(rows)
    index_id = uuid.uuid4().hex
    header = {
        "version": INDEX_VERSION,
        "id": index_id,
        "tree": tree,
        "server": server,
        "workspace": workspace,
        "count": count,
        "bytes": size,
        "newest_ns": newest,
        "crc": zlib.crc32(body),
    }
    if racy_ns is not None:
        header["racy_ns"] = racy_ns
    write_atomic(
        state_path(workdir) / INDEX,
        b"%s\n%s" % (json.dumps(header, separators=(",", ":")).encode(), body),
    )
    return index_id


def _dirs_bytes(tree: str | None, dirs: Mapping[str, bytes]) -> list[bytes]:
    """`dirs.json`, in pieces to be written in turn (the blobs not copied into one): a header
    line, then a line a blob, `<name>\t<blob>\n` (a directory blob is canonical JSON: JSON
    escapes every tab and newline in it). Version 1, one JSON object of the blobs as text,
    where one is not such a line (never from this client)."""
    header = json.dumps({"version": DIRS_VERSION, "tree": tree}).encode()
    pieces = [header, b"\n"]
    for name, data in dirs.items():
        key = name.encode("utf-8")
        if b"\t" in data or b"\n" in data or b"\t" in key or b"\n" in key:
            body = {"tree": tree, "dirs": {k: v.decode("utf-8") for k, v in dirs.items()}}
            return [json.dumps(body, ensure_ascii=False).encode()]
        pieces += (key, b"\t", data, b"\n")
    return pieces


STAMP = "stamp"


def fs_now(workdir: Path) -> int | None:
    """The filesystem's time now, as it stamps a file written now (`.paperclip/stamp`,
    written and read back: its clock and tick, not the system's); None when it cannot be
    written."""
    try:
        state_path(workdir).mkdir(exist_ok=True)
        fd = os.open(
            state_path(workdir) / STAMP,
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
    except OSError:
        return None
    try:
        os.write(fd, b"\n")
        return os.fstat(fd).st_mtime_ns
    except OSError:
        return None
    finally:
        os.close(fd)


def load_dirs(workdir: Path) -> dict[str, bytes]:
    """The directory blobs of `dirs.json` by name (`{}` when it cannot be read)."""
    try:
        data = (state_path(workdir) / DIRS).read_bytes()
    except OSError:
        return {}
    newline = data.find(b"\n")
    header = _json(data[:newline]) if newline >= 0 else None
    if isinstance(header, dict) and header.get("version") == DIRS_VERSION:
        return _dirs_lines(data, newline + 1)
    try:
        old = json.loads(data)
        return {str(k): str(v).encode("utf-8") for k, v in old["dirs"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}


def _dirs_lines(data: bytes, start: int) -> dict[str, bytes]:
    """The blobs of the lines of `dirs.json` from `start`, each sliced once from the file's
    bytes (`{}` when a line is not `<name>\t<blob>\n`)."""
    blobs: dict[str, bytes] = {}
    end = len(data)
    if start < end and not data.endswith(b"\n"):
        return {}
    while start < end:
        stop = data.find(b"\n", start)
        tab = data.find(b"\t", start, stop)
        if tab < 0:
            return {}
        blobs[data[start:tab].decode("utf-8", "replace")] = data[tab + 1 : stop]
        start = stop + 1
    return blobs


def stored_by_index(workdir: Path, index: Index | None, *, server: str, workspace: str) -> set[str]:
    """The blobs the workdir's index names (its files' contents and its tree's directories)
    when it was written for this server and workspace: the store held them then (the index
    is written only after a checkout from it or a registration with it), so a later run need
    not ask about them. The store may have collected some since (only ones no head or live
    run reaches, past the grace): registration then answers `snapshot_blobs_missing`, and the
    caller snapshots again without this set."""
    if index is None or index.tree is None or index.server != server:
        return set()
    if index.workspace != workspace:
        return set()
    known: set[str] = set(load_dirs(workdir))
    for row in index.files.values():
        content = row[4] if isinstance(row, list) and len(row) > 4 else None
        if isinstance(content, str):
            known.add(content)
        elif isinstance(content, list):
            known.update(c for c in content if isinstance(c, str))
    return known
