"""`merge.merge_trees`: the three-way merge read only where the sides changed. Whenever it
decides, it gives exactly the tree the whole-tree merge (`merge3`, `check_symlinks`, `build`)
gives; it leaves to that merge only conflicts, symlink changes and missing directories
(docs/snapshots.md#publishing)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from paperclip.snapshots import trees
from paperclip.snapshots.merge import merge3, merge_trees
from paperclip.snapshots.trees import Entry, TreeInvalid, blob_name

# ("file", content, mode), ("symlink", target, 0) or ("dir", "", mode): an empty directory,
# or the mode of one that holds something.
type Leaf = tuple[str, bytes | str, int]

PATHS = st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3).map("/".join)
LEAVES: st.SearchStrategy[Leaf] = st.one_of(
    st.tuples(st.just("file"), st.sampled_from([b"x", b"y", b""]), st.sampled_from([0o644, 0o755])),
    st.tuples(
        st.just("symlink"),
        st.sampled_from(["a", "../a", "../a/..", ".", "../..", "b/../.."]),
        st.just(0),
    ),
    st.tuples(st.just("dir"), st.just(""), st.sampled_from([0o755, 0o700, 0o750])),
)
LAYOUTS = st.dictionaries(PATHS, LEAVES, max_size=8)
EDITS = st.dictionaries(PATHS, st.one_of(st.none(), LEAVES), max_size=4)


def _entries(layout: Mapping[str, Leaf]) -> dict[str, Entry]:
    """The entries of `layout`; a path that is also another's parent is a directory (its
    mode from a "dir" leaf at that path, if any)."""
    parents = {"/".join(p.split("/")[:i]) for p in layout for i in range(1, p.count("/") + 1)}
    entries: dict[str, Entry] = {}
    for path in parents | {p for p, leaf in layout.items() if leaf[0] == "dir"}:
        leaf = layout.get(path)
        mode = leaf[2] if leaf is not None and leaf[0] == "dir" else 0o755
        entries[path] = Entry(name=path.rpartition("/")[2], type="dir", mode=mode)
    for path, (kind, value, mode) in layout.items():
        if path in entries:
            continue
        name = path.rpartition("/")[2]
        if kind == "symlink":
            assert isinstance(value, str)
            entries[path] = Entry(name=name, type="symlink", target=value)
        else:
            assert isinstance(value, bytes)
            entries[path] = Entry(
                name=name, type="file", mode=mode, size=len(value), digest=blob_name(value)
            )
    return entries


def _edited(layout: dict[str, Leaf], edits: Mapping[str, Leaf | None]) -> dict[str, Leaf]:
    out = dict(layout)
    for path, leaf in edits.items():
        if leaf is None:
            for other in [p for p in out if p == path or p.startswith(path + "/")]:
                del out[other]
        else:
            out[path] = leaf
    return out


def _links(entries: Mapping[str, Entry]) -> dict[str, str]:
    return {p: e.target for p, e in entries.items() if e.type == "symlink"}


@settings(max_examples=400)
@given(LAYOUTS, EDITS, EDITS, st.booleans())
@example(  # each side's link stays inside; together they climb out
    {},
    {"c/l": ("symlink", "../a/..", 0)},
    {"a": ("symlink", ".", 0)},
    True,
)
@example(  # one side removed a directory, the other only removed inside it: clean
    {"a/a/a/x": ("file", b"x", 0o644), "a/b": ("file", b"y", 0o644)},
    {"a": None},
    {"a/a/a/x": None},
    True,
)
def test_merging_by_directory_gives_the_whole_tree_merge_or_leaves_it_to_it(
    base_layout: dict[str, Leaf],
    ours_edits: dict[str, Leaf | None],
    theirs_edits: dict[str, Leaf | None],
    known: bool,
) -> None:
    store: dict[str, bytes] = {}
    sides = []
    for layout in (
        base_layout,
        _edited(base_layout, ours_edits),
        _edited(base_layout, theirs_edits),
    ):
        entries = _entries(layout)
        try:
            trees.check_symlinks(entries)
        except TreeInvalid:
            assume(False)  # every side was validated when it was registered
        root, blobs = trees.build(entries)
        store.update(blobs)
        sides.append((root, entries))
    (base, base_entries), (ours, ours_entries), (theirs, theirs_entries) = sides

    def load_many(names: list[str]) -> dict[str, bytes]:
        return {n: store[n] for n in names if n in store}

    merged = merge_trees(base, ours, theirs, load_many=load_many, known_valid=known)
    whole = merge3(base_entries, ours_entries, theirs_entries)
    clean = whole.entries is not None
    if clean:
        assert whole.entries is not None
        try:
            trees.check_symlinks(whole.entries)
        except TreeInvalid:
            clean = False
    same_links = _links(ours_entries) == _links(base_entries) == _links(theirs_entries)
    if clean and same_links:
        assert merged is not None, (base_layout, ours_edits, theirs_edits)
    if merged is None:
        return
    assert clean, "merged by directory where the whole-tree merge finds a conflict"
    assert whole.entries is not None
    root, blobs = trees.build(whole.entries)
    assert merged.root == root
    assert set(merged.blobs) <= set(blobs)
    for name, data in merged.blobs.items():
        assert blob_name(data) == name


@pytest.mark.parametrize("known", [False, True], ids=["decoded", "known-valid"])
def test_disjoint_changes_deep_in_a_large_tree_read_only_their_directories(known: bool) -> None:
    layout: dict[str, Leaf] = {
        f"d{i}/e{j}/f{k}.txt": ("file", b"%d %d %d" % (i, j, k), 0o644)
        for i in range(20)
        for j in range(10)
        for k in range(5)
    }
    store: dict[str, bytes] = {}
    roots = []
    for edits in (
        {},
        {"d3/e4/f1.txt": ("file", b"ours", 0o644)},
        {"d17/e2/new": ("file", b"t", 0o644)},
    ):
        root, blobs = trees.build(_entries(_edited(layout, edits)))
        store.update(blobs)
        roots.append(root)
    base, ours, theirs = roots

    def load_many(names: list[str]) -> dict[str, bytes]:
        return {n: store[n] for n in names if n in store}

    merged = merge_trees(base, ours, theirs, load_many=load_many, known_valid=known)
    assert merged is not None
    expected = _edited(
        layout, {"d3/e4/f1.txt": ("file", b"ours", 0o644), "d17/e2/new": ("file", b"t", 0o644)}
    )
    assert merged.root == trees.build(_entries(expected))[0]
    # Each side's comparison with the base reads 3 directories a side on both sides; the merge
    # itself reads only the root's three: d3 is ours' and d17 theirs', each whole. Not the 221
    # directories of each tree.
    assert merged.read == 2 * 2 * 3 + 3
    assert list(merged.blobs) == [merged.root]  # the one directory neither side had
