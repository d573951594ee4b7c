"""What changed between two trees, path by path (docs/snapshots.md#diff): the one diff of the
project, used by the history, the diff and restore APIs, the board's conflict preview and the
console.

`changes_between` compares two trees given whole (entries by path); `tree_diff` compares two
stored trees reading only the directories that differ (a subdirectory with the same blob on
both sides is not entered), so a change of a few files in a tree of 50,000 costs a few
directory reads on each side, as registration against the head does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from uuid import UUID

from django.conf import settings

from paperclip.snapshots.bounds import MAX_ENTRIES
from paperclip.snapshots.counts import known_valid_trees
from paperclip.snapshots.merge import changed_paths
from paperclip.snapshots.store.reads import directory_loader
from paperclip.snapshots.trees import (
    MAX_DEPTH,
    Entry,
    TreeInvalid,
    decode_dir,
    entry_pieces,
    known_entries,
    valid_pieces,
)

type ChangeKind = Literal["added", "removed", "modified"]


def entry_json(entry: Entry | None) -> dict[str, Any] | None:
    """An entry as the preview and the diff show it: a file's type, mode, size and digest (or
    chunks), a directory's type and mode (what is inside it shows path by path), a symlink's
    type and target; None where there is no entry."""
    if entry is None:
        return None
    if entry.type == "dir":
        return {"type": "dir", "mode": entry.mode}
    shown = entry.as_json()
    del shown["name"]
    return shown


def path_key(path: str) -> bytes:
    """The order of paths in a diff: by their UTF-8 bytes, as a tree orders names."""
    return path.encode("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class Change:
    path: str
    change: ChangeKind
    before: Entry | None
    after: Entry | None

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "change": self.change,
            "from": entry_json(self.before),
            "to": entry_json(self.after),
        }


def _kind(before: Entry | None, after: Entry | None) -> ChangeKind:
    return "added" if before is None else "removed" if after is None else "modified"


def changes_between(before: Mapping[str, Entry], after: Mapping[str, Entry]) -> list[Change]:
    """What turns `before` into `after`, path by path, sorted by path: an entry added, removed,
    or modified in type, mode or content (a directory only by type or mode)."""
    found: list[Change] = []
    for path in sorted(changed_paths(before, after), key=path_key):
        old, new = before.get(path), after.get(path)
        found.append(Change(path, _kind(old, new), old, new))
    return found


@dataclass(frozen=True, slots=True)
class ChangeCounts:
    added: int = 0
    removed: int = 0
    modified: int = 0

    def as_json(self) -> dict[str, int]:
        return {"added": self.added, "removed": self.removed, "modified": self.modified}


@dataclass(frozen=True, slots=True)
class TreeDiff:
    """`changes` sorted by path (at most the limit asked for), `truncated` when there were
    more; `counts` always counts them all; `read` is the directory blobs read, both sides."""

    before: str | None
    after: str | None
    changes: list[Change]
    truncated: bool
    counts: ChangeCounts
    read: int = 0


class TreeUnreadable(Exception):
    """A directory of `tree` is not in the company's store (collected, or never stored), or is
    not a valid directory: `path` names where ("" is the root)."""

    def __init__(self, tree: str, path: str, reason: str = "not_stored") -> None:
        super().__init__(f"tree {tree}: directory {path or '/'} {reason}")
        self.tree = tree
        self.path = path
        self.reason = reason


_NO_DIR: Final[list[bytes]] = []


@dataclass(slots=True)
class _Walk:
    """Both trees a level at a time, one `load_many` call per level. A directory is compared
    entry by entry as raw bytes (`entry_pieces`): only the entries that differ are decoded.
    The directories of a side whose tree is `trusted` (known valid: `known_valid_trees`) are
    not validated again; the other side's are, as they are read (`valid_pieces`). `load_many`
    answers only bytes it checked against their names (`directory_loader` does, before it
    caches them), so they are not hashed again here."""

    load_many: Callable[[list[str]], Mapping[str, bytes]]
    before: str | None
    after: str | None
    trusted: tuple[bool, bool] = (False, False)
    found: list[Change] = field(default_factory=list)
    read: int = 0
    # Entries compared, both sides: directories shared by many paths (a few kilobytes an
    # agent uploaded) must not make a diff walk millions of paths.
    max_entries: int = MAX_ENTRIES
    compared: int = 0

    def run(self) -> None:
        # (path, the directory blob before, after): None on a side that has no directory there
        level: list[tuple[str, str | None, str | None]] = [("", self.before, self.after)]
        depth = 0
        while level:
            if depth > MAX_DEPTH:
                raise TreeUnreadable(self.after or self.before or "", level[0][0], "too_deep")
            names = sorted({d for _, old, new in level for d in (old, new) if d})
            stored = self.load_many(names) if names else {}
            self.read += len(names)
            following: list[tuple[str, str | None, str | None]] = []
            for path, old, new in level:
                gone = _read(stored, old, path, self.before, trusted=self.trusted[0])
                came = _read(stored, new, path, self.after, trusted=self.trusted[1])
                self.compared += len(gone) + len(came)
                if self.compared > self.max_entries:
                    raise TreeUnreadable(self.after or self.before or "", path, "too_many_entries")
                following.extend(self._compare(path, gone, came))
            level = following
            depth += 1

    def _compare(
        self, path: str, gone: list[bytes], came: list[bytes]
    ) -> Iterator[tuple[str, str | None, str | None]]:
        # An entry the same on both sides (the same bytes) is neither decoded nor shown.
        same = set(gone).intersection(came) if gone and came else ()
        old = _differing(gone, same, path, self.before)
        new = _differing(came, same, path, self.after)
        for name in old.keys() | new.keys():
            a, b = old.get(name), new.get(name)
            if a is not None and b is not None and a.type == b.type == "dir" and a.same_dir(b):
                continue  # the same subtree at the same path: not entered
            where = f"{path}/{name}" if path else name
            if a is None or b is None or not a.same_as(b):
                self.found.append(Change(where, _kind(a, b), a, b))
            below_a = a.digest if a is not None and a.type == "dir" else None
            below_b = b.digest if b is not None and b.type == "dir" else None
            if below_a is not None or below_b is not None:
                yield where, below_a, below_b


def _read(
    stored: Mapping[str, bytes], digest: str | None, path: str, tree: str | None, *, trusted: bool
) -> list[bytes]:
    """The pieces (`entry_pieces`) of the directory `digest` of `tree` at `path` (none for
    None), as `stored` holds it (bytes the loader already checked against their names),
    validated unless its tree is `trusted`. Raises TreeUnreadable."""
    if digest is None:
        return _NO_DIR
    data = stored.get(digest)
    if data is None:
        raise TreeUnreadable(tree or "", path)
    try:
        if not trusted:
            return valid_pieces(data, path)
        pieces = entry_pieces(data)
        if pieces is None:
            decode_dir(data, path)  # names why (a valid directory always splits)
            raise TreeInvalid(path, "not_canonical")
    except TreeInvalid as exc:
        raise TreeUnreadable(tree or "", path, exc.reason) from exc
    return pieces


def _differing(
    pieces: list[bytes], same: Collection[bytes], path: str, tree: str | None
) -> dict[str, Entry]:
    """The entries of a directory's valid `pieces` that are not in `same`, by name."""
    try:
        found = known_entries([p for p in pieces if p not in same], path)
    except TreeInvalid as exc:
        raise TreeUnreadable(tree or "", path, exc.reason) from exc
    return {entry.name: entry for entry in found}


def tree_diff(
    *,
    company_id: UUID,
    before: str | None,
    after: str | None,
    limit: int | None = None,
) -> TreeDiff:
    """The changes that turn the tree `before` into `after` (None: the empty tree), as
    `changes_between` would give them for the whole trees, reading only the directories that
    differ. Reads only. Raises TreeUnreadable when a directory it needs is not in the
    company's store (or is not one), or when the two compare more than
    PAPERCLIP_SNAPSHOT_MAX_ENTRIES entries (reason `too_many_entries`: directories shared by
    many paths). `limit` bounds the changes returned, not the counts."""
    walker = _Walk(directory_loader(company_id), before, after)
    walker.max_entries = 2 * int(settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES)  # both sides
    if before != after:
        known = known_valid_trees(company_id=company_id, trees=[t for t in (before, after) if t])
        walker.trusted = (before in known, after in known)
        walker.run()
    found = sorted(walker.found, key=lambda change: path_key(change.path))
    counted = {"added": 0, "removed": 0, "modified": 0}
    for change in found:
        counted[change.change] += 1
    shown = found if limit is None else found[:limit]
    return TreeDiff(
        before=before,
        after=after,
        changes=shown,
        truncated=len(shown) < len(found),
        counts=ChangeCounts(**counted),
        read=walker.read,
    )
