"""The snapshot tree format (`paperclip.dir.v1`), the client's own copy.

A directory is a blob of canonical JSON `{"entries": [...], "schema": "paperclip.dir.v1"}`
(keys sorted, separators `,` `:`, UTF-8, no whitespace), entries sorted by the UTF-8 bytes of
their names: `{"name", "type": "file", "mode", "size", "digest"}` (or `"chunks"` in place of
`digest` for a file larger than the store's blob limit), `{"name", "type": "dir", "mode",
"digest"}`, `{"name", "type": "symlink", "target"}`. A tree is the name of its root directory
blob, `sha256:<hex>` of its bytes. The server decodes and checks the same bytes; this module
must produce exactly what it would (tests/clients compare the two).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

# Defined with the other error classes, so that the CLI catches it without importing this module.
from paperclip_client.errors import TreeError as TreeError

SCHEMA: Final = "paperclip.dir.v1"
MAX_NAME_BYTES: Final = 255
MAX_MODE: Final = 0o7777
MAX_SYMLINK_HOPS: Final = 40
BLOB_NAME: Final = re.compile(r"sha256:[0-9a-f]{64}")

type EntryType = Literal["file", "dir", "symlink"]


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    type: EntryType
    mode: int = 0
    size: int = 0
    digest: str | None = None  # a file's content, or a directory's blob
    chunks: tuple[str, ...] | None = None  # a large file's content, in order
    target: str = ""  # a symlink's

    def as_json(self) -> dict[str, Any]:
        if self.type == "symlink":
            return {"name": self.name, "type": "symlink", "target": self.target}
        if self.type == "dir":
            return {"name": self.name, "type": "dir", "mode": self.mode, "digest": self.digest}
        content: dict[str, Any] = (
            {"chunks": list(self.chunks)} if self.chunks is not None else {"digest": self.digest}
        )
        return {"name": self.name, "type": "file", "mode": self.mode, "size": self.size, **content}

    def blobs(self) -> tuple[str, ...]:
        """The content blobs of a file (nothing for a directory or a symlink)."""
        if self.type != "file":
            return ()
        if self.chunks is not None:
            return self.chunks
        return (self.digest,) if self.digest is not None else ()

    def same(self, other: Entry | None) -> bool:
        """Same type, mode and content (a directory by type and mode: its children are
        compared by their own paths); the name is not compared."""
        if other is None or other.type != self.type:
            return False
        if self.type == "dir":
            return self.mode == other.mode
        return self.as_json() | {"name": ""} == other.as_json() | {"name": ""}


def blob_name(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def encode_dir(entries: Iterable[Entry]) -> bytes:
    """The canonical bytes of a directory holding `entries` (sorted here)."""
    ordered = sorted(entries, key=lambda e: e.name.encode("utf-8"))
    return canonical_json({"schema": SCHEMA, "entries": [e.as_json() for e in ordered]})


EMPTY_DIR: Final = encode_dir(())
EMPTY_TREE: Final = blob_name(EMPTY_DIR)


def name_ok(name: object) -> bool:
    if not isinstance(name, str):
        return False
    if name.isascii():  # the common case, without encoding: one byte per character
        return (
            0 < len(name) <= MAX_NAME_BYTES
            and name not in (".", "..")
            and "/" not in name
            and "\0" not in name
        )
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return False
    return 1 <= size <= MAX_NAME_BYTES and name not in (".", "..") and not ({"/", "\0"} & set(name))


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def decode_dir(data: bytes, path: str = "") -> tuple[Entry, ...]:
    """The entries of one directory blob, checked enough to be safe to write to disk: names
    (no `/`, `.`, `..`, NUL; unique), known types, modes in range, blob names, relative
    symlink targets. Raises TreeError."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise TreeError(path, "not_json") from exc
    if not isinstance(value, dict) or value.get("schema") != SCHEMA:
        raise TreeError(path, "not_a_directory")
    raw_entries = value.get("entries")
    if not isinstance(raw_entries, list):
        raise TreeError(path, "not_a_directory")
    entries: list[Entry] = []
    seen: set[str] = set()
    for raw in raw_entries:
        entry = _entry(raw, path)
        if entry.name in seen:
            raise TreeError(_join(path, entry.name), "duplicate_name")
        seen.add(entry.name)
        entries.append(entry)
    return tuple(entries)


def _blob(value: object, where: str) -> str:
    if not isinstance(value, str) or not BLOB_NAME.fullmatch(value):
        raise TreeError(where, "bad_digest")
    return value


def _int(value: object, high: int, where: str, reason: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
        raise TreeError(where, reason)
    return value


def _entry(raw: object, path: str) -> Entry:
    if not isinstance(raw, dict) or not name_ok(raw.get("name")):
        raise TreeError(path, "bad_name")
    name: str = raw["name"]
    where = _join(path, name)
    kind = raw.get("type")
    if kind == "symlink":
        target = raw.get("target")
        if not isinstance(target, str) or not target or "\0" in target or target[0] == "/":
            raise TreeError(where, "bad_symlink")
        return Entry(name=name, type="symlink", target=target)
    if kind not in ("file", "dir"):
        raise TreeError(where, "bad_type")
    mode = _int(raw.get("mode"), MAX_MODE, where, "bad_mode")
    if kind == "dir":
        return Entry(name=name, type="dir", mode=mode, digest=_blob(raw.get("digest"), where))
    size = _int(raw.get("size"), 2**53, where, "bad_size")
    if "chunks" in raw:
        chunks = raw["chunks"]
        if not isinstance(chunks, list) or len(chunks) < 2:
            raise TreeError(where, "bad_chunks")
        return Entry(
            name=name,
            type="file",
            mode=mode,
            size=size,
            chunks=tuple(_blob(c, where) for c in chunks),
        )
    return Entry(
        name=name, type="file", mode=mode, size=size, digest=_blob(raw.get("digest"), where)
    )


def symlink_escapes(entries: Mapping[str, Entry], path: str) -> bool:
    """Whether the symlink at `path` resolves outside the tree (lexically, or through the
    tree's own symlinks) or into a loop of them, its last component followed too (a -> b,
    b -> a): the server's rules, which refuse such a tree whole."""
    entry = entries[path]
    try:
        resolved = _resolve(entries, path.rpartition("/")[0], entry.target, hops=0)
        hops = 0
        while (last := entries.get(resolved)) is not None and last.type == "symlink":
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise TreeError(path, "symlink_loop")
            resolved = _resolve(entries, resolved.rpartition("/")[0], last.target, hops)
    except TreeError:
        return True
    return False


def _resolve(entries: Mapping[str, Entry], parent: str, target: str, hops: int) -> str:
    if hops > MAX_SYMLINK_HOPS:
        raise TreeError(parent, "symlink_loop")
    parts = [p for p in parent.split("/") if p]
    components = [c for c in target.split("/") if c not in ("", ".")]
    for index, component in enumerate(components):
        if component == "..":
            if not parts:
                raise TreeError(parent, "escaping_symlink")
            parts.pop()
            continue
        parts.append(component)
        entry = entries.get("/".join(parts))
        if entry is not None and entry.type == "symlink" and index < len(components) - 1:
            resolved = _resolve(entries, "/".join(parts[:-1]), entry.target, hops + 1)
            parts = [p for p in resolved.split("/") if p]
    return "/".join(parts)
