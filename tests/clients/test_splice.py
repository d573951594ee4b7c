"""A directory blob changed in a few entries (`workdir.splice`): whatever the names and symlink
targets hold (the very bytes the splice cuts at, `"name":`, quotes, backslashes, braces,
non-ASCII of one to four bytes), the old blob's bytes with the changes spliced in are exactly
the changed entries encoded afresh; a watched partial scan builds the full scan's tree after
edits, new files, deletions and renames, without decoding any changed directory whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclip_client.workdir import splice
from paperclip_client.workdir.splice import Entries, decode_entries, encode_entries
from tests.clients.test_watch import Watcher, full_tree, settled, take, watch, watchers
from tests.clients.test_workdir import FakeStore, make

__all__ = ["watchers"]  # the fixture, used by name

type Raw = dict[str, Any]

PIECES = ['},{"', '"name":', '"', "\\", "{", "}", ",", ":", "[", "]", "é", "€", "😀", "\u2028"]
names = (
    st.lists(st.sampled_from([*PIECES, "a", "b", "n"]), min_size=1, max_size=5)
    .map("".join)
    .filter(lambda n: n not in (".", ".."))
)
targets = st.lists(st.sampled_from([*PIECES, "a", "/", "..", "."]), min_size=1, max_size=5).map(
    "".join
)
digests = st.text(alphabet="0123456789abcdef", min_size=1, max_size=4).map(lambda h: f"sha256:{h}")
modes = st.integers(0, 0o7777)


@st.composite
def entries(draw: st.DrawFn, name: str) -> Raw:
    kind = draw(st.sampled_from(["file", "chunked", "dir", "symlink"]))
    if kind == "symlink":
        return {"name": name, "type": "symlink", "target": draw(targets)}
    if kind == "dir":
        return {"name": name, "type": "dir", "mode": draw(modes), "digest": draw(digests)}
    content: Raw = (
        {"chunks": draw(st.lists(digests, min_size=2, max_size=3))}
        if kind == "chunked"
        else {"digest": draw(digests)}
    )
    size = draw(st.integers(0, 2**40))
    return {"name": name, "type": "file", "mode": draw(modes), "size": size, **content}


@st.composite
def directories(draw: st.DrawFn) -> dict[str, Raw]:
    return {n: draw(entries(n)) for n in draw(st.sets(names, max_size=10))}


@st.composite
def changes(draw: st.DrawFn, old: dict[str, Raw]) -> dict[str, Raw | None]:
    """Entries replaced or removed among `old`'s, and new ones (some None: not there)."""
    picked = draw(st.sets(st.sampled_from(sorted(old)), max_size=len(old))) if old else set()
    added = draw(st.sets(names, max_size=5))
    return {n: draw(st.none() | entries(n)) for n in picked | added}


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_a_spliced_directory_is_its_changed_entries_encoded_afresh(data: st.DataObject) -> None:
    old = data.draw(directories())
    change = data.draw(changes(old))
    blob = encode_entries(old)
    expected = dict(old)
    for name, entry in change.items():
        if entry is None:
            expected.pop(name, None)
        else:
            expected[name] = entry
    spliced = Entries(blob, _no_decoding)
    for name, entry in change.items():
        if entry is None:
            assert spliced.pop(name) == old.get(name)
        else:
            spliced[name] = entry
    assert spliced.encode() == encode_entries(expected)
    assert spliced.whole is None  # spliced, not decoded whole


@settings(max_examples=300, deadline=None)
@given(directories(), st.sets(names, max_size=5))
def test_every_entry_is_found_in_the_bytes_and_no_other(
    old: dict[str, Raw], others: set[str]
) -> None:
    found = Entries(encode_entries(old), _no_decoding)
    for name in [*old, *others]:
        assert found.get(name) == old.get(name)
        assert (name in found) == (name in old)


def _no_decoding(blob: bytes) -> dict[str, Raw]:
    raise AssertionError("decoded whole")


def test_a_blob_not_in_the_canonical_form_is_decoded_whole_and_encoded_afresh() -> None:
    old: dict[str, Raw] = {
        "a": {"name": "a", "type": "file", "mode": 420, "size": 1, "digest": "sha256:1"},
        "c": {"name": "c", "type": "symlink", "target": "a"},
    }
    blob = json.dumps({"entries": list(old.values()), "schema": "paperclip.dir.v1"}).encode()
    spliced = Entries(blob, decode_entries)
    spliced["b"] = {"name": "b", "type": "dir", "mode": 493, "digest": "sha256:2"}
    assert spliced.encode() == encode_entries({**old, "b": spliced["b"]})
    assert spliced.whole is not None


WEIRD = ['x},{"name":"y', '"name":"q",', 'quo"te', "back\\slash", "{brace}", "é€😀", "a},{"]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many blobs the partial scan decodes whole."""
    decoded: list[int] = []
    real = splice.decode_entries

    def count(blob: bytes) -> dict[str, Raw]:
        decoded.append(len(blob))
        return real(blob)

    monkeypatch.setattr(splice, "decode_entries", count)
    return decoded


def test_a_watched_scan_splices_edits_new_files_deletions_and_renames(
    tmp_path: Path, watchers: list[Watcher], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each round's partial scan builds the full scan's tree, and decodes no blob whole: the
    changed directories and those above them are spliced."""
    store, root = FakeStore(), tmp_path / "w"
    files: dict[str, str | bytes] = {
        f"d{i}/s{j % 2}/{WEIRD[j % len(WEIRD)]}{j}": f"{i} {j}" for i in range(3) for j in range(12)
    }
    make(root, {**files, "top": "top"})
    os.symlink('x},{"name":"y0', root / "d0/s0/link")
    watch(watchers, root)
    settled(store, root)
    decoded = _counting(monkeypatch)
    rounds: list[Callable[[], object]] = [
        lambda: (root / 'd0/s0/x},{"name":"y0').write_text("edited"),
        lambda: (root / "d1/s1/é€😀5").write_text("edited"),
        lambda: (root / 'd2/s0/"name":"q",new').write_text("new"),
        lambda: (root / "d0/s1/0new").write_text("first in its directory"),
        lambda: (root / "d0/s1/~new").write_text("last in its directory"),
        lambda: (root / "d1/s0/back\\slash10").unlink(),
        lambda: os.rename(root / "d2/s1/{brace}11", root / "d2/s1/a},{renamed"),
        lambda: os.rename(root / "d0/s0/a},{6", root / "d1/s0/a},{6"),
        lambda: (root / "d2/s0/link2").symlink_to('../s1/quo"te9'),
        lambda: (root / "d0/s0/link").unlink(),
        lambda: (root / "top").write_text("the root's own file"),
    ]
    for number, edit in enumerate(rounds):
        edit()
        result, line = take(store, root)
        assert line.startswith("watcher: "), line
        assert result.tree == full_tree(root), f"round {number}: {line}"
        assert decoded == [], f"round {number}: decoded whole"


def test_a_name_that_is_not_utf8_is_in_no_blob() -> None:
    """A name on disk that is not UTF-8 (a surrogate escape) is never in a tree: looked up or
    removed, the blob is as it was."""
    old: dict[str, Raw] = {"a": {"name": "a", "type": "symlink", "target": "b"}}
    spliced = Entries(encode_entries(old), _no_decoding)
    assert spliced.get("\udcff") is None
    assert spliced.pop("\udcff") is None
    assert spliced.encode() == encode_entries(old)


def test_past_the_searches_allowed_the_blob_is_decoded_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each lookup searches the blob: past `MAX_SEARCHED` (many changes in a large directory)
    one whole decoding is cheaper, and the result is the same."""
    old: dict[str, Raw] = {
        f"f{i}": {"name": f"f{i}", "type": "symlink", "target": "t"} for i in range(9)
    }
    blob = encode_entries(old)
    monkeypatch.setattr(splice, "MAX_SEARCHED", 3 * len(blob))
    decoded: list[bytes] = []

    def decode(data: bytes) -> dict[str, Raw]:
        decoded.append(data)
        return decode_entries(data)

    spliced = Entries(blob, decode)
    for i in range(6):
        spliced[f"f{i}"] = {"name": f"f{i}", "type": "symlink", "target": f"new {i}"}
        assert spliced.get(f"f{i + 3}") == old[f"f{i + 3}"]
    expected = {**old, **{f"f{i}": spliced[f"f{i}"] for i in range(6)}}
    assert spliced.encode() == encode_entries(expected)
    assert decoded == [blob]
