"""A run's workdir as a snapshot tree: scan and upload after the command, check out before.

State of the client, in `<workdir>/.paperclip/` (never snapshotted, never touched by checkout):

- `index.json`: `{"version": 1, "tree": <the tree the workdir last held, or null>, "server",
  "workspace", "files": {path: [size, mtime_ns, mode, ino, digest or [chunks]]}}`, written
  atomically (temporary file + rename) once a checkout or a snapshot is complete. It is a stat
  cache, as git's index: a file whose size, mtime, mode and inode match its entry is not read
  again, unless its mtime is not older than the index file's own (a "racily clean" entry,
  re-hashed). A missing or unreadable index means: hash everything, the last-held tree is empty.
- `dirs.json`: the directory blobs of the last-held tree (`{"tree", "dirs": {name: text}}`),
  so that a checkout knows what the workdir last held without asking the server.
- `checkout.json`: present while a checkout writes (the head and the directories it writes
  into); the next checkout first removes the temporary files (`.paperclip-tmp-*`) it left.

`.paperclipignore` at the workdir's root (gitignore syntax) keeps paths out of snapshots;
`.paperclip/` is always left out. Symlinks are recorded as symlinks, never followed; one whose
target is absolute or leaves the workdir is left out with a warning, as are names that are not
UTF-8 and special files (fifos, sockets, devices).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import io
import json
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Protocol

import pathspec

from paperclip_client.client import BatchFrame
from paperclip_client.errors import BlobDigestMismatch, PaperclipError
from paperclip_client.trees import (
    EMPTY_DIR,
    MAX_NAME_BYTES,
    Entry,
    TreeError,
    blob_name,
    decode_dir,
    encode_dir,
    name_ok,
    symlink_escapes,
)

STATE_DIR = ".paperclip"
INDEX = "index.json"
DIRS = "dirs.json"
JOURNAL = "checkout.json"
IGNORE_FILE = ".paperclipignore"
TMP_PREFIX = ".paperclip-tmp-"
INDEX_VERSION = 1
PIECE = 1024 * 1024
MAX_DEPTH = 256
PROGRESS_EVERY = 2.0
# Blobs up to this size go in batch uploads (when the server's batch limit allows).
SMALL_BLOB = 1024 * 1024
# Requests to the store at once while uploading or fetching (`--transfers`).
TRANSFER_THREADS = 4

type Say = Callable[[str], None]
type Stat = list[Any]  # [size, mtime_ns, mode, ino, digest or [chunks]]


class WorkdirError(PaperclipError):
    """The workdir cannot be snapshotted or checked out as asked."""


class WorkdirChanged(WorkdirError):
    """A file changed while it was being snapshotted."""


class LocalChanges(WorkdirError):
    """Checkout would overwrite or delete local work: `paths` (every one; the message names
    up to 20) differ from both the head and the tree the workdir last held."""

    def __init__(self, paths: Sequence[str]) -> None:
        shown = ", ".join(paths[:20]) + (
            f" (and {len(paths) - 20} more)" if len(paths) > 20 else ""
        )
        super().__init__(
            f"{len(paths)} path(s) in the workdir hold local changes that checkout would"
            f" overwrite: {shown}; keep them elsewhere or pass --discard-local-changes"
        )
        self.paths = list(paths)


@dataclass(frozen=True, slots=True)
class Limits:
    max_blob_bytes: int
    max_batch_bytes: int
    max_batch_blobs: int
    max_find_missing: int = 10_000


class Store(Protocol):
    """What the workdir needs of the content-addressed store (`ClientStore` over the API)."""

    def limits(self) -> Limits: ...
    def find_missing(self, names: Sequence[str]) -> list[str]: ...
    def put(self, name: str, stream: IO[bytes], size: int) -> None: ...
    def put_batch(self, frames: Sequence[BatchFrame]) -> None: ...
    def get(self, name: str, dest: IO[bytes]) -> int: ...


class ClientStore:
    """The store of the client's company, over the API."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._limits: Limits | None = None

    def limits(self) -> Limits:
        if self._limits is None:
            c = self.client.cas_config()
            self._limits = Limits(
                max_blob_bytes=c.max_blob_bytes,
                max_batch_bytes=c.max_batch_bytes,
                max_batch_blobs=c.max_batch_blobs,
                max_find_missing=c.max_find_missing or 10_000,
            )
        return self._limits

    def find_missing(self, names: Sequence[str]) -> list[str]:
        result: list[str] = self.client.cas_find_missing(
            names, batch=self.limits().max_find_missing
        )
        return result

    def put(self, name: str, stream: IO[bytes], size: int) -> None:
        self.client.cas_put(name, stream, size)

    def put_batch(self, frames: Sequence[BatchFrame]) -> None:
        self.client.cas_put_batch(frames)

    def get(self, name: str, dest: IO[bytes]) -> int:
        return int(self.client.cas_get(name, dest))


class Progress:
    """`say("<what>: <done>/<total> bytes")` at most every 2 s while a transfer runs (`add`
    may be called from several threads)."""

    def __init__(self, say: Say, what: str, total: int, every: float = PROGRESS_EVERY) -> None:
        self.say, self.what, self.total, self.every = say, what, total, every
        self.done = 0
        self._next = time.monotonic() + every
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.done += count
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.every
                self.say(f"{self.what}: {self.done}/{self.total} bytes")


# --- the index -------------------------------------------------------------------------------


@dataclass(slots=True)
class Index:
    tree: str | None
    server: str
    workspace: str
    files: dict[str, Stat] = field(default_factory=dict)
    written_ns: int = 0  # the index file's mtime: entries not older are re-hashed

    def cached(self, path: str, st: os.stat_result) -> str | tuple[str, ...] | None:
        """The content `path` had when it was last read, if its stat says it is unchanged."""
        row = self.files.get(path)
        if (
            row is None
            or row[0] != st.st_size
            or row[1] != st.st_mtime_ns
            or row[2] != stat.S_IMODE(st.st_mode)
            or row[3] != st.st_ino
            or st.st_mtime_ns >= self.written_ns
        ):
            return None
        content = row[4]
        return tuple(content) if isinstance(content, list) else content


def _state(workdir: Path) -> Path:
    return workdir / STATE_DIR


# The index last read by this process, by the identity of the file it was read from (device,
# inode, size, mtime, ctime): the CLI's checkout and snapshot read the same file, and a
# rewrite (a new file renamed over it) or any write in place changes the identity.
_last_index: tuple[tuple[object, ...], Index] | None = None
_last_index_lock = threading.Lock()


def load_index(workdir: Path) -> Index | None:
    """The workdir's index, or None when it is missing or unreadable. A file read again
    unchanged is not parsed again: its `files` are shared, never to be changed by callers."""
    global _last_index  # a one-entry cache
    path = _state(workdir) / INDEX
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
            written = info.st_mtime_ns
            with _gc_paused():
                data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != INDEX_VERSION:
        return None
    files = data.get("files")
    tree = data.get("tree")
    if not isinstance(files, dict) or not (tree is None or isinstance(tree, str)):
        return None
    index = Index(
        tree=tree,
        server=str(data.get("server")),
        workspace=str(data.get("workspace")),
        files=files,
        written_ns=written,
    )
    with _last_index_lock:
        _last_index = (identity, index)
    return replace(index)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
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


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(exist_ok=True)
    temp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    with temp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


@_gc_paused()
def save_state(
    workdir: Path,
    *,
    tree: str | None,
    server: str,
    workspace: str,
    files: Mapping[str, Stat],
    dirs: Mapping[str, bytes],
) -> None:
    """Record that the workdir holds `tree` (its directory blobs `dirs`), with the stat cache
    `files`: the directory blobs first, the index last (the index names the tree)."""
    _write_atomic(
        _state(workdir) / DIRS,
        json.dumps(
            {"tree": tree, "dirs": {k: v.decode("utf-8") for k, v in dirs.items()}},
            ensure_ascii=False,
        ).encode(),
    )
    body = {
        "version": INDEX_VERSION,
        "tree": tree,
        "server": server,
        "workspace": workspace,
        "files": dict(files),
    }
    _write_atomic(_state(workdir) / INDEX, json.dumps(body, separators=(",", ":")).encode())


def _load_dirs(workdir: Path) -> dict[str, bytes]:
    try:
        data = json.loads((_state(workdir) / DIRS).read_bytes())
        return {str(k): str(v).encode("utf-8") for k, v in data["dirs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


# --- scanning --------------------------------------------------------------------------------


@dataclass(slots=True)
class Scan:
    """A workdir read as a tree: `entries` by path, the directory blobs, where each content
    blob can be read (`sources`: path, offset, length) and the new stat cache."""

    tree: str
    entries: dict[str, Entry]
    dirs: dict[str, bytes]
    sources: dict[str, tuple[str, int, int]]
    stats: dict[str, Stat]
    files: int = 0
    bytes: int = 0
    hashed: int = 0  # files read (not answered by the stat cache)


def load_ignore(workdir: Path) -> pathspec.GitIgnoreSpec | None:
    try:
        lines = (workdir / IGNORE_FILE).read_text("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _chunking(size: int, max_blob_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each blob of a file of `size` bytes."""
    if size <= max_blob_bytes:
        return [(0, size)]
    return [(o, min(max_blob_bytes, size - o)) for o in range(0, size, max_blob_bytes)]


def _content_ok(content: str | tuple[str, ...] | None, size: int, max_blob_bytes: int) -> bool:
    if content is None:
        return False
    if size <= max_blob_bytes:
        return isinstance(content, str)
    return isinstance(content, tuple) and len(content) == len(_chunking(size, max_blob_bytes))


def hash_fd(fd: int, size: int, max_blob_bytes: int) -> str | tuple[str, ...]:
    """The digest of an open file's content (chunk digests above `max_blob_bytes`)."""
    digests = []
    for _offset, length in _chunking(size, max_blob_bytes):
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


def _file_entry(name: str, mode: int, size: int, content: str | tuple[str, ...]) -> Entry:
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
    with _gc_paused():
        return _scan(workdir, max_blob_bytes=max_blob_bytes, index=index, warn=warn)


def _scan(workdir: Path, *, max_blob_bytes: int, index: Index | None, warn: Say) -> Scan:
    spec = load_ignore(workdir)
    found: dict[str, tuple[str, os.stat_result | str]] = {}  # path -> (kind, stat or target)
    _collect(workdir, "", spec, found, warn, depth=0)
    links = {p: Entry(name=p.rpartition("/")[2], type="symlink", target=str(v[1]))
             for p, v in found.items() if v[0] == "symlink"}  # fmt: skip
    while True:  # dropping one link can make another escape (it resolved through it)
        shape = {p: Entry(name="", type="dir") for p, v in found.items() if v[0] == "dir"}
        shape.update(links)
        bad = [p for p in links if symlink_escapes(shape, p)]
        if not bad:
            break
        for p in bad:
            warn(f"{p}: symlink to {links[p].target!r} leaves the workdir; left out")
            del links[p]
            del found[p]
    entries: dict[str, Entry] = {}
    stats: dict[str, Stat] = {}
    sources: dict[str, tuple[str, int, int]] = {}
    result = Scan(tree="", entries=entries, dirs={}, sources=sources, stats=stats)
    cached = index.cached if index is not None else None
    imode = stat.S_IMODE
    for path, (kind, info) in found.items():
        name = path.rpartition("/")[2]
        if kind == "symlink":
            entries[path] = links[path]
            continue
        assert isinstance(info, os.stat_result)  # noqa: S101 - files and dirs carry their stat
        if kind == "dir":
            entries[path] = Entry(name, "dir", imode(info.st_mode))
            continue
        content = cached(path, info) if cached is not None else None
        size = info.st_size
        # A cached single digest is right for a file of at most one blob (`_content_ok`).
        if not (content.__class__ is str and size <= max_blob_bytes) and not _content_ok(
            content, size, max_blob_bytes
        ):
            info, content = _hash_path(workdir, path, max_blob_bytes)
            size = info.st_size
            result.hashed += 1
        assert content is not None  # noqa: S101 - _hash_path returns one
        mode = imode(info.st_mode)
        result.files += 1
        result.bytes += size
        if content.__class__ is str:
            entries[path] = Entry(name, "file", mode, size, content)
            stats[path] = [size, info.st_mtime_ns, mode, info.st_ino, content]
            if content not in sources:
                sources[content] = (path, 0, size)
            continue
        assert isinstance(content, tuple)  # noqa: S101 - chunk digests
        entries[path] = Entry(name, "file", mode, size, chunks=content)
        stats[path] = [size, info.st_mtime_ns, mode, info.st_ino, list(content)]
        for blob, (offset, length) in zip(content, _chunking(size, max_blob_bytes), strict=True):
            sources.setdefault(blob, (path, offset, length))
    result.tree, result.dirs = build(entries)
    return result


def _under(workdir: Path, path: str) -> str:
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
            fd = os.open(_under(workdir, path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
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
        if (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns):
            return before, content
    raise WorkdirChanged(f"{path}: kept changing while it was read")


def _collect(
    root: Path,
    rel: str,
    spec: pathspec.GitIgnoreSpec | None,
    found: dict[str, tuple[str, os.stat_result | str]],
    warn: Say,
    depth: int,
) -> None:
    if depth >= MAX_DEPTH:
        raise WorkdirError(f"{rel}: directories nested more than {MAX_DEPTH} deep")
    try:
        with os.scandir(root / rel if rel else root) as it:
            items = list(it)
    except OSError as exc:
        raise WorkdirError(f"{rel or '.'}: cannot be listed ({exc.strerror})") from exc
    for item in items:
        name = item.name
        path = f"{rel}/{name}" if rel else name
        if not rel and name == STATE_DIR:
            continue
        if not name_ok(name):
            shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            warn(f"{rel + '/' if rel else ''}{shown}: name is not UTF-8 (or too long); left out")
            continue
        try:
            info = item.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed while listed
        if stat.S_ISDIR(info.st_mode):
            if spec is not None and spec.match_file(path + "/"):
                continue
            found[path] = ("dir", info)
            _collect(root, path, spec, found, warn, depth + 1)
            continue
        if spec is not None and spec.match_file(path):
            continue
        if stat.S_ISREG(info.st_mode):
            found[path] = ("file", info)
        elif stat.S_ISLNK(info.st_mode):
            target = os.readlink(root / path)
            try:
                target.encode("utf-8")
            except UnicodeEncodeError:
                warn(f"{path}: symlink target is not UTF-8; left out")
                continue
            if target.startswith("/"):
                warn(f"{path}: symlink to the absolute path {target!r}; left out")
                continue
            found[path] = ("symlink", target)
        else:
            warn(f"{path}: not a regular file, directory or symlink; left out")


def build(entries: Mapping[str, Entry]) -> tuple[str, dict[str, bytes]]:
    """The tree of `entries` (by path; directories included): its root name and every
    directory blob by name (directory digests are computed here)."""
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
    return digests[""], blobs


# --- uploading -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    tree: str
    files: int
    bytes: int
    uploaded: int
    scan: Scan


def upload(
    store: Store,
    workdir: Path,
    found: Scan,
    *,
    say: Say,
    threads: int = TRANSFER_THREADS,
    known: Collection[str] = frozenset(),
) -> int:
    """Upload the blobs of `found` that the store lacks; the bytes sent. Batches and large
    blobs are sent by up to `threads` requests at once. Batch bodies are streamed from the
    files (never held in memory) and not hashed again: the store checks every blob, and a
    mismatch means the file changed since the scan (`WorkdirChanged`). Names in `known` are
    taken as stored without asking (`stored_by_index`)."""
    limits = store.limits()
    names = [n for n in found.sources if n not in known]
    names += [n for n in found.dirs if n not in found.sources and n not in known]
    missing = store.find_missing(names)
    del names
    total = sum(len(found.dirs[n]) if n in found.dirs else found.sources[n][2] for n in missing)
    progress = Progress(say, "upload", total)
    small_limit = min(SMALL_BLOB, limits.max_batch_bytes // 4)

    def batch(frames: list[BatchFrame]) -> Callable[[], None]:
        def send() -> None:
            _put_batch(store, found, frames)
            progress.add(sum(f.size for f in frames))

        return send

    def large(name: str, size: int) -> Callable[[], None]:
        def send() -> None:
            _put_large(store, workdir, found, name, size)
            progress.add(size)

        return send

    def jobs() -> Iterator[Callable[[], None]]:
        frames: list[BatchFrame] = []
        frame_bytes = 0
        for name in missing:
            frame = _frame(workdir, found, name)
            if frame.size > small_limit:
                yield large(name, frame.size)
                continue
            framed = len(name) + 24 + frame.size
            if frames and (
                frame_bytes + framed > limits.max_batch_bytes
                or len(frames) >= limits.max_batch_blobs
            ):
                yield batch(frames)
                frames, frame_bytes = [], 0
            frames.append(frame)
            frame_bytes += framed
        if frames:
            yield batch(frames)

    run_parallel(jobs(), threads)
    return total


def run_parallel(jobs: Iterable[Callable[[], None]], threads: int) -> None:
    """Run `jobs` on up to `threads` threads (in the caller's when 1), taking the next ones
    from the iterator only as earlier ones finish; the first failure cancels the jobs not
    started, waits for the running ones and is raised."""
    if threads <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="paperclip-transfer") as pool:
        pending: set[Future[None]] = set()
        try:
            for job in jobs:
                pending.add(pool.submit(job))
                while len(pending) >= 2 * threads:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
        except BaseException:
            for future in pending:
                future.cancel()
            raise


def _frame(workdir: Path, found: Scan, name: str) -> BatchFrame:
    data = found.dirs.get(name)
    if data is not None:
        return BatchFrame(name, len(data), lambda: (data,))
    path, offset, length = found.sources[name]
    return BatchFrame(name, length, lambda: _read_source(workdir, path, offset, length))


def _read_source(workdir: Path, path: str, offset: int, length: int) -> Iterator[bytes]:
    """`length` bytes of the file at `path` from `offset`, in pieces (a file that no longer
    has them: `WorkdirChanged`; one whose bytes changed is the store's mismatch)."""
    try:
        fd = os.open(_under(workdir, path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc
    try:
        while length > 0:
            piece = os.pread(fd, min(PIECE, length), offset)
            if not piece:
                raise WorkdirChanged(f"{path}: changed while it was snapshotted")
            offset += len(piece)
            length -= len(piece)
            yield piece
    finally:
        os.close(fd)


def _put_batch(store: Store, found: Scan, frames: Sequence[BatchFrame]) -> None:
    try:
        store.put_batch(frames)
    except BlobDigestMismatch as exc:
        digest = str(exc.details.get("digest", ""))
        path = found.sources[digest][0] if digest in found.sources else "a file"
        raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc


def _put_large(store: Store, workdir: Path, found: Scan, name: str, size: int) -> None:
    if name in found.dirs:
        store.put(name, io.BytesIO(found.dirs[name]), size)
        return
    path, offset, length = found.sources[name]
    try:
        handle = open(workdir / path, "rb", opener=_nofollow)  # noqa: SIM115 - closed below
    except OSError as exc:
        raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc
    with handle:
        handle.seek(offset)
        try:
            store.put(name, handle, length)
        except BlobDigestMismatch as exc:
            raise WorkdirChanged(f"{path}: changed while it was snapshotted") from exc


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


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
    known: set[str] = set(_load_dirs(workdir))
    for row in index.files.values():
        content = row[4] if isinstance(row, list) and len(row) > 4 else None
        if isinstance(content, str):
            known.add(content)
        elif isinstance(content, list):
            known.update(c for c in content if isinstance(c, str))
    return known


def snapshot(
    store: Store,
    workdir: Path,
    *,
    say: Say,
    warn: Say,
    attempts: int = 3,
    threads: int = TRANSFER_THREADS,
    trust_index: tuple[str, str] | None = None,
) -> SnapshotResult:
    """Scan the workdir (with its stat cache) and upload what the store lacks. The index is
    not written here: `commit_snapshot` does it once the snapshot is registered.
    `trust_index` (server, workspace): blobs the index names for them are not asked about
    (`stored_by_index`)."""
    limits = store.limits()
    for attempt in range(attempts):
        index = load_index(workdir)
        found = scan(workdir, max_blob_bytes=limits.max_blob_bytes, index=index, warn=warn)
        known = (
            stored_by_index(workdir, index, server=trust_index[0], workspace=trust_index[1])
            if trust_index is not None
            else set()
        )
        try:
            uploaded = upload(store, workdir, found, say=say, threads=threads, known=known)
        except WorkdirChanged as exc:
            if attempt == attempts - 1:
                raise
            say(f"snapshot: {exc}; scanning again")
            continue
        return SnapshotResult(found.tree, found.files, found.bytes, uploaded, found)
    raise AssertionError("unreachable")


def commit_snapshot(workdir: Path, result: SnapshotResult, *, server: str, workspace: str) -> None:
    save_state(
        workdir,
        tree=result.tree,
        server=server,
        workspace=workspace,
        files=result.scan.stats,
        dirs=result.scan.dirs,
    )


# --- checkout --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckoutResult:
    tree: str | None
    files: int
    fetched: int  # bytes over the network (file contents and directory blobs)
    written: int  # paths created, replaced or removed


def read_tree(
    tree: str | None, load: Callable[[str], bytes], dirs: dict[str, bytes] | None = None
) -> dict[str, Entry]:
    """Every entry of `tree` by path, each directory blob checked (`dirs` collects them)."""
    entries: dict[str, Entry] = {}
    if tree is None:
        return entries
    stack: list[tuple[str, str, tuple[str, ...]]] = [("", tree, ())]
    while stack:
        path, digest, chain = stack.pop()
        if digest in chain or len(chain) > MAX_DEPTH:
            raise TreeError(path, "cycle" if digest in chain else "too_deep")
        data = load(digest)
        if blob_name(data) != digest:
            raise TreeError(path, "digest_mismatch")
        if dirs is not None:
            dirs[digest] = data
        for entry in decode_dir(data, path):
            where = f"{path}/{entry.name}" if path else entry.name
            entries[where] = entry
            if entry.type == "dir":
                assert entry.digest is not None  # noqa: S101 - decode_dir checked it
                stack.append((where, entry.digest, (*chain, digest)))
    for where, entry in entries.items():
        if entry.type == "symlink" and symlink_escapes(entries, where):
            raise TreeError(where, "escaping_symlink")
    return entries


class _Dirs:
    """Directories of the workdir opened one component at a time with O_NOFOLLOW: a symlink
    in the workdir is never followed (opening through one fails)."""

    FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW

    def __init__(self, root: Path) -> None:
        self.root = os.open(root, self.FLAGS)
        self.fds: dict[str, int] = {"": self.root}

    def open(self, rel: str) -> int:
        fd = self.fds.get(rel)
        if fd is not None:
            return fd
        parent, _, name = rel.rpartition("/")
        parent_fd = self.open(parent)
        if len(self.fds) > 256:
            self.forget("")
            parent_fd = self.open(parent)
        fd = os.open(name, self.FLAGS, dir_fd=parent_fd)
        self.fds[rel] = fd
        return fd

    def try_open(self, rel: str) -> int | None:
        try:
            return self.open(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise

    def forget(self, rel: str) -> None:
        """Close what is open at or under `rel` (all but the root for "")."""
        for key in [k for k in self.fds if k and (not rel or k == rel or k.startswith(rel + "/"))]:
            os.close(self.fds.pop(key))

    def close(self) -> None:
        self.forget("")
        os.close(self.root)


_SPECIAL = Entry(name="", type="symlink", target="\0")  # a fifo, socket or device


class _Prefetch:
    """Small blobs fetched ahead by up to `threads` requests at once, in the order checkout
    will write them (`take` them in that order); at most `4 * threads` held at a time."""

    def __init__(self, store: Store, names: Sequence[str], threads: int) -> None:
        self.store = store
        self.names = iter(names)
        self.ahead = 4 * threads
        self.futures: dict[str, Future[bytes]] = {}
        self.pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="paperclip-fetch")
            if threads > 1 and names
            else None
        )
        self._fill()

    def _get(self, name: str) -> bytes:
        buffer = io.BytesIO()
        self.store.get(name, buffer)
        return buffer.getvalue()

    def _fill(self) -> None:
        if self.pool is None:
            return
        while len(self.futures) < self.ahead:
            name = next(self.names, None)
            if name is None:
                return
            self.futures[name] = self.pool.submit(self._get, name)

    def take(self, name: str) -> bytes | None:
        """The blob's bytes if it was fetched ahead (checked by the store), else None."""
        future = self.futures.pop(name, None)
        if future is None:
            return None
        self._fill()
        return future.result()

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
        self.futures.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class _Checkout:
    def __init__(
        self,
        store: Store,
        workdir: Path,
        index: Index | None,
        limits: Limits,
        say: Say,
    ) -> None:
        self.store = store
        self.workdir = workdir
        self.index = index
        self.limits = limits
        self.say = say
        self.dirs = _Dirs(workdir)
        self.stats: dict[str, Stat] = {}
        self.local: dict[str | tuple[str, ...], str] = {}  # content -> a workdir path holding it
        self.fetched = 0
        self.written = 0
        self.progress: Progress | None = None
        self.prefetch: _Prefetch | None = None

    # what is there now -------------------------------------------------------------------

    def current(self, path: str) -> Entry | None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.try_open(parent)
        if fd is None:
            return None
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISDIR(info.st_mode):
            return Entry(name=name, type="dir", mode=mode)
        if stat.S_ISLNK(info.st_mode):
            return Entry(name=name, type="symlink", target=os.readlink(name, dir_fd=fd))
        if not stat.S_ISREG(info.st_mode):
            return _SPECIAL
        content = self.index.cached(path, info) if self.index is not None else None
        if not _content_ok(content, info.st_size, self.limits.max_blob_bytes):
            file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
            try:
                content = hash_fd(file_fd, info.st_size, self.limits.max_blob_bytes)
            finally:
                os.close(file_fd)
        assert content is not None  # noqa: S101 - hashed above when the cache had none
        self.local.setdefault(content, path)
        self.stats[path] = [
            info.st_size,
            info.st_mtime_ns,
            mode,
            info.st_ino,
            list(content) if isinstance(content, tuple) else content,
        ]
        return _file_entry(name, mode, info.st_size, content)

    def untracked_under(self, path: str, base: Mapping[str, Entry]) -> list[str]:
        """Paths under the workdir directory `path` that the last-held tree does not have."""
        fd = self.dirs.try_open(path)
        if fd is None:
            return []
        found: list[str] = []
        with os.scandir(fd) as it:
            for item in it:
                where = f"{path}/{item.name}"
                if where not in base:
                    found.append(where)
                elif item.is_dir(follow_symlinks=False):
                    found.extend(self.untracked_under(where, base))
        return found

    # writing -----------------------------------------------------------------------------

    def remove(self, path: str, *, force: bool) -> None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.try_open(parent)
        if fd is None:
            return
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        self.written += 1
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=fd)
            return
        self.dirs.forget(path)
        if force:
            shutil.rmtree(name, dir_fd=fd)  # fd-based: never follows a symlink
            return
        with contextlib.suppress(OSError):  # not empty: untracked files stay, as in git
            os.rmdir(name, dir_fd=fd)

    def make_dir(self, path: str, mode: int) -> None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.open(parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=fd)
            self.written += 1
        os.chmod(self.dirs.open(path), mode)

    def set_mode(self, path: str, mode: int) -> None:
        parent, _, name = path.rpartition("/")
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.dirs.open(parent)
        )
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        self.written += 1
        self.stats[path][2] = mode

    def make_symlink(self, path: str, target: str) -> None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.open(parent)
        temp = _temp_name()
        os.symlink(target, temp, dir_fd=fd)
        os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        self.written += 1

    def write_file(self, path: str, entry: Entry) -> None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.open(parent)
        temp = _temp_name()
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            with os.fdopen(out, "wb", closefd=False) as handle:
                ahead = (
                    self.prefetch.take(entry.digest)
                    if self.prefetch is not None and entry.digest is not None
                    else None
                )
                if ahead is not None:
                    handle.write(ahead)
                    self.fetched += len(ahead)
                    if self.progress is not None:
                        self.progress.add(len(ahead))
                elif not self._copy_local(entry, handle):
                    handle.seek(0)
                    handle.truncate()
                    for blob in entry.blobs():
                        got = self.store.get(blob, handle)
                        self.fetched += got
                        if self.progress is not None:
                            self.progress.add(got)
                if handle.tell() != entry.size:
                    raise WorkdirError(f"{path}: the store's blobs do not add up to its size")
            os.fchmod(out, entry.mode)
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)
            raise
        info = os.fstat(out)
        os.close(out)
        os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        self.written += 1
        content = list(entry.chunks) if entry.chunks is not None else entry.digest
        self.stats[path] = [info.st_size, info.st_mtime_ns, entry.mode, info.st_ino, content]
        key = entry.chunks if entry.chunks is not None else entry.digest
        if key is not None:
            self.local[key] = path

    def _copy_local(self, entry: Entry, handle: IO[bytes]) -> bool:
        """Copy the content from a workdir file known to hold it, checking it as it goes."""
        key = entry.chunks if entry.chunks is not None else entry.digest
        source = self.local.get(key) if key is not None else None
        if source is None:
            return False
        parent, _, name = source.rpartition("/")
        fd = self.dirs.try_open(parent)
        if fd is None:
            return False
        try:
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError:
            return False
        try:
            digests = []
            for _offset, length in _chunking(entry.size, self.limits.max_blob_bytes):
                h = hashlib.sha256()
                left = length
                while left > 0:
                    piece = os.read(src, min(PIECE, left))
                    if not piece:
                        return False
                    h.update(piece)
                    handle.write(piece)
                    left -= len(piece)
                digests.append("sha256:" + h.hexdigest())
        finally:
            os.close(src)
        return digests == list(entry.blobs())

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        self.dirs.close()


def _temp_name() -> str:
    return f"{TMP_PREFIX}{uuid.uuid4().hex}"


def _same(current: Entry | None, wanted: Entry | None) -> bool:
    """Whether the workdir's entry is `wanted` for the local-work rule (a directory by type)."""
    if current is None or wanted is None:
        return current is wanted
    if current.type == "dir" or wanted.type == "dir":
        return current.type == wanted.type
    return current.same(wanted)


def _clean_leftovers(workdir: Path) -> None:
    """Remove the temporary files an interrupted checkout left in the directories it wrote."""
    try:
        journal = json.loads((_state(workdir) / JOURNAL).read_bytes())
        dirs = [str(d) for d in journal.get("dirs", [])]
    except (OSError, ValueError, AttributeError):
        return
    opener = _Dirs(workdir)
    try:
        for rel in dirs:
            fd = opener.try_open(rel)
            if fd is None:
                continue
            with os.scandir(fd) as it:
                stale = [i.name for i in it if i.name.startswith(TMP_PREFIX)]
            for name in stale:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
    finally:
        opener.close()


def checkout(
    store: Store,
    workdir: Path,
    head: str | None,
    *,
    server: str,
    workspace: str,
    discard_local_changes: bool = False,
    say: Say,
    threads: int = TRANSFER_THREADS,
) -> CheckoutResult:
    """Make the workdir hold `head` (None: the empty tree). Only paths where `head` differs
    from the tree the workdir last held are touched; each of them whose content is neither
    of the two is local work: `LocalChanges` before anything is written, unless
    `discard_local_changes`. File contents come from the workdir itself when a file there
    holds them (checked while copied), else from the store (small blobs fetched by up to
    `threads` requests at once)."""
    index = load_index(workdir)
    journal = _state(workdir) / JOURNAL
    same_place = index is not None and index.server == server and index.workspace == workspace
    base_tree = index.tree if index is not None and same_place else None
    if base_tree == head and index is not None and not journal.exists():
        return CheckoutResult(head, len(index.files), 0, 0)
    _clean_leftovers(workdir)
    limits = store.limits()
    cached = _load_dirs(workdir)
    dir_bytes = 0

    def load(name: str) -> bytes:
        nonlocal dir_bytes
        data = cached.get(name)
        if data is None or blob_name(data) != name:
            buffer = io.BytesIO()
            dir_bytes += store.get(name, buffer)
            data = buffer.getvalue()
        return data

    head_dirs: dict[str, bytes] = {}
    wanted = read_tree(head, load, head_dirs)
    try:
        base = read_tree(base_tree, load)
    except (TreeError, PaperclipError):
        base = {}  # unknown: every difference from the head counts as local work
    changed = sorted(p for p in set(wanted) | set(base) if not _both(wanted.get(p), base.get(p)))
    work = _Checkout(store, workdir, index, limits, say)
    try:
        current = {p: work.current(p) for p in changed}
        conflicts = [
            p
            for p in changed
            if not _same(current[p], wanted.get(p)) and not _same(current[p], base.get(p))
        ]
        for p in changed:
            cur, want = current[p], wanted.get(p)
            if cur is not None and cur.type == "dir" and want is not None and want.type != "dir":
                conflicts.extend(work.untracked_under(p, base))
        # A directory both trees have that is no longer one in the workdir (a symlink put in
        # its place, say) must be made again before anything is written under it.
        broken = _broken_parents(work, changed, wanted, current)
        conflicts.extend(broken)
        if conflicts and not discard_local_changes:
            raise LocalChanges(sorted(set(conflicts)))
        parents = sorted({p.rpartition("/")[0] for p in changed})
        _write_atomic(journal, json.dumps({"tree": head, "dirs": parents}).encode())
        work.progress = Progress(say, "checkout", _to_fetch(wanted, changed, current))
        work.prefetch = _Prefetch(store, _ahead(wanted, changed, current, work.local), threads)
        for p in broken:
            work.remove(p, force=True)
            work.make_dir(p, wanted[p].mode)
        for p in changed:
            want = wanted.get(p)
            if want is None:
                continue
            cur = current[p]
            if cur is not None and cur.type != want.type:
                work.remove(p, force=True)  # checked above: tracked content or discarded
                cur = None
            if want.type == "dir":
                work.make_dir(p, want.mode)
            elif want.type == "symlink":
                if cur is None or cur.target != want.target:
                    work.make_symlink(p, want.target)
            elif cur is not None and cur.same(want):
                continue
            elif cur is not None and cur.blobs() == want.blobs():
                work.set_mode(p, want.mode)
            else:
                work.write_file(p, want)
        # Removals last (a removed file may be the local copy of a new one), deepest first.
        for p in sorted((p for p in changed if p not in wanted), key=_depth, reverse=True):
            work.remove(p, force=discard_local_changes)
    finally:
        work.close()
    files = _new_stats(wanted, changed, index, work.stats)
    save_state(workdir, tree=head, server=server, workspace=workspace, files=files, dirs=head_dirs)
    with contextlib.suppress(FileNotFoundError):
        journal.unlink()
    count = sum(1 for e in wanted.values() if e.type == "file")
    return CheckoutResult(head, count, work.fetched + dir_bytes, work.written)


def _broken_parents(
    work: _Checkout,
    changed: Sequence[str],
    wanted: Mapping[str, Entry],
    current: Mapping[str, Entry | None],
) -> list[str]:
    touched = set(changed)
    broken: set[str] = set()
    checked: set[str] = set()
    for p in changed:
        if p not in wanted:
            continue
        parts = p.split("/")[:-1]
        for depth in range(1, len(parts) + 1):
            a = "/".join(parts[:depth])
            if a in touched or a in checked:
                continue
            checked.add(a)
            cur = current.get(a) if a in current else work.current(a)
            if cur is None or cur.type != "dir":
                broken.add(a)
                break
    return sorted(broken)


def _ahead(
    wanted: Mapping[str, Entry],
    changed: Sequence[str],
    current: Mapping[str, Entry | None],
    local: Mapping[str | tuple[str, ...], str],
) -> list[str]:
    """The small blobs checkout will fetch, in the order it writes their files (each once;
    none that a workdir file already holds): what `checkout`'s loop sends to `write_file`."""
    names: list[str] = []
    seen: set[str] = set()
    for p in changed:
        want = wanted.get(p)
        if want is None or want.type != "file" or want.digest is None:
            continue
        cur = current[p]
        if cur is not None and cur.type != want.type:
            cur = None
        if cur is not None and (cur.same(want) or cur.blobs() == want.blobs()):
            continue
        if want.size > SMALL_BLOB or want.digest in seen or want.digest in local:
            continue
        seen.add(want.digest)
        names.append(want.digest)
    return names


def _both(a: Entry | None, b: Entry | None) -> bool:
    return (a is None and b is None) or (a is not None and a.same(b))


def _depth(path: str) -> int:
    return path.count("/")


def _to_fetch(
    wanted: Mapping[str, Entry], changed: Sequence[str], current: Mapping[str, Entry | None]
) -> int:
    total = 0
    for p in changed:
        want, cur = wanted.get(p), current.get(p)
        if (
            want is not None
            and want.type == "file"
            and (cur is None or cur.blobs() != want.blobs())
        ):
            total += want.size
    return total


def _new_stats(
    wanted: Mapping[str, Entry],
    changed: Sequence[str],
    index: Index | None,
    fresh: Mapping[str, Stat],
) -> dict[str, Stat]:
    """The stat cache after a checkout: what was read or written now, else what the old
    index knew (a stat cache entry stays right whatever tree it came from)."""
    touched = set(changed)
    files: dict[str, Stat] = {}
    for path, entry in wanted.items():
        if entry.type != "file":
            continue
        if path in fresh:
            files[path] = fresh[path]
        elif path not in touched and index is not None and path in index.files:
            files[path] = index.files[path]
    return files


def iter_names(entries: Mapping[str, Entry]) -> Iterator[str]:
    for entry in entries.values():
        yield from entry.blobs()


__all__ = [
    "EMPTY_DIR",
    "MAX_NAME_BYTES",
    "TRANSFER_THREADS",
    "BatchFrame",
    "CheckoutResult",
    "ClientStore",
    "Index",
    "Limits",
    "LocalChanges",
    "SnapshotResult",
    "Store",
    "WorkdirChanged",
    "WorkdirError",
    "build",
    "checkout",
    "commit_snapshot",
    "load_index",
    "scan",
    "snapshot",
    "upload",
]
