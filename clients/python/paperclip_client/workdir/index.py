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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

STATE_DIR = ".paperclip"
INDEX = "index.json"
DIRS = "dirs.json"
JOURNAL = "checkout.json"
INDEX_VERSION = 1
type Stat = list[Any]  # [size, mtime_ns, mode, ino, digest or [chunks]]


# --- the index -------------------------------------------------------------------------------


@dataclass(slots=True)
class Index:
    tree: str | None
    server: str
    workspace: str
    files: dict[str, Stat] = field(default_factory=dict)
    written_ns: int = 0  # the index file's mtime: entries not older are re-hashed
    id: str = ""  # new at each write: what the watcher's state (`watch.json`) goes with

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

    def records(
        self, *, tree: str | None, server: str, workspace: str, files: Mapping[str, Stat]
    ) -> bool:
        """Whether this index already says exactly that: the same tree for the same server
        and workspace, the same stat cache, and no entry racily clean (modified in or after
        the index file's timestamp tick: every scan reads it again until the index is
        rewritten). Rewriting it then would change nothing but its mtime."""
        return (
            self.tree == tree
            and self.server == server
            and self.workspace == workspace
            and self.files == files
            and all(row[1] < self.written_ns for row in files.values())
        )


def state_path(workdir: Path) -> Path:
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
            written = info.st_mtime_ns
            with gc_paused():
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
        id=str(data.get("id") or ""),
    )
    with _last_index_lock:
        _last_index = (identity, index)
    return replace(index)


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


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(exist_ok=True)
    temp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    with temp.open("wb") as handle:
        handle.write(data)
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
    files: Mapping[str, Stat],
    dirs: Mapping[str, bytes],
) -> str:
    """Record that the workdir holds `tree` (its directory blobs `dirs`), with the stat cache
    `files`: the directory blobs first, the index last (the index names the tree). Returns
    the new index's id."""
    write_atomic(
        state_path(workdir) / DIRS,
        json.dumps(
            {"tree": tree, "dirs": {k: v.decode("utf-8") for k, v in dirs.items()}},
            ensure_ascii=False,
        ).encode(),
    )
    index_id = uuid.uuid4().hex
    body = {
        "version": INDEX_VERSION,
        "id": index_id,
        "tree": tree,
        "server": server,
        "workspace": workspace,
        "files": dict(files),
    }
    write_atomic(state_path(workdir) / INDEX, json.dumps(body, separators=(",", ":")).encode())
    return index_id


def load_dirs(workdir: Path) -> dict[str, bytes]:
    try:
        data = json.loads((state_path(workdir) / DIRS).read_bytes())
        return {str(k): str(v).encode("utf-8") for k, v in data["dirs"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


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
