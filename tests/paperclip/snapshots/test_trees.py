"""The tree codec's own rules (paperclip/snapshots/trees.py): hostile directory blobs are
refused with the expected reason, and build → walk gives back the same entries."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclip.snapshots import trees
from paperclip.snapshots.trees import EMPTY_DIR, Entry, TreeInvalid, blob_name, canonical_json

FILE = blob_name(b"content")


def _dir(*entries: dict[str, Any]) -> bytes:
    return canonical_json({"entries": list(entries), "schema": "paperclip.dir.v1"})


def _file(name: Any, **over: Any) -> dict[str, Any]:
    return {"name": name, "type": "file", "mode": 0o644, "size": 7, "digest": FILE, **over}


def _walk(root_bytes: bytes, extra: dict[str, bytes] | None = None) -> trees.Walk:
    store = {blob_name(root_bytes): root_bytes, **(extra or {})}
    return trees.walk(blob_name(root_bytes), store.get)


def _reason(root_bytes: bytes, extra: dict[str, bytes] | None = None) -> str:
    with pytest.raises(TreeInvalid) as caught:
        _walk(root_bytes, extra)
    return caught.value.reason


BAD_NAMES = st.one_of(
    st.sampled_from(["", ".", "..", "a/b", "/", "a\0b", "x" * 256, "é" * 128]),
    st.text(min_size=1, max_size=20).map(lambda t: t + "/" + t),
    st.text(min_size=1, max_size=5).map(lambda t: "\0" + t),
    st.integers(),
    st.none(),
)


@given(name=BAD_NAMES)
def test_bad_names_are_refused(name: Any) -> None:
    assert _reason(_dir(_file(name))) == "bad_name"


@given(name=st.text(min_size=1, max_size=30).filter(lambda n: trees.name_problem(n) is None))
def test_duplicates_are_refused(name: str) -> None:
    blob = _dir(_file(name), _file(name))
    assert _reason(blob) in ("duplicate_name", "not_canonical")
    with pytest.raises(TreeInvalid) as caught:
        trees.decode_dir(blob)
    assert caught.value.reason == "duplicate_name"


@given(
    target=st.one_of(
        st.text(min_size=1, max_size=20).map(lambda t: "/" + t),
        st.sampled_from(["/", "/etc/passwd"]),
    )
)
def test_absolute_symlinks_are_refused(target: str) -> None:
    link = {"name": "l", "type": "symlink", "target": target}
    assert _reason(_dir(link)) in ("absolute_symlink", "bad_symlink")


@given(ups=st.integers(min_value=1, max_value=5), tail=st.sampled_from(["", "x", "a/../.."]))
def test_escaping_symlinks_are_refused(ups: int, tail: str) -> None:
    target = "/".join([".."] * ups + ([tail] if tail else []))
    link = {"name": "l", "type": "symlink", "target": target}
    assert _reason(_dir(link)) == "escaping_symlink"


def test_a_symlink_escaping_through_another_symlink_is_refused() -> None:
    # sub/up -> .. (fine alone: the root); sub/out -> up/.. climbs out through it.
    sub = _dir(
        {"name": "out", "type": "symlink", "target": "up/.."},
        {"name": "up", "type": "symlink", "target": ".."},
    )
    root = _dir({"name": "sub", "type": "dir", "mode": 0o755, "digest": blob_name(sub)})
    assert _reason(root, {blob_name(sub): sub}) == "escaping_symlink"
    fine = _dir({"name": "up", "type": "symlink", "target": ".."})
    ok_root = _dir({"name": "sub", "type": "dir", "mode": 0o755, "digest": blob_name(fine)})
    _walk(ok_root, {blob_name(fine): fine})


@given(
    entry=st.sampled_from(
        [
            (_file("a", type="fifo"), "bad_type"),
            (_file("a", type=1), "bad_type"),
            (_file("a", mode=True), "bad_mode"),
            (_file("a", mode=0o10000), "bad_mode"),
            (_file("a", mode=-1), "bad_mode"),
            (_file("a", mode="644"), "bad_mode"),
            (_file("a", size=False), "bad_size"),
            (_file("a", size=-1), "bad_size"),
            (_file("a", size=1.5), "bad_size"),
            (_file("a", digest="sha256:XYZ"), "bad_digest"),
            (_file("a", extra=1), "bad_fields"),
            ({"name": "a", "type": "dir", "mode": 0o755, "digest": 5}, "bad_digest"),
            ({"name": "a", "type": "symlink", "target": ""}, "bad_symlink"),
            ({"name": "a", "type": "symlink", "target": 3}, "bad_symlink"),
            (
                {"name": "a", "type": "file", "mode": 0, "size": 1, "chunks": [FILE]},
                "bad_chunks",
            ),
            ("not an object", "bad_entry"),
        ]
    )
)
def test_wrong_types_are_refused(entry: tuple[Any, str]) -> None:
    raw, reason = entry
    assert _reason(_dir(raw)) == reason


@given(
    blob=st.sampled_from(
        [
            (b'{"schema":"paperclip.dir.v1","entries":[]}', "not_canonical"),  # key order
            (b'{"entries": [], "schema": "paperclip.dir.v1"}', "not_canonical"),  # spaces
            (EMPTY_DIR + b"\n", "not_canonical"),
            (b'{"entries":[],"schema":"paperclip.dir.v2"}', "unknown_schema"),
            (b'{"entries":{},"schema":"paperclip.dir.v1"}', "not_a_directory"),
            (b'{"entries":[],"schema":"paperclip.dir.v1","x":1}', "not_a_directory"),
            (b"[]", "not_a_directory"),
            (b"\xff", "not_json"),
            (
                b'{"entries":[],"entries":[],"schema":"paperclip.dir.v1"}',
                "not_json",
            ),  # duplicate key
        ]
    )
)
def test_non_canonical_or_foreign_bytes_are_refused(blob: tuple[bytes, str]) -> None:
    data, reason = blob
    assert _reason(data) == reason


@given(
    names=st.lists(
        st.text(min_size=1, max_size=12).filter(lambda n: trees.name_problem(n) is None),
        max_size=8,
        unique=True,
    )
)
def test_the_quick_decode_of_a_canonical_blob_is_the_strict_one(names: list[str]) -> None:
    blob = trees.encode_dir(
        Entry(name=n, type="file", mode=0o644, size=7, digest=FILE) for n in names
    )
    assert trees._decode_canonical(blob, "") == trees._decode_strict(blob, "")
    assert {e.name for e in trees.decode_dir(blob)} == set(names)
    unsorted = canonical_json({"entries": [_file(n) for n in names[::-1]], "schema": trees.SCHEMA})
    if len(names) > 1 and unsorted != blob:
        assert trees._decode_canonical(unsorted, "") is None  # the strict decode says why


def test_unsorted_entries_are_not_canonical() -> None:
    raw = canonical_json({"entries": [_file("b"), _file("a")], "schema": "paperclip.dir.v1"})
    assert _reason(raw) == "not_canonical"


def test_depth_over_256_is_refused_and_256_is_fine() -> None:
    def chain(levels: int) -> tuple[bytes, dict[str, bytes]]:
        store: dict[str, bytes] = {}
        child = EMPTY_DIR
        for _ in range(levels):
            store[blob_name(child)] = child
            child = _dir({"name": "d", "type": "dir", "mode": 0o755, "digest": blob_name(child)})
        return child, store

    deep, store = chain(trees.MAX_DEPTH + 1)
    assert _reason(deep, store) == "too_deep"
    fine, store = chain(trees.MAX_DEPTH)
    assert len(_walk(fine, store).directories) == trees.MAX_DEPTH + 1


def test_a_cycle_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real hashes cannot cycle: a fake `load` (and names it vouches for) can, the child
    directory naming the root's digest."""
    root_name = "sha256:" + "1" * 64
    child_name = "sha256:" + "2" * 64
    root = _dir({"name": "a", "type": "dir", "mode": 0o755, "digest": child_name})
    child = _dir({"name": "b", "type": "dir", "mode": 0o755, "digest": root_name})
    fake = {root_name: root, child_name: child}
    names = {root: root_name, child: child_name}
    monkeypatch.setattr(trees, "blob_name", lambda data: names[data])
    with pytest.raises(TreeInvalid) as caught:
        trees.walk(root_name, fake.get)
    assert caught.value.reason == "cycle"
    assert caught.value.path == "a/b"


# --- round trip -------------------------------------------------------------------------------

NAMES = st.text(
    alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=12,
).filter(lambda n: n not in (".", ".."))


@st.composite
def entry_sets(draw: st.DrawFn) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    directories = [""]
    for _ in range(draw(st.integers(min_value=0, max_value=25))):
        parent = draw(st.sampled_from(directories))
        name = draw(NAMES)
        path = f"{parent}/{name}" if parent else name
        if path in entries:
            continue
        kind = draw(st.sampled_from(["file", "file", "dir", "symlink"]))
        if kind == "dir":
            entries[path] = Entry(name=name, type="dir", mode=draw(st.integers(0, 0o7777)))
            directories.append(path)
        elif kind == "file":
            data = draw(st.binary(max_size=20))
            entries[path] = Entry(
                name=name,
                type="file",
                mode=draw(st.integers(0, 0o7777)),
                size=len(data),
                digest=blob_name(data),
            )
        else:
            # Its own directory: stays inside and resolves (a link to itself is a loop).
            entries[path] = Entry(name=name, type="symlink", target=".")
    return entries


@settings(max_examples=60)
@given(entries=entry_sets())
def test_build_then_walk_gives_the_same_entries(entries: dict[str, Entry]) -> None:
    root, blobs = trees.build(entries)
    walked = trees.walk(root, blobs.get)
    assert walked.missing == []
    assert set(walked.entries) == set(entries)
    for path, entry in entries.items():
        got = walked.entries[path]
        if entry.type == "dir":
            assert (got.type, got.mode, got.name) == ("dir", entry.mode, entry.name)
        else:
            assert got == entry
    assert walked.files == sum(1 for e in entries.values() if e.type == "file")
    assert set(blobs) == set(walked.directories)
    # Canonical: decoding and re-encoding every directory gives its bytes back.
    for data in blobs.values():
        assert trees.encode_dir(trees.decode_dir(data)) == data
    assert json.loads(blobs[root])["schema"] == "paperclip.dir.v1"
    # A tree known valid walks to the same entries without re-checking each directory.
    known = trees.walk(root, blobs.get, known_valid=True)
    assert (known.entries, known.files, known.directories) == (
        walked.entries,
        walked.files,
        walked.directories,
    )


@settings(max_examples=40)
@given(entries=entry_sets())
def test_a_walk_without_files_counts_and_reaches_the_same(entries: dict[str, Entry]) -> None:
    root, blobs = trees.build(entries)
    whole, lean = trees.walk(root, blobs.get), trees.walk(root, blobs.get, keep_files=False)
    assert lean.entries == {p: e for p, e in whole.entries.items() if e.type != "file"}
    assert (lean.files, lean.bytes, lean.reached()) == (whole.files, whole.bytes, whole.reached())


def test_a_walk_without_files_still_refuses_escaping_symlinks_and_too_many_entries() -> None:
    sub = _dir(
        {"name": "out", "type": "symlink", "target": "up/.."},
        {"name": "up", "type": "symlink", "target": ".."},
    )
    root = _dir({"name": "sub", "type": "dir", "mode": 0o755, "digest": blob_name(sub)})
    store = {blob_name(root): root, blob_name(sub): sub}
    with pytest.raises(TreeInvalid, match="escaping_symlink"):
        trees.walk(blob_name(root), store.get, keep_files=False)
    files = _dir(_file("a"), _file("b"), _file("c"))
    with pytest.raises(TreeInvalid, match="too_many_entries"):
        trees.walk(blob_name(files), {blob_name(files): files}.get, max_entries=2, keep_files=False)


@pytest.mark.parametrize(
    ("links", "reason"),
    [
        ({"a": "b", "b": "a"}, "symlink_loop"),
        ({"a": "a"}, "symlink_loop"),
        ({"a": "a/.."}, "symlink_loop"),
        ({"a": "b", "b": "c", "c": "a/x"}, "symlink_loop"),
        ({"d/l": "m", "d/m": "..", "d/x": "l/../.."}, "escaping_symlink"),
    ],
)
def test_links_that_never_resolve_or_resolve_outside_are_refused(
    links: dict[str, str], reason: str
) -> None:
    entries = {"d": Entry(name="d", type="dir", mode=0o755)} | {
        path: Entry(name=path.rpartition("/")[2], type="symlink", target=target)
        for path, target in links.items()
    }
    with pytest.raises(TreeInvalid) as refused:
        trees.check_symlinks(entries)
    assert refused.value.reason == reason


def test_a_chain_of_links_that_ends_inside_is_fine() -> None:
    links = {f"l{i}": f"l{i + 1}" for i in range(30)} | {"l30": "d/..", "d/up": "../l0"}
    entries = {"d": Entry(name="d", type="dir", mode=0o755)} | {
        path: Entry(name=path.rpartition("/")[2], type="symlink", target=target)
        for path, target in links.items()
    }
    trees.check_symlinks(entries)


def _links(links: dict[str, str], dirs: tuple[str, ...] = ("d",)) -> dict[str, Entry]:
    return {path: Entry(name=path.rpartition("/")[2], type="dir", mode=0o755) for path in dirs} | {
        path: Entry(name=path.rpartition("/")[2], type="symlink", target=target)
        for path, target in links.items()
    }


@pytest.mark.parametrize(
    ("links", "reason"),
    [
        ({"d/l": "nope/x/../../.."}, None),  # below a name the tree lacks, and back out
        ({"d/l": "nope/../../.."}, "escaping_symlink"),
        ({"d/f": "l/../..", "d/l": "nope/x"}, None),  # through a link to where nothing is
        ({"d/f": "l/../../../..", "d/l": "nope/x"}, "escaping_symlink"),
    ],
)
def test_names_the_tree_lacks_are_climbed_back_out_of_as_text(
    links: dict[str, str], reason: str | None
) -> None:
    if reason is None:
        trees.check_symlinks(_links(links))
        return
    with pytest.raises(TreeInvalid) as refused:
        trees.check_symlinks(_links(links))
    assert refused.value.reason == reason


def test_resolving_links_is_bounded_by_the_target_components_resolved_path_by_path() -> None:
    """Three paths of one shared directory holding `a -> .` (1 component) and
    `l -> a/a/a/a` (4): 15 components resolved, each path's links on their own (`l` goes
    through `a` at its own path, resolved once there)."""
    dirs = ("d0", "d1", "d2")
    links = {f"{d}/{name}": target for d in dirs for name, target in (("a", "."), ("l", "a/a/a/a"))}
    trees.check_symlinks(_links(links, dirs), max_steps=15)
    with pytest.raises(TreeInvalid) as refused:
        trees.check_symlinks(_links(links, dirs), max_steps=14)
    assert (refused.value.path, refused.value.reason) == ("d2/l", "too_many_entries")
    # `.` and empty components count (5 here): skipping one is a step as any other
    trees.check_symlinks(_links({"d/l": "./././/."}), max_steps=5)
    with pytest.raises(TreeInvalid, match="too_many_entries"):
        trees.check_symlinks(_links({"d/l": "./././/."}), max_steps=4)


def test_fifty_thousand_short_links_resolve_within_the_default_bound() -> None:
    """A large legitimate tree (a package manager's links): 350,000 components, far inside
    the default 5,000,000 (about 2 s of resolving at most, docs/snapshots.md#trees)."""
    entries = _links(
        {
            f"pkg{p}/node_modules/m{m}": f"../../pkg{(p + m) % 500}/lib/x/../index.js"
            for p in range(500)
            for m in range(100)
        },
        tuple(f"pkg{p}{below}" for p in range(500) for below in ("", "/node_modules", "/lib")),
    )
    trees.check_symlinks(entries)


def _reference(entries: dict[str, Entry]) -> tuple[str, str] | None:
    """The check as it was before places were numbered (each component joined into a path
    and looked up): what the bounded check must still decide, link for link."""
    resolved: dict[str, str] = {}

    def follow(path: str, entry: Entry, link: str, hops: int) -> str:
        if path in resolved:
            return resolved[path]
        if hops > 40:
            raise TreeInvalid(link, "symlink_loop")
        parts = [p for p in path.rpartition("/")[0].split("/") if p]
        for component in (c for c in entry.target.split("/") if c not in ("", ".")):
            if component == "..":
                if not parts:
                    raise TreeInvalid(link, "escaping_symlink")
                parts.pop()
                continue
            parts.append(component)
            found = entries.get("/".join(parts))
            if found is not None and found.type == "symlink":
                parts = [p for p in follow("/".join(parts), found, link, hops + 1).split("/") if p]
        resolved[path] = "/".join(parts)
        return resolved[path]

    try:
        for path, entry in entries.items():
            if entry.type == "symlink":
                follow(path, entry, path, 0)
    except TreeInvalid as exc:
        return exc.path, exc.reason
    return None


NAMES = st.sampled_from(["a", "b", "d", "l"])
TARGETS = st.lists(st.sampled_from(["a", "b", "d", "l", "..", ".", ""]), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.lists(NAMES, min_size=1, max_size=3).map("/".join), TARGETS, max_size=6),
    st.lists(st.lists(NAMES, min_size=1, max_size=2).map("/".join), max_size=4),
)
def test_the_bounded_check_decides_as_the_path_by_path_one(
    links: dict[str, list[str]], dirs: list[str]
) -> None:
    directories = {
        d for d in dirs if d not in links and not any(d.startswith(f"{p}/") for p in links)
    }
    entries = _links({path: "/".join(target) for path, target in links.items()}, tuple(directories))
    try:
        trees.check_symlinks(entries)
        found = None
    except TreeInvalid as exc:
        found = (exc.path, exc.reason)
    assert found == _reference(entries)
