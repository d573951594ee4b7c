"""`changes.walk_changes`: a tree compared with a valid head, read only where the two differ.
Whenever it vouches for a tree, the whole walk agrees: the tree is valid, the counts are the
same, and every blob the tree reaches is either among the ones it names new or reached by the
head (docs/snapshots.md#registering-against-the-head)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from paperclip.snapshots import trees
from paperclip.snapshots.changes import walk_changes
from paperclip.snapshots.trees import Entry, TreeInvalid, blob_name

type Leaf = tuple[str, bytes | str]  # ("file", content) or ("symlink", target)

# `a},{` puts the separator of a directory's entries, `},{"`, inside its entry.
PATHS = st.lists(st.sampled_from(["a", "b", "c", "a},{"]), min_size=1, max_size=4).map("/".join)
LEAVES: st.SearchStrategy[Leaf] = st.one_of(
    st.sampled_from([b"x", b"y", b"zz", b""]).map(lambda d: ("file", d)),
    st.sampled_from(["a", "../a", "b/..", "../..", "../../..", "/etc", "c/a", "a},{"]).map(
        lambda t: ("symlink", t)
    ),
)
LAYOUTS = st.dictionaries(PATHS, LEAVES, max_size=10)


def _entries(layout: Mapping[str, Leaf]) -> dict[str, Entry]:
    """Entries of `layout`: a leaf whose path is also another leaf's parent gives way to the
    directory."""
    parents = {p.rsplit("/", 1)[0] for p in layout if "/" in p}
    parents |= {"/".join(p.split("/")[:i]) for p in parents for i in range(1, p.count("/") + 1)}
    entries: dict[str, Entry] = {}
    for path in parents:
        entries[path] = Entry(name=path.rpartition("/")[2], type="dir", mode=0o755)
    for path, (kind, value) in layout.items():
        if path in parents:
            continue
        name = path.rpartition("/")[2]
        if kind == "symlink":
            assert isinstance(value, str)
            entries[path] = Entry(name=name, type="symlink", target=value)
        else:
            assert isinstance(value, bytes)
            digest = blob_name(value)
            entries[path] = Entry(
                name=name, type="file", mode=0o644, size=len(value), digest=digest
            )
    return entries


def _store(layout: Mapping[str, Leaf], store: dict[str, bytes]) -> str:
    root, blobs = trees.build(_entries(layout))
    store.update(blobs)
    return root


def _check(
    head_layout: Mapping[str, Leaf], layout: Mapping[str, Leaf], *, known: bool = False
) -> None:
    store: dict[str, bytes] = {}
    head, tree = _store(head_layout, store), _store(layout, store)
    try:
        head_walk = trees.walk(head, load=store.get)
    except TreeInvalid:
        assume(False)  # only a valid head is ever compared with
        return

    def load_many(names: list[str]) -> dict[str, bytes]:
        return {n: store[n] for n in names if n in store}

    changes = walk_changes(tree, head, load_many=load_many, head_known_valid=known)
    links = {p: e.target for p, e in _entries(layout).items() if e.type == "symlink"}
    head_links = {p: e.target for p, e in _entries(head_layout).items() if e.type == "symlink"}
    if links == head_links:
        assert changes is not None  # same symlinks: never sent to the whole walk for nothing
    if changes is None:
        return
    full = trees.walk(tree, load=store.get)  # vouched for: the whole walk must agree
    assert full.files == head_walk.files + changes.files
    assert full.bytes == head_walk.bytes + changes.bytes
    assert full.count == head_walk.count + changes.entries
    assert full.reached() <= changes.new | head_walk.reached()
    assert changes.new <= full.reached()
    directories = sum(
        1 + sum(e.type == "dir" for e in _entries(side).values()) for side in (layout, head_layout)
    )
    assert changes.read <= directories  # never more than both whole walks would read


@given(head=LAYOUTS, tree=LAYOUTS, known=st.booleans())
def test_any_two_trees(head: dict[str, Leaf], tree: dict[str, Leaf], known: bool) -> None:
    _check(head, tree, known=known)


@given(head=LAYOUTS, edits=LAYOUTS, removed=st.sets(PATHS, max_size=3), known=st.booleans())
def test_a_tree_edited_from_the_head(
    head: dict[str, Leaf], edits: dict[str, Leaf], removed: set[str], known: bool
) -> None:
    tree = {p: leaf for p, leaf in head.items() if not any(p.startswith(r) for r in removed)}
    _check(head, tree | edits, known=known)


@pytest.mark.parametrize("known", [False, True], ids=["head-decoded", "head-known-valid"])
def test_a_change_reads_only_its_own_directories(known: bool) -> None:
    store: dict[str, bytes] = {}
    layout: dict[str, Leaf] = {
        f"d{i}/s{j}/f{k}": ("file", b"%d" % k)
        for i in range(20)
        for j in range(5)
        for k in range(3)
    }
    head = _store(layout, store)
    tree = _store(layout | {"d7/s2/f1": ("file", b"changed")}, store)
    changes = walk_changes(
        tree, head, load_many=lambda ns: {n: store[n] for n in ns}, head_known_valid=known
    )
    assert changes is not None
    # The root, d7 and d7/s2 on each side, of 121 directories per tree.
    assert changes.read == 6
    assert changes.new == {tree, *_dirs_on(tree, store, "d7", "d7/s2"), blob_name(b"changed")}
    assert (changes.files, changes.bytes, changes.entries) == (0, len(b"changed") - 1, 0)


def _dirs_on(root: str, store: Mapping[str, bytes], *paths: str) -> set[str]:
    walked = trees.walk(root, load=store.get)
    return {digest for digest, path in walked.directories.items() if path in paths}


@pytest.mark.parametrize(
    "edit",
    [
        {"d/link": ("symlink", "../..")},  # a symlink added (escaping)
        {"d/link": ("symlink", "f")},  # a symlink added (fine)
        {"e/old": ("file", b"now a file")},  # a symlink replaced
    ],
)
def test_a_changed_symlink_sends_the_tree_to_the_whole_walk(edit: dict[str, Leaf]) -> None:
    store: dict[str, bytes] = {}
    layout: dict[str, Leaf] = {"d/f": ("file", b"1"), "e/old": ("symlink", "../d/f")}
    head = _store(layout, store)
    tree = _store(layout | edit, store)
    assert walk_changes(tree, head, load_many=lambda ns: {n: store[n] for n in ns}) is None


def test_a_directory_missing_on_either_side_sends_it_to_the_whole_walk() -> None:
    store: dict[str, bytes] = {}
    head = _store({"d/f": ("file", b"1")}, store)
    tree = _store({"d/f": ("file", b"2")}, store)
    for lost in (head, tree):
        partial = {n: d for n, d in store.items() if n != lost}
        assert (
            walk_changes(
                tree, head, load_many=lambda ns, s=partial: {n: s[n] for n in ns if n in s}
            )
            is None
        )
