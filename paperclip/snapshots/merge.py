"""The three-way merge of workspace trees, path by path (docs/snapshots.md#publishing).

Both sides' changes since their common `base` are compared per path: an entry added, removed,
or changed in type, mode or content. A path changed on one side only takes that side's entry;
a path changed on both sides to the same entry is no conflict (both runs did the same); any
other path changed on both sides is a conflict. The merged entries must still form a tree
(every entry's parent a directory): a path whose parent one side removed or turned into a
file while the other side changed something inside it is a conflict too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from paperclip.snapshots.trees import Entry

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


def merge3(
    base: Mapping[str, Entry], ours: Mapping[str, Entry], theirs: Mapping[str, Entry]
) -> MergeResult:
    """Merge `ours` (the run's tree) and `theirs` (the head now), both descended from `base`."""
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
    for path in list(merged):
        parent = path.rpartition("/")[0]
        while parent:
            holder = merged.get(parent)
            if holder is None or holder.type != "dir":
                # Each side's change is fine alone; together they would put an entry under
                # something that is no longer a directory.
                conflicts.update({path, parent})
                break
            parent = parent.rpartition("/")[0]
    if conflicts:
        ordered = tuple(sorted(conflicts, key=lambda p: p.encode("utf-8", "surrogatepass")))
        return MergeResult(None, ordered[:MAX_CONFLICTS], len(ordered))
    return MergeResult(merged, (), 0)
