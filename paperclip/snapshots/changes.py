"""The path-by-path change list between two trees' entries, as the conflict preview and the
diff show it (docs/snapshots.md#conflicts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from paperclip.snapshots.merge import changed_paths
from paperclip.snapshots.trees import Entry


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
    """The order paths are listed in: by their UTF-8 bytes."""
    return path.encode("utf-8", "surrogatepass")


@dataclass(frozen=True, slots=True)
class Change:
    path: str
    change: Literal["added", "removed", "modified"]
    before: Entry | None
    after: Entry | None

    def as_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "change": self.change,
            "from": entry_json(self.before),
            "to": entry_json(self.after),
        }


def changes_between(before: dict[str, Entry], after: dict[str, Entry]) -> list[Change]:
    """What turns `before` into `after`, path by path, sorted by path: an entry added, removed,
    or modified in type, mode or content (a directory only by type or mode)."""
    found: list[Change] = []
    for path in sorted(changed_paths(before, after), key=path_key):
        old, new = before.get(path), after.get(path)
        kind: Literal["added", "removed", "modified"] = (
            "added" if old is None else "removed" if new is None else "modified"
        )
        found.append(Change(path, kind, old, new))
    return found
