"""The three-way merge of workspace trees, path by path (docs/snapshots.md#publishing).

Both sides' changes since their common `base` are compared per path: an entry added, removed,
or changed in type, mode or content. A path changed on one side only takes that side's entry;
a path changed on both sides to the same entry is no conflict (both runs did the same); any
other path changed on both sides is a conflict. The merged entries must still form a tree
(every entry's parent a directory): a path whose parent one side removed or turned into a
file while the other side changed something inside it is a conflict too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from paperclip.snapshots.changes import walk_changes
from paperclip.snapshots.trees import (
    Entry,
    TreeInvalid,
    blob_name,
    encode_dir,
    stored_dir,
)

MAX_CONFLICTS = 100


@dataclass(frozen=True, slots=True)
class MergeResult:
    entries: dict[str, Entry] | None  # None when there are conflicts
    conflicts: tuple[str, ...]  # sorted, at most MAX_CONFLICTS
    conflict_count: int


def _pick(
    base: Entry | None, ours: Entry | None, theirs: Entry | None
) -> tuple[bool, Entry | None]:
    """(clean, entry) for one path."""

    def same(a: Entry | None, b: Entry | None) -> bool:
        return (a is None and b is None) or (a is not None and a.same_as(b))

    if same(ours, base):
        return True, theirs
    if same(theirs, base) or same(ours, theirs):
        return True, ours
    return False, None


def changed_paths(before: Mapping[str, Entry], after: Mapping[str, Entry]) -> set[str]:
    """Paths added, removed, or changed in type, mode or content from `before` to `after`."""
    return {
        path
        for path in before.keys() | after.keys()
        if not (
            (path in before and before[path].same_as(after.get(path)))
            or (path not in before and path not in after)
        )
    }


def _merge_paths(
    base: Mapping[str, Entry], ours: Mapping[str, Entry], theirs: Mapping[str, Entry]
) -> tuple[dict[str, Entry], set[str]]:
    """Path by path: the entry of the side that changed it (either, when both changed it the
    same way), and the paths both sides changed differently, which get no entry here."""
    merged: dict[str, Entry] = {}
    conflicts: set[str] = set()
    ours_changed = changed_paths(base, ours)
    theirs_changed = changed_paths(base, theirs)
    for path in base.keys() | ours.keys() | theirs.keys():
        if path in ours_changed and path in theirs_changed:
            clean, entry = _pick(base.get(path), ours.get(path), theirs.get(path))
            if not clean:
                conflicts.add(path)
                continue
        elif path in ours_changed:
            entry = ours.get(path)
        else:
            entry = theirs.get(path)
        if entry is not None:
            merged[path] = entry
    return merged, conflicts


def merge3(
    base: Mapping[str, Entry], ours: Mapping[str, Entry], theirs: Mapping[str, Entry]
) -> MergeResult:
    """Merge `ours` (the run's tree) and `theirs` (the head now), both descended from `base`."""
    merged, conflicts = _merge_paths(base, ours, theirs)
    for path in list(merged):
        # Each side's change is fine alone; together they would put an entry under something
        # that is no longer a directory: the entry and every path above it up to that one
        # conflict (a resolution decides each of them, so the board is shown each).
        above = _not_directories_above(path, merged)
        if above:
            conflicts.add(path)
            conflicts.update(above)
    if conflicts:
        # Every path whose entry the board's choice decides is shown to it: what lies below a
        # conflicting path may go with it (a run's new files under what the head keeps as a
        # file are dropped by keeping the head, kept by publishing).
        conflicts.update(
            changed_paths(
                merge3_taking(base, ours, theirs, side="ours"),
                merge3_taking(base, ours, theirs, side="theirs"),
            )
        )
        ordered = tuple(sorted(conflicts, key=lambda p: p.encode("utf-8", "surrogatepass")))
        return MergeResult(None, ordered[:MAX_CONFLICTS], len(ordered))
    return MergeResult(merged, (), 0)


def _not_directories_above(path: str, merged: Mapping[str, Entry]) -> list[str]:
    """The paths above `path` that are not directories in `merged`, from its parent up to
    the first that is something else (a file, a symlink); `[]` when its parent is a
    directory."""
    found: list[str] = []
    parent = path.rpartition("/")[0]
    while parent:
        holder = merged.get(parent)
        if holder is not None and holder.type == "dir":
            break
        found.append(parent)
        if holder is not None:
            break
        parent = parent.rpartition("/")[0]
    return found


# What a base that cannot be read holds where the two sides differ: an entry neither side can
# equal (no file is named by the all-zero digest), so that both count as having changed it.
_UNKNOWN: Final = Entry(name="?", type="file", mode=0, size=0, digest="sha256:" + "0" * 64)


def unknown_base(ours: Mapping[str, Entry], theirs: Mapping[str, Entry]) -> dict[str, Entry]:
    """A stand-in for a base that is gone from the store (collected while the run worked): the
    paths the two sides agree on, as they are; every other path, including one only a side
    has, as changed by both, so that `merge3` holds it for the board. Read as empty instead, a
    path the run deleted looked like one the head had added, and the head's copy was kept
    without a word: the run's committed deletion undone."""
    base: dict[str, Entry] = {}
    for path in ours.keys() | theirs.keys():
        mine, other = ours.get(path), theirs.get(path)
        base[path] = mine if mine is not None and mine.same_as(other) else _UNKNOWN
    return base


def merge3_taking(
    base: Mapping[str, Entry],
    ours: Mapping[str, Entry],
    theirs: Mapping[str, Entry],
    *,
    side: Literal["ours", "theirs"],
) -> dict[str, Entry]:
    """`merge3` where every conflicting path takes `side`'s entry (or its absence): the board's
    resolution of a conflict (docs/snapshots.md#conflicts). Every path only one side changed
    keeps that change, as in `merge3`. Where the merge would put an entry under something that
    is no longer a directory, the entry and its parent both take `side`'s, repeated until the
    entries form a tree: `side` is a tree, so this ends with every such path as `side` has it.
    """
    chosen = ours if side == "ours" else theirs
    merged, conflicts = _merge_paths(base, ours, theirs)
    for path in conflicts:
        if path in chosen:
            merged[path] = chosen[path]
    taken: set[str] = set()
    while True:
        orphans = [
            path
            for path, _entry in merged.items()
            if (parent := path.rpartition("/")[0])
            and (merged.get(parent) is None or merged[parent].type != "dir")
        ]
        if not orphans:
            return merged
        for path in orphans:
            # Each round takes at least one more path from `side` (the orphan, or its parent:
            # both from `side` cannot be an orphan), so the rounds end.
            for where in (path, path.rpartition("/")[0]):
                if where in taken:
                    continue
                taken.add(where)
                if where in chosen:
                    merged[where] = chosen[where]
                else:
                    merged.pop(where, None)


# --- the same merge, by directory -----------------------------------------------------------


class _Unclean(Exception):
    """The merge by directory cannot decide a path alone: `merge3` decides."""


@dataclass(frozen=True, slots=True)
class TreeMerge:
    root: str  # the merged tree
    blobs: dict[str, bytes]  # the directory blobs it has that neither side had, by name
    read: int  # directory blobs read


def _same_subtree(a: Entry | None, b: Entry | None) -> bool:
    """Equal at this path and everywhere below it (a directory by blob and mode)."""
    if a is None or b is None:
        return a is b
    if a.type == "dir":
        return a.same_dir(b)
    return a.same_as(b)


def merge_trees(
    base: str | None,
    ours: str,
    theirs: str,
    *,
    load_many: Callable[[list[str]], Mapping[str, bytes]],
    known_valid: bool = False,
) -> TreeMerge | None:
    """`merge3` of three stored trees without reading them whole: a directory whose blob and
    mode one side kept from `base` is the other side's whole, unread, and only directories
    that both sides changed are read and merged entry by entry, so the cost follows the two
    sides' changes, not the tree's size. The result is the tree `merge3` and `build` give.

    None when this cannot decide alone and the whole-tree merge must: a conflict (which
    `merge3` lists), a symlink added, removed or changed on either side (whether one stays
    inside the merged tree depends on all the others; with the symlinks all as in `base`,
    `base`'s check holds), no base, or a directory missing or invalid on any side.

    `known_valid`: the caller knows the three trees valid (`counts.known_valid_trees`), so
    their directories are compared piece by piece and decoded without the checks they passed
    when recorded."""
    if base is None:
        return None
    if ours in (base, theirs):
        return TreeMerge(root=theirs, blobs={}, read=0)
    if theirs == base:
        return TreeMerge(root=ours, blobs={}, read=0)
    read = 0
    for side in (ours, theirs):
        changes = walk_changes(side, base, load_many=load_many, head_known_valid=known_valid)
        if changes is None:
            return None
        read += changes.read
    try:
        return _merge_directories(base, ours, theirs, _Reader(load_many, known_valid), read)
    except _Unclean:
        return None


@dataclass(frozen=True, slots=True)
class _Reader:
    """How the merge reads directories: `load_many`, and whether the trees are known valid."""

    load_many: Callable[[list[str]], Mapping[str, bytes]]
    known_valid: bool

    def children(
        self, stored: Mapping[str, bytes], digest: str | None, path: str
    ) -> dict[str, Entry]:
        try:
            entries = stored_dir(stored, digest, path, known_valid=self.known_valid)
        except TreeInvalid as exc:
            raise _Unclean from exc
        if entries is None:
            raise _Unclean  # a directory gone (a collected base): merge3 says what it means
        return entries


def _merge_directories(
    base: str,
    ours: str,
    theirs: str,
    reader: _Reader,
    read: int,
) -> TreeMerge:
    # Top down, a level per load: the directories both sides changed, with their mode.
    expanded: list[tuple[str, int, tuple[str, ...]]] = []  # (path, mode, child names)
    decided: dict[str, Entry | None] = {}  # path -> the merged entry (None: not in the tree)
    level: list[tuple[str, str | None, str, str, int]] = [("", base, ours, theirs, 0)]
    while level:
        wanted = sorted({d for _, b, o, t, _ in level for d in (b, o, t) if d is not None})
        stored = reader.load_many(wanted)
        read += len(wanted)
        following: list[tuple[str, str | None, str, str, int]] = []
        for path, b, o, t, mode in level:
            sides = [reader.children(stored, digest, path) for digest in (b, o, t)]
            names_here = sorted(set().union(*sides), key=lambda n: n.encode("utf-8"))
            expanded.append((path, mode, tuple(names_here)))
            for name in names_here:
                where = f"{path}/{name}" if path else name
                be, oe, te = (side.get(name) for side in sides)
                descend = _merge_name(where, be, oe, te, reader, decided)
                if descend is not None:
                    following.append(descend)
        level = following
    # Bottom up: each merged directory encoded from its children, deepest first.
    blobs: dict[str, bytes] = {}
    root = ""
    for path, mode, names in reversed(expanded):
        children = []
        for name in names:
            entry = decided[f"{path}/{name}" if path else name]
            if entry is not None:
                children.append(entry)
        data = encode_dir(children)
        digest = blob_name(data)
        blobs[digest] = data
        if not path:
            root = digest
        else:
            decided[path] = Entry(
                name=path.rpartition("/")[2], type="dir", mode=mode, digest=digest
            )
    return TreeMerge(root=root, blobs=blobs, read=read)


def _merge_name(
    where: str,
    be: Entry | None,
    oe: Entry | None,
    te: Entry | None,
    reader: _Reader,
    decided: dict[str, Entry | None],
) -> tuple[str, str | None, str, str, int] | None:
    """One name of a directory both sides changed (base, ours, theirs): decided (an entry
    taken from a side, or None: removed), or the directory both changed to descend into
    (returned). Raises _Unclean for a conflict."""
    if _same_subtree(oe, be):
        decided[where] = te
    elif _same_subtree(te, be) or _same_subtree(oe, te):
        decided[where] = oe
    elif oe is not None and te is not None and oe.type == te.type == "dir":
        assert oe.digest is not None  # noqa: S101 - decode_dir checked it
        assert te.digest is not None  # noqa: S101
        ours_moved = be is None or be.type != "dir" or be.mode != oe.mode
        theirs_moved = be is None or be.type != "dir" or be.mode != te.mode
        if ours_moved and theirs_moved and oe.mode != te.mode:
            raise _Unclean  # both changed the directory's mode, differently
        here = oe.mode if ours_moved else te.mode
        below = be.digest if be is not None and be.type == "dir" else None
        return (where, below, oe.digest, te.digest, here)
    elif _removed_over_removals(be, oe, te, reader, path=where):
        decided[where] = None  # one side removed it, the other only removed inside
    else:
        raise _Unclean  # both changed it, differently: a conflict
    return None


def _removed_over_removals(
    base: Entry | None,
    ours: Entry | None,
    theirs: Entry | None,
    reader: _Reader,
    *,
    path: str,
) -> bool:
    """True when one side removed a directory of `base` and the other side's changes inside
    it are all removals: `merge3` sees every path below changed the same way or on one side
    only, so the directory is gone from the merge (not a conflict)."""
    if base is None or base.type != "dir":
        return False
    kept = theirs if ours is None else ours if theirs is None else None
    if kept is None or kept.type != "dir" or kept.mode != base.mode:
        return False
    return _only_removals(base.digest, kept.digest, reader, path=path)


def _only_removals(
    base: str | None,
    side: str | None,
    reader: _Reader,
    *,
    path: str,
) -> bool:
    """Whether the directory `side` is `base` with some entries removed and nothing else
    changed, at any depth (a directory by blob and mode, as `_same_subtree` compares)."""
    if base == side:
        return True
    stored = reader.load_many([d for d in (base, side) if d is not None])
    base_children = reader.children(stored, base, path)
    for name, entry in reader.children(stored, side, path).items():
        before = base_children.get(name)
        if _same_subtree(entry, before):
            continue
        if before is None or entry.type != "dir" or before.type != "dir":
            return False
        if entry.mode != before.mode:
            return False
        if not _only_removals(before.digest, entry.digest, reader, path=f"{path}/{name}"):
            return False
    return True
