"""Browsing a recorded tree of a workspace (docs/snapshots.md#files): a directory's entries, or
a file's bytes, read from the company's store. For the board (the API and the console)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final
from uuid import UUID

from django.conf import settings

from paperclip import selectors
from paperclip.access import Actor
from paperclip.errors import InvalidRequest, NotFoundError, PermissionDenied, RuleViolationError
from paperclip.snapshots.history import TreeNotFound, is_recorded_tree, tree_name, trees_stored
from paperclip.snapshots.store.reads import CasBlobReader, cas_open, directory_loader
from paperclip.snapshots.trees import Entry, TreeInvalid, stored_dir

MAX_PATH_CHARS: Final = 4096


class FileTooLarge(RuleViolationError):
    code = "file_too_large"
    message = "The file is larger than the server returns in one response (details.max_bytes)."


@dataclass(frozen=True, slots=True)
class TreeNode:
    """What `path` names in `tree`: a directory (`entries`, sorted by name), a file (`entry`
    and its bytes through `open_bytes`), or a symlink (`entry`)."""

    company_id: UUID
    tree: str
    path: str  # normalised: no leading or trailing slash; "" is the root
    entry: Entry | None  # None for the root
    entries: tuple[Entry, ...] | None  # a directory's

    @property
    def kind(self) -> str:
        return "dir" if self.entries is not None else self.entry.type if self.entry else "dir"

    def as_json(self) -> dict[str, Any]:
        """A directory or a symlink as the API shows it (a file's answer is its bytes)."""
        body: dict[str, Any] = {"tree": self.tree, "path": self.path, "type": self.kind}
        if self.entries is not None:
            body["entries"] = [entry.as_json() for entry in self.entries]
        elif self.entry is not None and self.entry.type == "symlink":
            body["target"] = self.entry.target
        return body


def _parts(path: str) -> list[str]:
    if len(path) > MAX_PATH_CHARS or "\0" in path:
        raise InvalidRequest(fields={"path": ["Not a path of a tree."]})
    parts = [part for part in path.strip("/").split("/") if part] if path.strip("/") else []
    if any(part in (".", "..") for part in parts) or "//" in path:
        raise InvalidRequest(fields={"path": ["Not a path of a tree (no `.`, `..` or `//`)."]})
    return parts


def _directory(company_id: UUID, tree: str, digest: str, path: str) -> dict[str, Entry]:
    stored = directory_loader(company_id)([digest])
    try:
        entries = stored_dir(stored, digest, path)
    except TreeInvalid as exc:
        raise TreeNotFound(tree=tree, path=path) from exc
    if entries is None:
        raise TreeNotFound(tree=tree, path=path)
    return entries


def workspace_tree_node(*, actor: Actor, workspace_id: UUID, tree: str, path: str) -> TreeNode:
    """What `path` names in `tree`, a tree of the workspace's history (or its head). The
    board's only (PermissionDenied for an agent); NotFound for a workspace the actor may not
    see, a tree the history does not name, a path the tree lacks, or a directory the store no
    longer holds (TreeNotFound); InvalidRequest for a bad tree name or path. Reads only: one
    directory blob per component of the path."""
    if not actor.is_board:
        raise PermissionDenied()
    workspace = selectors.execution_workspace_get(actor=actor, workspace_id=workspace_id)
    tree = tree_name(tree, "tree")
    parts = _parts(path)
    if tree != workspace.head_tree and not is_recorded_tree(workspace_id=workspace.pk, tree=tree):
        raise NotFoundError("The workspace's history does not name this tree.")
    company_id = workspace.company_id
    trees_stored(company_id, tree)
    entry: Entry | None = None
    entries = _directory(company_id, tree, tree, "")
    for depth, name in enumerate(parts):
        here = "/".join(parts[: depth + 1])
        entry = entries.get(name)
        if entry is None:
            raise NotFoundError("The tree has no such path.", path=here)
        if entry.type == "dir":
            assert entry.digest is not None  # noqa: S101 - decode_dir checked it
            entries = _directory(company_id, tree, entry.digest, here)
        elif depth < len(parts) - 1:
            raise NotFoundError("The tree has no such path.", path=here)
    normalised = "/".join(parts)
    if path.endswith("/") and entry is not None and entry.type != "dir":
        raise NotFoundError("The tree has no such directory.", path=normalised)
    if entry is None or entry.type == "dir":
        ordered = tuple(sorted(entries.values(), key=lambda e: e.name.encode("utf-8", "replace")))
        return TreeNode(company_id, tree, normalised, entry, ordered)
    return TreeNode(company_id, tree, normalised, entry, None)


def file_reader(*, node: TreeNode) -> CasBlobReader:
    """The bytes of the file `node` (its chunks in order for a large one), at most
    PAPERCLIP_CAS_MAX_BLOB_BYTES: FileTooLarge (details `max_bytes`) beyond; TreeNotFound
    when a blob of it is gone from the store."""
    entry = node.entry
    if entry is None or entry.type != "file":
        raise ValueError(f"{node.path or '/'} is not a file")
    limit = int(settings.PAPERCLIP_CAS_MAX_BLOB_BYTES)
    if entry.size > limit:
        raise FileTooLarge(max_bytes=limit, size=entry.size)
    readers: list[CasBlobReader] = []
    for digest in entry.blobs():
        reader = cas_open(company_id=node.company_id, digest=digest)
        if reader is None:
            for opened in readers:
                _close(opened)
            raise TreeNotFound(tree=node.tree, path=node.path)
        readers.append(reader)

    def chunks() -> Iterator[bytes]:
        try:
            for reader in readers:
                yield from reader.chunks
        finally:
            for reader in readers:
                _close(reader)

    return CasBlobReader(digest=entry.digest or "", size=entry.size, chunks=chunks())


def _close(reader: CasBlobReader) -> None:
    close = getattr(reader.chunks, "close", None)
    if close is not None:
        close()
