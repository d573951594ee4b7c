"""A workdir read into a tree: the walk (ignore rules, symlinks, names), the hashing (with the
stat cache of the index) and the directory blobs built from the entries.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import pathspec

from paperclip_client.trees import (
    Entry,
    TreeError,
    blob_name,
    decode_dir,
    encode_dir,
    name_ok,
    symlink_escapes,
)
from paperclip_client.workdir.errors import WorkdirChanged, WorkdirError
from paperclip_client.workdir.index import (
    STATE_DIR,
    Index,
    RowChanges,
    Rows,
    Stat,
    gc_paused,
    load_dirs,
)
from paperclip_client.workdir.transfer import Say

IGNORE_FILE = ".paperclipignore"
PIECE = 1024 * 1024
MAX_DEPTH = 256


# --- scanning --------------------------------------------------------------------------------


@dataclass(slots=True)
class Scan:
    """A workdir read as a tree: `entries` by path, the directory blobs, where each content
    blob can be read (`sources`: path, offset, length) and the new stat cache. A partial scan
    (`rescan`) has the sources of the files it read alone, and names the blobs the rest of
    the tree is made of (`vouched`: the last tree's directories, which the index vouches for;
    the files' contents are in `stats`). A partial scan that read nothing has the index's own
    `Rows` as its `stats`, never parsed (`Index.records` knows them)."""

    tree: str
    entries: dict[str, Entry]  # a partial scan's: those it read
    dirs: Mapping[str, bytes]
    sources: dict[str, tuple[str, int, int]]
    stats: dict[str, Stat] | Rows | RowChanges
    files: int = 0
    bytes: int = 0
    hashed: int = 0  # files read (not answered by the stat cache)
    # What a partial scan needs next time (`rescan`): each directory's blob by path, the
    # symlinks kept and left out (path -> target), the files with other hard links.
    paths: dict[str, str] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    linked: list[str] = field(default_factory=list)
    token: str | None = None  # the watcher's token taken before this scan, if any
    ignore: str | None = None  # with a token: the digest of the ignore rules it read
    vouched: frozenset[str] | None = None  # a partial scan's (see above)
    max_blob_bytes: int = 0  # with a token: the limit the files were read with


def load_ignore(workdir: Path) -> pathspec.GitIgnoreSpec | None:
    try:
        lines = (workdir / IGNORE_FILE).read_text("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    return pathspec.GitIgnoreSpec.from_lines(lines)


class Ignore(Protocol):
    def match_file(self, file: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class TrackedIgnore:
    """The ignore rules for untracked paths only: a path the last-held tree holds (a
    directory above one too) is never ignored, as git ignores no tracked file. Left out of
    the snapshot, it would read as deleted by the run, and publishing would drop another
    run's committed file from the head."""

    spec: pathspec.GitIgnoreSpec
    tracked: frozenset[str]  # every path of the last-held tree, directories included

    def match_file(self, file: str) -> bool:
        path = file[:-1] if file.endswith("/") else file
        return path not in self.tracked and self.spec.match_file(file)


def tracked_paths(workdir: Path, index: Index | None) -> frozenset[str]:
    """Every path of the tree the workdir last held (its directory blobs from `dirs.json`;
    the stat cache's files and the directories above them besides, should a blob be
    missing there)."""
    if index is None or index.tree is None:
        return frozenset()
    blobs = load_dirs(workdir)
    paths: set[str] = set()
    level = [("", index.tree)]
    while level:
        below: list[tuple[str, str]] = []
        for path, digest in level:
            data = blobs.get(digest)
            if data is None or blob_name(data) != digest:
                continue
            try:
                entries = decode_dir(data, path)
            except TreeError:
                continue
            for entry in entries:
                where = f"{path}/{entry.name}" if path else entry.name
                paths.add(where)
                if entry.type == "dir" and entry.digest is not None:
                    below.append((where, entry.digest))
        level = below
    if not index.rows.unreadable:
        for file in index.files:
            parts = file.split("/")
            paths.update("/".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    return frozenset(paths)


def scan_ignore(workdir: Path, index: Index | None) -> Ignore | None:
    """The workdir's ignore rules as a scan applies them (`TrackedIgnore`)."""
    spec = load_ignore(workdir)
    if spec is None or index is None or index.tree is None:
        return spec
    return TrackedIgnore(spec, tracked_paths(workdir, index))


def chunking(size: int, max_blob_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each blob of a file of `size` bytes."""
    if size <= max_blob_bytes:
        return [(0, size)]
    return [(o, min(max_blob_bytes, size - o)) for o in range(0, size, max_blob_bytes)]


def content_ok(content: str | tuple[str, ...] | None, size: int, max_blob_bytes: int) -> bool:
    if content is None:
        return False
    if size <= max_blob_bytes:
        return isinstance(content, str)
    return isinstance(content, tuple) and len(content) == len(chunking(size, max_blob_bytes))


def hash_fd(fd: int, size: int, max_blob_bytes: int) -> str | tuple[str, ...]:
    """The digest of an open file's content (chunk digests above `max_blob_bytes`)."""
    digests = []
    for _offset, length in chunking(size, max_blob_bytes):
        h = hashlib.sha256()
        left = length
        while left > 0:
            piece = os.read(fd, min(PIECE, left))
            if not piece:
                raise WorkdirChanged("a file shrank while it was read")
            h.update(piece)
            left -= len(piece)
        digests.append("sha256:" + h.hexdigest())
    if os.read(fd, 1):
        raise WorkdirChanged("a file grew while it was read")
    return digests[0] if len(digests) == 1 else tuple(digests)


def file_entry(name: str, mode: int, size: int, content: str | tuple[str, ...]) -> Entry:
    if isinstance(content, tuple):
        return Entry(name=name, type="file", mode=mode, size=size, chunks=content)
    return Entry(name=name, type="file", mode=mode, size=size, digest=content)


def scan(
    workdir: Path,
    *,
    max_blob_bytes: int,
    index: Index | None,
    warn: Say,
) -> Scan:
    """Read the workdir into a tree (files the stat cache vouches for are not read)."""
    with gc_paused():
        return _scan(workdir, max_blob_bytes=max_blob_bytes, index=index, warn=warn)


def _scan(workdir: Path, *, max_blob_bytes: int, index: Index | None, warn: Say) -> Scan:
    spec = scan_ignore(workdir, index)
    found: dict[str, tuple[str, os.stat_result | str]] = {}  # path -> (kind, stat or target)
    _collect(workdir, "", spec, found, warn, depth=0)
    kept, left_out = keep_links({p: str(v[1]) for p, v in found.items() if v[0] == "symlink"})
    for p, target in left_out.items():
        warn(f"{p}: symlink to {target!r} leaves the workdir or loops; left out")
        del found[p]
    result = Scan(tree="", entries={}, dirs={}, sources={}, stats={})
    if index is not None:
        index.rows.get()  # every file's row is looked up: parsed at once, not searched for
    read_found(workdir, found, result, index, max_blob_bytes)
    result.tree, result.dirs, result.paths = build_paths(result.entries)
    result.links, result.left_out = kept, left_out
    return result


def keep_links(targets: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The symlinks (path -> target) split into those kept and those left out: a link that
    resolves outside the tree, lexically or through the other kept links."""
    links = {p: Entry(name=p.rpartition("/")[2], type="symlink", target=t)
             for p, t in targets.items()}  # fmt: skip
    left_out: dict[str, str] = {}
    while True:  # dropping one link can make another escape (it resolved through it)
        bad = [p for p in links if symlink_escapes(links, p)]
        if not bad:
            break
        for p in bad:
            left_out[p] = links.pop(p).target
    return {p: e.target for p, e in links.items()}, left_out


def read_found(
    workdir: Path,
    found: Mapping[str, tuple[str, os.stat_result | str]],
    into: Scan,
    index: Index | None,
    max_blob_bytes: int,
) -> None:
    """The entries of `found` (symlinks already checked) into `into`: files answered by the
    stat cache or read, with their stat rows and where their blobs can be read."""
    entries, stats, sources = into.entries, into.stats, into.sources
    assert isinstance(stats, dict)  # noqa: S101 - a scan read into holds its own stat rows
    cached = index.cached if index is not None else None
    imode = stat.S_IMODE
    for path, (kind, info) in found.items():
        name = path.rpartition("/")[2]
        if kind == "symlink":
            entries[path] = Entry(name=name, type="symlink", target=str(info))
            continue
        assert isinstance(info, os.stat_result)  # noqa: S101 - files and dirs carry their stat
        if kind == "dir":
            entries[path] = Entry(name, "dir", imode(info.st_mode))
            continue
        if info.st_nlink > 1:
            into.linked.append(path)
        content = cached(path, info) if cached is not None else None
        size = info.st_size
        # A cached single digest is right for a file of at most one blob (`content_ok`).
        if not (content.__class__ is str and size <= max_blob_bytes) and not content_ok(
            content, size, max_blob_bytes
        ):
            info, content = _hash_path(workdir, path, max_blob_bytes)
            size = info.st_size
            into.hashed += 1
        assert content is not None  # noqa: S101 - _hash_path returns one
        mode = imode(info.st_mode)
        into.files += 1
        into.bytes += size
        if content.__class__ is str:
            entries[path] = Entry(name, "file", mode, size, content)
            stats[path] = [size, info.st_mtime_ns, mode, info.st_ino, content, info.st_ctime_ns]
            if content not in sources:
                sources[content] = (path, 0, size)
            continue
        assert isinstance(content, tuple)  # noqa: S101 - chunk digests
        entries[path] = Entry(name, "file", mode, size, chunks=content)
        stats[path] = [size, info.st_mtime_ns, mode, info.st_ino, list(content), info.st_ctime_ns]
        for blob, (offset, length) in zip(content, chunking(size, max_blob_bytes), strict=True):
            sources.setdefault(blob, (path, offset, length))


def under(workdir: Path, path: str) -> str:
    """`workdir / path` as a string, without building a Path (once per file of a scan or an
    upload: pathlib's parsing was a tenth of a first snapshot's CPU)."""
    return f"{os.fspath(workdir)}/{path}"


def _hash_path(
    workdir: Path, path: str, max_blob_bytes: int
) -> tuple[os.stat_result, str | tuple[str, ...]]:
    """Stat (before reading: a change while reading moves the mtime past the cache's) and
    hash one file, never through a symlink; retried when it changes meanwhile."""
    for _ in range(3):
        try:
            fd = os.open(under(workdir, path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise WorkdirChanged(f"{path}: cannot be read ({exc.strerror})") from exc
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise WorkdirChanged(f"{path}: no longer a regular file")
            try:
                content = hash_fd(fd, before.st_size, max_blob_bytes)
            except WorkdirChanged:
                continue
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == (
            before.st_size,
            before.st_mtime_ns,
            before.st_ctime_ns,
        ):
            return before, content
    raise WorkdirChanged(f"{path}: kept changing while it was read")


def _collect(
    root: Path,
    rel: str,
    spec: Ignore | None,
    found: dict[str, tuple[str, os.stat_result | str]],
    warn: Say,
    depth: int,
    keep: Container[str] = (),
    ignored: list[tuple[str, os.stat_result]] | None = None,
) -> None:
    """Every entry under `rel` into `found`, but the directories in `keep`: recorded, not
    entered (a partial scan keeps what it knows of them), and the entries the ignore rules
    match, which go into `ignored` when it is given (with their stat)."""
    if depth >= MAX_DEPTH:
        raise WorkdirError(f"{rel}: directories nested more than {MAX_DEPTH} deep")
    for item in _listing(root, rel):
        name = item.name
        if not _name_wanted(rel, name, warn):
            _left_out(root, rel, name, ignored)
            continue
        try:
            info = item.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while listed
        _collect_entry(root, rel, name, info, spec, found, warn, depth, keep, ignored)


def collect_named(
    root: Path,
    rel: str,
    name: str,
    spec: Ignore | None,
    found: dict[str, tuple[str, os.stat_result | str]],
    warn: Say,
    keep: Container[str] = (),
    ignored: list[tuple[str, os.stat_result]] | None = None,
) -> None:
    """The entry `name` of the directory `rel` into `found` as `_collect` would put it there
    (nothing when it is gone or left out; a directory not in `keep` with all it holds)."""
    if not _name_wanted(rel, name, warn):
        _left_out(root, rel, name, ignored)
        return
    try:
        info = os.lstat(under(root, f"{rel}/{name}" if rel else name))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise WorkdirError(f"{rel or '.'}/{name}: cannot be read ({exc.strerror})") from exc
    depth = rel.count("/") + 1 if rel else 0
    _collect_entry(root, rel, name, info, spec, found, warn, depth, keep, ignored)


def _left_out(
    root: Path, rel: str, name: str, ignored: list[tuple[str, os.stat_result]] | None
) -> None:
    """A name left out of the tree (not UTF-8, too long) into `ignored` as an ignored one,
    when it is given (but the client's own state directory)."""
    if ignored is None or (not rel and name == STATE_DIR):
        return
    path = f"{rel}/{name}" if rel else name
    try:
        ignored.append((path, os.lstat(root / path)))
    except OSError:
        return


def _name_wanted(rel: str, name: str, warn: Say) -> bool:
    if not rel and name == STATE_DIR:
        return False
    if not name_ok(name):
        shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        warn(f"{rel + '/' if rel else ''}{shown}: name is not UTF-8 (or too long); left out")
        return False
    return True


def _collect_entry(
    root: Path,
    rel: str,
    name: str,
    info: os.stat_result,
    spec: Ignore | None,
    found: dict[str, tuple[str, os.stat_result | str]],
    warn: Say,
    depth: int,
    keep: Container[str],
    ignored: list[tuple[str, os.stat_result]] | None = None,
) -> None:
    path = f"{rel}/{name}" if rel else name
    if stat.S_ISDIR(info.st_mode):
        if spec is not None and spec.match_file(path + "/"):
            if ignored is not None:
                ignored.append((path, info))
            return
        found[path] = ("dir", info)
        if path not in keep:
            _collect(root, path, spec, found, warn, depth + 1, (), ignored)
        return
    if spec is None or not spec.match_file(path):
        _collect_one(root, path, info, found, warn)
    elif ignored is not None:
        ignored.append((path, info))


def _collect_one(
    root: Path,
    path: str,
    info: os.stat_result,
    found: dict[str, tuple[str, os.stat_result | str]],
    warn: Say,
) -> None:
    """A file or a symlink into `found` (anything else left out, with a warning)."""
    if stat.S_ISREG(info.st_mode):
        found[path] = ("file", info)
    elif stat.S_ISLNK(info.st_mode):
        target = _link_target(root, path, warn)
        if target is not None:
            found[path] = ("symlink", target)
    else:
        warn(f"{path}: not a regular file, directory or symlink; left out")


def _listing(root: Path, rel: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(root / rel if rel else root) as it:
            return list(it)
    except OSError as exc:
        raise WorkdirError(f"{rel or '.'}: cannot be listed ({exc.strerror})") from exc


def _link_target(root: Path, path: str, warn: Say) -> str | None:
    """The symlink's target, or None (with a warning) when it is left out: not UTF-8, or
    absolute (one that leaves the workdir through `..` is found once the tree is known)."""
    target = os.readlink(root / path)
    try:
        target.encode("utf-8")
    except UnicodeEncodeError:
        warn(f"{path}: symlink target is not UTF-8; left out")
        return None
    if target.startswith("/"):
        warn(f"{path}: symlink to the absolute path {target!r}; left out")
        return None
    return target


def build(entries: Mapping[str, Entry]) -> tuple[str, dict[str, bytes]]:
    """The tree of `entries` (by path; directories included): its root name and every
    directory blob by name (directory digests are computed here)."""
    tree, blobs, _paths = build_paths(entries)
    return tree, blobs


def build_paths(entries: Mapping[str, Entry]) -> tuple[str, dict[str, bytes], dict[str, str]]:
    """`build`, with each directory's blob name by path."""
    children: dict[str, list[str]] = {"": []}
    for path, entry in entries.items():
        children.setdefault(path.rpartition("/")[0], []).append(path)
        if entry.type == "dir":
            children.setdefault(path, [])
    blobs: dict[str, bytes] = {}
    digests: dict[str, str] = {}
    for directory in sorted(children, key=lambda p: -(p.count("/") + (1 if p else 0))):
        own = []
        for path in children[directory]:
            entry = entries[path]
            if entry.type == "dir":
                entry = Entry(name=entry.name, type="dir", mode=entry.mode, digest=digests[path])
            own.append(entry)
        data = encode_dir(own)
        name = blob_name(data)
        blobs[name] = data
        digests[directory] = name
    return digests[""], blobs, digests
