"""Where a tree's symlinks resolve (docs/snapshots.md#trees), as a plain function over paths:
`trees.check_symlinks` hands it the tree's directories and links and names what it finds as
`TreeInvalid`. Below `trees` (it imports nothing of the package).

A directory may be named by many paths, so one link blob of a few megabytes can stand at
millions of paths, each resolved on its own (where a link leads depends on where it stands).
The work is therefore bounded twice: every step costs the same whatever the path's length
(a place in the tree is a number, not a path rebuilt per component), and the components of
the targets resolved, every path counted, are charged against `max_steps`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

MAX_SYMLINK_HOPS: Final = 40
# The components of symlink targets one check resolves, every path of a shared directory
# counted (PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS for a registration): about 2 s at most.
MAX_SYMLINK_STEPS: Final = 5_000_000

_ROOT: Final = 0


class LinkInvalid(ValueError):
    """A link leaves the tree, never resolves, or the check ran out of steps: `path` is the
    link being checked, `reason` the tree validator's word for it."""

    def __init__(self, path: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.detail = path, reason, detail


def check_links(
    links: Mapping[str, str], others: Iterable[str], *, max_steps: int = MAX_SYMLINK_STEPS
) -> None:
    """Resolve every link of `links` (path -> target) in the tree whose other directories
    and entries are `others` (files may be left out: nothing is below a file, and `..` from
    one is its directory as from a name the tree lacks), as `trees.check_symlinks` describes.
    Raises LinkInvalid: `escaping_symlink`, `symlink_loop`, or `too_many_entries` once the
    targets' components resolved (path by path) pass `max_steps`."""
    if links:
        _Resolver(links, others, max_steps).check()


class _Resolver:
    """The tree as numbered places: each directory or link path (and each ancestor) a
    number, its parent's number, its children by (number, name). A place reached while
    resolving is (the deepest place the tree has, names below it that the tree lacks)."""

    def __init__(self, links: Mapping[str, str], others: Iterable[str], max_steps: int) -> None:
        self.ids: dict[str, int] = {"": _ROOT}
        self.parents: list[int] = [_ROOT]
        self.children: dict[tuple[int, str], int] = {}
        for path in others:
            self._place(path)
        self.targets = {self._place(path): (path, target) for path, target in links.items()}
        self.resolved: dict[int, tuple[int, int]] = {}
        self.steps, self.max_steps = max_steps, max_steps

    def _place(self, path: str) -> int:
        """The number of `path`, numbering it and the ancestors not numbered yet."""
        missing: list[str] = []
        while path not in self.ids:
            missing.append(path)
            path = path.rpartition("/")[0]
        place = self.ids[path]
        for below in reversed(missing):
            self.parents.append(place)
            self.children[(place, below.rpartition("/")[2])] = len(self.parents) - 1
            place = self.ids[below] = len(self.parents) - 1
        return place

    def check(self) -> None:
        for place, (path, _) in self.targets.items():
            self._follow(place, link=path, hops=0)

    def _follow(self, place: int, *, link: str, hops: int) -> tuple[int, int]:
        """Where the link numbered `place` resolves (`link`: the link being checked, named in
        the error). Each link is resolved once: a loop never resolves, so it stops at the hop
        limit whatever the order."""
        found = self.resolved.get(place)
        if found is not None:
            return found
        if hops > MAX_SYMLINK_HOPS:
            raise LinkInvalid(link, "symlink_loop")
        target = self.targets[place][1]
        self.steps -= target.count("/") + 1  # every component, `.` and empty ones too
        if self.steps < 0:
            detail = f"its symlinks' targets take over {self.max_steps} steps to resolve"
            raise LinkInvalid(link, "too_many_entries", detail)
        at, outside = self.parents[place], 0
        for component in target.split("/"):
            if component in ("", "."):
                continue
            if component == "..":
                if outside:
                    outside -= 1
                elif at == _ROOT:
                    raise LinkInvalid(link, "escaping_symlink")
                else:
                    at = self.parents[at]
            elif outside:
                outside += 1
            elif (below := self.children.get((at, component))) is None:
                outside = 1
            elif below in self.targets:
                at, outside = self._follow(below, link=link, hops=hops + 1)
            else:
                at = below
        self.resolved[place] = (at, outside)
        return at, outside
