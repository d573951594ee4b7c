"""The diff's walk (`paperclip.snapshots.diff`, behind `tree_diff`) against the whole trees:
for any two trees, reading only the directories that differ and decoding only the entries
that differ gives exactly `changes_between` of the two trees read whole, whichever side is
known valid. Names include the ones that trip a comparison of raw bytes: JSON punctuation,
quotes, escapes, and `},{` (the separator of a directory's entries, with its closing quote
after it) (docs/snapshots.md#diff)."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from paperclip.snapshots import trees
from paperclip.snapshots.diff import _Walk, changes_between, path_key
from paperclip.snapshots.trees import Entry, blob_name

NAMES = st.sampled_from(["a", "b", "a},{", "},{", 'q"', "back\\slash", "é", "z\n", ","])
PATHS = st.lists(NAMES, min_size=1, max_size=3).map("/".join)
# ("file", content, mode), ("symlink", target), or ("dir", mode): a directory with that mode
LEAVES = st.one_of(
    st.tuples(st.just("file"), st.sampled_from([b"", b"x", b"yy"]), st.sampled_from([420, 493])),
    st.tuples(st.just("symlink"), st.sampled_from(["a", "b},{", "../a"])),
    st.tuples(st.just("dir"), st.sampled_from([0o755, 0o700])),
)
LAYOUTS = st.dictionaries(PATHS, LEAVES, max_size=12)


def _entries(layout: Mapping[str, tuple[object, ...]]) -> dict[str, Entry]:
    """Entries of `layout`: a path that is another's parent is a directory (its own leaf, if
    any, gives way unless it is a directory's mode)."""
    entries: dict[str, Entry] = {}
    for path in layout:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            entries.setdefault(parent, Entry(name=parts[depth - 1], type="dir", mode=0o755))
    for path, leaf in layout.items():
        name = path.rpartition("/")[2]
        existing = entries.get(path)
        if leaf[0] == "dir":
            mode = leaf[1]
            assert isinstance(mode, int)
            entries[path] = Entry(name=name, type="dir", mode=mode)
        elif existing is not None:
            continue  # a parent of another path: stays a directory
        elif leaf[0] == "symlink":
            entries[path] = Entry(name=name, type="symlink", target=str(leaf[1]))
        else:
            data, mode = leaf[1], leaf[2]
            assert isinstance(data, bytes)
            assert isinstance(mode, int)
            entries[path] = Entry(
                name=name, type="file", mode=mode, size=len(data), digest=blob_name(data)
            )
    return entries


def _whole(root: str, store: Mapping[str, bytes]) -> dict[str, Entry]:
    """Every entry of the tree `root` by path, read whole. Not `trees.walk`: that one also
    refuses symlinks that climb out of the tree, which the diff does not judge (and these
    layouts make)."""
    found: dict[str, Entry] = {}
    pending = [("", root)]
    while pending:
        path, digest = pending.pop()
        for entry in trees.decode_dir(store[digest], path):
            where = trees.join_path(path, entry.name)
            found[where] = entry
            if entry.type == "dir":
                assert entry.digest is not None
                pending.append((where, entry.digest))
    return found


@settings(max_examples=300)
@given(
    before=LAYOUTS,
    after=LAYOUTS,
    shared=LAYOUTS,
    trusted=st.tuples(st.booleans(), st.booleans()),
)
def test_the_walk_gives_the_changes_of_the_whole_trees(
    before: dict[str, tuple[object, ...]],
    after: dict[str, tuple[object, ...]],
    shared: dict[str, tuple[object, ...]],
    trusted: tuple[bool, bool],
) -> None:
    store: dict[str, bytes] = {}
    roots = []
    for layout in (shared | before, shared | after):
        root, blobs = trees.build(_entries(layout))
        store.update(blobs)
        roots.append(root)
    old, new = roots
    walker = _Walk(lambda names: {n: store[n] for n in names}, old, new, trusted=trusted)
    if old != new:
        walker.run()
    found = sorted(walker.found, key=lambda change: path_key(change.path))
    whole = changes_between(_whole(old, store), _whole(new, store))
    assert [c.as_json() for c in found] == [c.as_json() for c in whole]
