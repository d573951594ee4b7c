"""Checkpoints of a session directory: save what changed, restore into an empty directory.

Storage layout, in the run's checkpoint parts (text, so file bytes are base64):

- `blob:<sha256>`: one chunk of file contents, named by the hash of its bytes. A file is a
  list of chunks (none for an empty file), each at most what fits in one part once encoded.
- `header`: JSON, written last, `{"format", "recoveryEvidence": {"normalizedSessionId"},
  "files": {path: {"size", "sha256", "mode", "chunks": [part, ...]}}, "dirs": [path, ...]}`.

A save uploads only the chunks the previous save did not store, and removes only the chunks no
file refers to any more. Because chunks are named by content and the header comes in the last
write, a checkpoint split over several writes (bigger than one write allows) is never seen
half-made: until the last write lands, the old header still names only chunks that exist.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from paperclip_client.client import Client

# Defined with the other error classes, so that the CLI catches it without importing this module.
from paperclip_client.errors import CheckpointError as CheckpointError

FORMAT = "paperclip-client/session-v1"
HEADER = "header"
BLOB = "blob:"
# The server's defaults (PAPERCLIP_CHECKPOINT_MAX_PART_BYTES / _MAX_WRITE_BYTES /
# _MAX_PARTS_PER_WRITE); pass smaller ones if the server is configured lower.
MAX_PART_BYTES = 8 * 1024 * 1024
MAX_WRITE_BYTES = 16 * 1024 * 1024
MAX_PARTS_PER_WRITE = 10_000


@dataclass(frozen=True, slots=True)
class SaveStats:
    changed_files: int
    removed_files: int
    parts_written: int
    parts_removed: int
    writes: int
    parts_stored: int


@dataclass(frozen=True, slots=True)
class _File:
    size: int
    sha256: str
    mode: int
    chunks: tuple[str, ...]


def _blob(data: bytes) -> str:
    return BLOB + hashlib.sha256(data).hexdigest()


class SessionCheckpointer:
    """Save `directory` into the checkpoint of `run_id`, fenced by `owner()` (the controller
    lease: `ControllerLeaseKeeper.owner`). Call `save()` as often as you like."""

    def __init__(
        self,
        client: Client,
        run_id: str,
        directory: str | os.PathLike[str],
        *,
        owner: Callable[[], dict[str, Any]],
        session_id: str | None = None,
        max_part_bytes: int = MAX_PART_BYTES,
        max_write_bytes: int = MAX_WRITE_BYTES,
        max_parts_per_write: int = MAX_PARTS_PER_WRITE,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.directory = Path(directory)
        self.owner = owner
        self.session_id = session_id or str(uuid.uuid4())
        self.max_part_bytes = max_part_bytes
        self.max_write_bytes = max_write_bytes
        self.max_parts_per_write = max_parts_per_write
        # base64 turns 3 bytes into 4 characters
        self.chunk_bytes = (max_part_bytes // 4) * 3
        if self.chunk_bytes <= 0:
            raise ValueError("max_part_bytes is too small")
        self._files: dict[str, _File] = {}
        self._stored: set[str] = set()
        self._dirs: set[str] = set()
        self._first = True

    def save(self) -> SaveStats:
        """Upload what changed since the last save (everything the first time)."""
        files, dirs, contents = self._scan()
        changed = [p for p, f in files.items() if self._files.get(p) != f]
        removed = [p for p in self._files if p not in files]
        wanted = {c for f in files.values() for c in f.chunks}
        new = [c for c in sorted(wanted) if c not in self._stored]
        gone = sorted(self._stored - wanted)
        if not self._first and not changed and not removed and dirs == self._dirs:
            return SaveStats(0, 0, 0, 0, writes=0, parts_stored=len(self._stored) + 1)
        header = json.dumps(
            {
                "format": FORMAT,
                "recoveryEvidence": {"normalizedSessionId": self.session_id},
                "files": {
                    p: {
                        "size": f.size,
                        "sha256": f.sha256,
                        "mode": f.mode,
                        "chunks": list(f.chunks),
                    }
                    for p, f in sorted(files.items())
                },
                "dirs": sorted(dirs),
            },
            separators=(",", ":"),
        )
        if len(header.encode()) > self.max_part_bytes:
            raise CheckpointError(f"the file list ({len(files)} files) does not fit in one part")
        batches = list(self._batches(new, contents, reserve=len(header.encode())))
        parts = 0
        for index, batch in enumerate(batches):
            last = index == len(batches) - 1
            changed_parts = dict(batch)
            if last:
                changed_parts[HEADER] = header
            parts = self.client.checkpoint_write(
                self.run_id,
                owner=self.owner(),
                reset=self._first and index == 0,
                changed=changed_parts,
                removed=gone if last else [],
            )
            # After each write that got through, so a save that fails half-way neither resets
            # again (dropping what it stored) nor forgets what it stored.
            self._first = False
            self._stored.update(batch)
        self._stored -= set(gone)
        self._files = files
        self._dirs = dirs
        return SaveStats(
            changed_files=len(changed),
            removed_files=len(removed),
            parts_written=len(new),
            parts_removed=len(gone),
            writes=len(batches),
            parts_stored=parts,
        )

    def _batches(
        self, names: list[str], contents: dict[str, bytes], *, reserve: int
    ) -> Iterator[dict[str, str]]:
        """The new chunks, encoded, grouped into writes under the write limits; the header
        (`reserve` bytes) goes with the last group."""
        batch: dict[str, str] = {}
        size = 0
        for name in names:
            encoded = base64.b64encode(contents[name]).decode("ascii")
            if batch and (
                size + len(encoded) > self.max_write_bytes - reserve
                or len(batch) + 2 > self.max_parts_per_write
            ):
                yield batch
                batch, size = {}, 0
            batch[name] = encoded
            size += len(encoded)
        yield batch

    def _scan(self) -> tuple[dict[str, _File], set[str], dict[str, bytes]]:
        files: dict[str, _File] = {}
        dirs: set[str] = set()
        contents: dict[str, bytes] = {}
        if not self.directory.is_dir():
            return files, dirs, contents
        for root, dirnames, filenames in os.walk(self.directory):
            # symlinked directories are skipped like symlinked files (os.walk does not enter them)
            dirnames[:] = sorted(d for d in dirnames if not (Path(root) / d).is_symlink())
            rel_root = Path(root).relative_to(self.directory)
            for d in dirnames:
                dirs.add(PurePosixPath(rel_root / d).as_posix())
            for name in sorted(filenames):
                path = Path(root) / name
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode):
                    continue  # symlinks, sockets, fifos are not saved
                data = path.read_bytes()
                chunks = []
                for start in range(0, len(data), self.chunk_bytes):
                    piece = data[start : start + self.chunk_bytes]
                    blob = _blob(piece)
                    contents[blob] = piece
                    chunks.append(blob)
                rel = PurePosixPath(rel_root / name).as_posix()
                files[rel] = _File(
                    size=len(data),
                    sha256=hashlib.sha256(data).hexdigest(),
                    mode=stat.S_IMODE(st.st_mode),
                    chunks=tuple(chunks),
                )
        return files, dirs, contents


def session_id_of(header: str | None) -> str | None:
    """The session id a checkpoint header records (None when there is none)."""
    if header is None:
        return None
    try:
        data = json.loads(header)
    except ValueError:
        return None
    evidence = data.get("recoveryEvidence") if isinstance(data, dict) else None
    session = evidence.get("normalizedSessionId") if isinstance(evidence, dict) else None
    return session if isinstance(session, str) else None


def restore(client: Client, run_id: str, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Restore the checkpoint of `run_id` into `directory` (created if missing, must be
    empty). Returns the header (its `recoveryEvidence.normalizedSessionId` is the session)."""
    target = Path(directory)
    if target.exists() and any(target.iterdir()):
        raise CheckpointError(f"{target} is not empty")
    parts = client.checkpoint_read(run_id)
    raw = parts.get(HEADER)
    if raw is None:
        raise CheckpointError(f"run {run_id} has no checkpoint header")
    header = json.loads(raw)
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"run {run_id}'s checkpoint was not written by this client")
    target.mkdir(parents=True, exist_ok=True)
    root = target.resolve()
    for rel in header.get("dirs", []):
        _inside(root, rel).mkdir(parents=True, exist_ok=True)
    for rel, entry in header.get("files", {}).items():
        data = b"".join(base64.b64decode(parts[c]) for c in entry["chunks"])
        if hashlib.sha256(data).hexdigest() != entry["sha256"] or len(data) != entry["size"]:
            raise CheckpointError(f"{rel}: restored contents do not match the checkpoint")
        path = _inside(root, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(int(entry.get("mode", 0o644)) & 0o7777)
    return header


def _inside(root: Path, rel: str) -> Path:
    path = (root / rel).resolve()
    if path != root and root not in path.parents:
        raise CheckpointError(f"{rel!r} points outside the directory")
    return path
