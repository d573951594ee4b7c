"""Reading a directory on disk as a tree (docs/snapshots.md#adopting-an-existing-cwd): what
adopting a `cwd` records, and what the tests compare a materialized directory with. Symlinks are
read, never followed; plain filesystem code, no database."""

from __future__ import annotations

import hashlib
import os
import stat

from paperclip.snapshots.dirfd import DIR_FLAGS, READ_FLAGS
from paperclip.snapshots.materialize import CHUNK_BYTES
from paperclip.snapshots.trees import (
    MAX_DEPTH,
    MAX_SYMLINK_TARGET_BYTES,
    Entry,
    TreeInvalid,
    blob_name,
    encode_dir,
    name_problem,
)


def read_tree(
    root: str, *, max_blob_bytes: int | None = None, leave_out: frozenset[str] = frozenset()
) -> dict[str, Entry]:
    """The entries of the directory `root` by path, as `Walk.entries` has them for the same
    tree (directory digests included; a file larger than `max_blob_bytes`, when given, in
    chunks of that size), but for the names of `leave_out` at its top. Symlinks are read,
    never followed. Raises TreeInvalid for anything a tree cannot hold (a FIFO, a socket, a
    device, a name that is not UTF-8, directories nested deeper than a tree may be, a link
    whose target no filesystem would write back)."""
    entries: dict[str, Entry] = {}
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _read_dir(fd, "", entries, max_blob_bytes, leave_out)
    finally:
        os.close(fd)
    return entries


def _read_dir(
    fd: int,
    path: str,
    entries: dict[str, Entry],
    max_blob_bytes: int | None,
    leave_out: frozenset[str] = frozenset(),
    depth: int = 0,
) -> list[Entry]:
    own: list[Entry] = []
    if depth > MAX_DEPTH:
        raise TreeInvalid(path, "too_deep")
    for name in sorted(os.listdir(fd)):
        if name in leave_out:
            continue
        where = f"{path}/{name}" if path else name
        if name_problem(name):
            raise TreeInvalid(where, "bad_name")
        found = os.stat(name, dir_fd=fd, follow_symlinks=False)
        mode = stat.S_IMODE(found.st_mode)
        if stat.S_ISDIR(found.st_mode):
            child = os.open(name, DIR_FLAGS, dir_fd=fd)
            try:
                inner = _read_dir(child, where, entries, max_blob_bytes, depth=depth + 1)
            finally:
                os.close(child)
            entry = Entry(name=name, type="dir", mode=mode, digest=blob_name(encode_dir(inner)))
        elif stat.S_ISREG(found.st_mode):
            pieces = _hash_pieces(name, fd, max_blob_bytes)
            entry = Entry(
                name=name,
                type="file",
                mode=mode,
                size=found.st_size,
                digest=pieces[0] if len(pieces) == 1 else None,
                chunks=tuple(pieces) if len(pieces) > 1 else None,
            )
        elif stat.S_ISLNK(found.st_mode):
            target = os.readlink(name, dir_fd=fd)
            if len(os.fsencode(target)) > MAX_SYMLINK_TARGET_BYTES:
                raise TreeInvalid(where, "symlink_target_too_long")
            entry = Entry(name=name, type="symlink", target=target)
        else:
            raise TreeInvalid(where, "unsupported_type")
        entries[where] = entry
        own.append(entry)
    return own


def _hash_pieces(name: str, dir_fd: int, piece: int | None) -> list[str]:
    """The blob names of a file's content: one, or pieces of `piece` bytes when larger."""
    source = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    pieces: list[str] = []
    try:
        digest, filled = hashlib.sha256(), 0
        while data := os.read(source, CHUNK_BYTES if piece is None else min(CHUNK_BYTES, piece)):
            view = memoryview(data)
            while view:
                take = len(view) if piece is None else min(len(view), piece - filled)
                digest.update(view[:take])
                filled += take
                view = view[take:]
                if piece is not None and filled == piece:
                    pieces.append("sha256:" + digest.hexdigest())
                    digest, filled = hashlib.sha256(), 0
    finally:
        os.close(source)
    if filled or not pieces:
        pieces.append("sha256:" + digest.hexdigest())
    return pieces
