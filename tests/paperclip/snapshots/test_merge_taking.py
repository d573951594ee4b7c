"""`merge.merge3_taking`: the board's resolution of a conflict as a merge. Each conflicting
path takes the chosen side's entry, every other path is as the plain three-way merge decides
it (no change of either side outside the conflicts is dropped) but for the directories above
a conflicting path and what lies below one, which follow the chosen side so that the result
is a tree
(docs/snapshots.md#conflicts)."""

from __future__ import annotations

from typing import Literal

from hypothesis import example, given, settings
from hypothesis import strategies as st

from paperclip.snapshots import trees
from paperclip.snapshots.merge import changed_paths, merge3, merge3_taking
from paperclip.snapshots.trees import Entry
from tests.paperclip.snapshots.test_merge_trees import EDITS, LAYOUTS, Leaf, _edited, _entries

SIDES = st.sampled_from(["ours", "theirs"])


def _plain(
    base: dict[str, Entry], ours: dict[str, Entry], theirs: dict[str, Entry], path: str
) -> Entry | None:
    """What the merge gives a path only one side changed (or both the same way)."""
    if path in changed_paths(base, ours):
        return ours.get(path)
    return theirs.get(path)


@settings(max_examples=500)
@given(LAYOUTS, EDITS, EDITS, SIDES)
@example(  # ours removed a directory the other side added to
    {"a/b": ("file", b"x", 0o644)}, {"a": None}, {"a/c": ("file", b"y", 0o644)}, "theirs"
)
@example(  # ours turned a directory into a file; the other side added two levels below it
    {"d/e/x": ("file", b"x", 0o644)},
    {"d/e/x": None, "d": ("file", b"d", 0o644)},
    {"d/e/y": ("file", b"y", 0o644)},
    "theirs",
)
@example(  # ours turned a file into a directory the other side changed
    {"a": ("file", b"x", 0o644)},
    {"a": None, "a/b": ("file", b"x", 0o644)},
    {"a": ("file", b"y", 0o644)},
    "theirs",
)
def test_conflicts_take_the_chosen_side_and_nothing_else_is_dropped(
    base_layout: dict[str, Leaf],
    ours_edits: dict[str, Leaf | None],
    theirs_edits: dict[str, Leaf | None],
    side: Literal["ours", "theirs"],
) -> None:
    base = _entries(base_layout)
    ours = _entries(_edited(base_layout, ours_edits))
    theirs = _entries(_edited(base_layout, theirs_edits))
    merged = merge3_taking(base, ours, theirs, side=side)

    trees.build(merged)  # raises when an entry's parent is not a directory
    whole = merge3(base, ours, theirs)
    chosen = ours if side == "ours" else theirs
    if whole.entries is not None:
        assert merged == whole.entries  # no conflict: the plain merge
        return
    conflicting = set(whole.conflicts)
    assert whole.conflict_count == len(conflicting)  # under the cap in these small trees
    both = changed_paths(base, ours) & changed_paths(base, theirs)
    for path in base.keys() | ours.keys() | theirs.keys():
        got = merged.get(path)
        if path in both and not _same(ours.get(path), theirs.get(path)):  # changed differently
            assert _same(got, chosen.get(path)), (path, got)
        elif not _same(got, plain := _plain(base, ours, theirs, path)):
            # Only where the chosen side's conflicting entry needs it: a directory above it
            # that the merge had removed, made again; a path above it that the merge held as
            # something else (listed as conflicting itself: the board sees every change its
            # choice drops); or what is below one it replaced or removed.
            remade = got is not None and got.type == "dir" and plain is None
            assert (
                path in conflicting
                or _below(path, conflicting)
                or (remade and _above(path, conflicting))
            ), (path, got, conflicting)
            assert _same(got, chosen.get(path)), (path, got)


def _same(a: Entry | None, b: Entry | None) -> bool:
    return a is b if a is None or b is None else a.same_as(b)


def _below(path: str, conflicting: set[str]) -> bool:
    return any(path.startswith(other + "/") for other in conflicting)


def _above(path: str, conflicting: set[str]) -> bool:
    return any(other.startswith(path + "/") for other in conflicting)


def test_the_head_keeps_its_side_and_the_runs_other_changes_stay() -> None:
    def file(content: bytes) -> Leaf:
        return ("file", content, 0o644)

    base = {"README.md": file(b"base"), "src/main.py": file(b"main")}
    ours = _edited(base, {"README.md": file(b"run"), "a.txt": file(b"a"), "src": None})
    theirs = _edited(base, {"README.md": file(b"head"), "b.txt": file(b"b")})
    for side, readme in (("ours", b"run"), ("theirs", b"head")):
        merged = merge3_taking(
            _entries(base),
            _entries(ours),
            _entries(theirs),
            side=side,  # type: ignore[arg-type]
        )
        assert sorted(merged) == ["README.md", "a.txt", "b.txt"]
        assert merged["README.md"].digest == trees.blob_name(readme)


def test_keeping_the_head_names_every_file_of_the_run_it_drops() -> None:
    """The run turned the file `d` into a directory with new work two levels down; the head
    changed the file `d`. Keeping the head drops `d/e` and `d/e/f.py`: the board is shown
    both, not only `d` and `d/e`."""
    from paperclip.snapshots.resolutions import resolution_preview, resolved_entries

    base_layout: dict[str, Leaf] = {
        "d": ("file", b"base d\n", 0o644),
        "keep": ("file", b"k\n", 0o644),
    }
    run_layout = _edited(base_layout, {"d": None, "d/e/f.py": ("file", b"run's work\n", 0o644)})
    head_layout = _edited(base_layout, {"d": ("file", b"head d\n", 0o644)})
    base, run, head = _entries(base_layout), _entries(run_layout), _entries(head_layout)
    kept = resolved_entries(base, run, head, "keep_head")
    dropped = {p for p in run if p not in kept and p not in base}
    assert dropped == {"d/e", "d/e/f.py"}
    listed = {c.path for c in resolution_preview(base, run, head).conflicts}
    assert dropped <= listed, listed
