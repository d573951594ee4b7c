"""`changes.differing_entries`: a directory blob compared piece by piece with one known valid
decides exactly what `decode_dir` decides, for any bytes: the same reason when it refuses, and
when it accepts, the entries that differ on each side (the ones the two hold byte for byte left
out). Registration against the head relies on it to validate an agent's directories
(docs/snapshots.md#registering-against-the-head)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclip.snapshots import changes, trees
from paperclip.snapshots.trees import Entry, TreeInvalid, blob_name, canonical_json

# Names that sort differently escaped and raw, that look like the framing (`a},{` and `},{`
# put the separator `},{"` inside an entry, with their closing quote), or like a key.
NAMES = st.one_of(
    st.sampled_from(
        [
            *["a", "b", "é", 'a"b', "a\\b", "a\nb", "\x01", "z", '},{"', 'x","name":"a', "name"],
            *["a},{", "},{", 'b","type":"dir"},{'],
        ]
    ),
    st.text(
        alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=6,
    ).filter(lambda n: n not in (".", "..")),
)


@st.composite
def entries(draw: st.DrawFn) -> list[Entry]:
    found: dict[str, Entry] = {}
    for name in draw(st.lists(NAMES, max_size=8)):
        kind = draw(st.sampled_from(["file", "dir", "symlink"]))
        data = draw(st.sampled_from([b"", b"x", b"yy"]))
        if kind == "file":
            mode = draw(st.sampled_from([0o644, 0o755, 0o4755]))
            found[name] = Entry(
                name=name, type="file", mode=mode, size=len(data), digest=blob_name(data)
            )
        elif kind == "dir":
            found[name] = Entry(name=name, type="dir", mode=0o755, digest=blob_name(data))
        else:
            found[name] = Entry(
                name=name, type="symlink", target=draw(st.sampled_from(["a", "b", "c},{"]))
            )
    return list(found.values())


@st.composite
def pairs(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A known valid directory and bytes to compare with it: another valid directory sharing
    some of its entries, or hostile bytes made from its pieces."""
    known_entries = draw(entries())
    known = trees.encode_dir(known_entries)
    pieces = trees.entry_pieces(known)
    assert pieces is not None
    how = draw(
        st.sampled_from(["valid", "shuffled", "repeated", "spliced", "mutated", "raw_piece"])
    )
    if how == "valid":
        kept = [e for e in known_entries if draw(st.booleans())]
        return known, trees.encode_dir({e.name: e for e in kept + draw(entries())}.values())
    if how in ("shuffled", "repeated", "spliced"):
        chosen = list(pieces)
        if how == "shuffled":
            random.Random(draw(st.integers(0, 1000))).shuffle(chosen)
        elif how == "repeated" and chosen:
            at = draw(st.integers(0, len(chosen) - 1))
            chosen.insert(at, chosen[at])
        else:  # another directory's piece between, anywhere
            other = trees.entry_pieces(trees.encode_dir(draw(entries()))) or []
            for piece in other:
                chosen.insert(draw(st.integers(0, len(chosen))), piece)
        return known, _framed(chosen)
    if how == "raw_piece":  # an entry's JSON not in canonical form (spaces, key order)
        text = draw(
            st.sampled_from(
                [
                    b'digest":"%s", "mode":420,"name":"q","size":0,"type":"file"',
                    b'mode":420,"digest":"%s","name":"q","size":0,"type":"file"',
                    b'digest":"%s","mode":420,"name":"q","name":"r","size":0,"type":"file"',
                    b'digest":"%s","mode":420,"name":"\\u0071","size":0,"type":"file"',
                    b'digest":"%s","mode":420,"name":"q","size":0,"type":"file"',
                ]
            )
        )
        chosen = list(pieces)
        chosen.insert(draw(st.integers(0, len(chosen))), text % blob_name(b"").encode())
        return known, _framed(chosen)
    data = bytearray(known if draw(st.booleans()) else _framed(pieces[::-1]))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if draw(st.booleans()) and data:
            del data[at]
        else:
            data[at:at] = draw(st.sampled_from([b'"', b",", b"}", b"{", b" ", b"\\", b"a", b"0"]))
    return known, bytes(data)


def _framed(pieces: list[bytes]) -> bytes:
    body = b'{"' + b'},{"'.join(pieces) + b"}" if pieces else b""
    return b'{"entries":[' + body + b'],"schema":"' + trees.SCHEMA.encode() + b'"}'


@settings(max_examples=400)
@given(pair=pairs())
def test_the_piece_by_piece_check_decides_as_decode_dir(pair: tuple[bytes, bytes]) -> None:
    known, data = pair
    refused: TreeInvalid | None = None
    try:
        decoded = trees.decode_dir(data, "p")
    except TreeInvalid as exc:
        refused = exc
    if refused is not None:
        with pytest.raises(TreeInvalid) as caught:
            changes.differing_entries(data, known, "p")
        assert (caught.value.path, caught.value.reason) == (refused.path, refused.reason)
        return
    own, old = changes.differing_entries(data, known, "p")
    ours, theirs = trees.entry_pieces(data), trees.entry_pieces(known)
    assert ours is not None
    assert theirs is not None
    assert own == {e.name: e for e, piece in zip(decoded, ours, strict=True) if piece not in theirs}
    assert old == {
        e.name: e
        for e, piece in zip(trees.decode_dir(known), theirs, strict=True)
        if piece not in ours
    }


@pytest.mark.parametrize(
    ("known_names", "names"),
    [
        (["a", "b"], ["b", "a"]),
        (["a"], ["a", "a"]),
        (['a"'], ['a"', "a"]),
        (["a\\"], ["b", "a\\"]),
        (["a\n"], ["a\n", "a"]),
        (["b"], ["c", "b"]),
        (["é"], ["é", "z"]),
    ],
    ids=["known-swapped", "known-repeated", "quote", "backslash", "control", "new-first", "utf8"],
)
def test_entries_out_of_order_are_refused(known_names: list[str], names: list[str]) -> None:
    """Each entry valid, the blob refused for its order alone: between two known pieces the
    known directory's order proves it, beside a new piece the names (escaped or not) do."""

    def file(name: str) -> Entry:
        return Entry(name=name, type="file", mode=0o644, size=0, digest=blob_name(b""))

    everything = trees.encode_dir(file(n) for n in {*known_names, *names})
    piece_of = {
        e.name: piece
        for e, piece in zip(
            trees.decode_dir(everything), trees.entry_pieces(everything) or [], strict=True
        )
    }
    known = trees.encode_dir(file(n) for n in known_names)
    data = _framed([piece_of[n] for n in names])
    sorted_names = sorted(set(names), key=lambda n: n.encode())
    if names != sorted_names:
        with pytest.raises(TreeInvalid) as refused:
            trees.decode_dir(data)
        with pytest.raises(TreeInvalid) as caught:
            changes.differing_entries(data, known, "")
        assert caught.value.reason == refused.value.reason
    else:  # in order: accepted, the new entries only
        own, _ = changes.differing_entries(data, known, "")
        assert set(own) == set(names) - set(known_names)


def test_an_unchanged_directory_decodes_nothing() -> None:
    known = canonical_json(
        {
            "entries": [
                {"name": "a", "type": "file", "mode": 420, "size": 0, "digest": blob_name(b"")}
            ],
            "schema": trees.SCHEMA,
        }
    )
    assert changes.differing_entries(known, known, "") == ({}, {})


@given(found=entries())
def test_a_known_valid_directory_decodes_to_the_same_entries(found: list[Entry]) -> None:
    data = trees.encode_dir(found)
    assert trees.decode_known_dir(data, "p") == trees.decode_dir(data, "p")


@given(ours=entries(), theirs=entries(), shared=entries())
def test_a_pair_of_known_valid_directories_decodes_as_each_alone(
    ours: list[Entry], theirs: list[Entry], shared: list[Entry]
) -> None:
    """`decode_known_pair` (materialization's diff) answers what decoding each directory alone
    answers, but for the regular files both hold byte for byte with no mode bit above 0o777:
    those are on neither side but apart, in name order, as their JSON objects."""
    now = trees.encode_dir({e.name: e for e in shared + ours}.values())
    then = trees.encode_dir({e.name: e for e in shared + theirs}.values())
    pair = changes.decode_known_pair(now, then, "p")
    whole_now, whole_then = trees.decode_dir(now, "p"), trees.decode_dir(then, "p")
    alike = [e for e in whole_now if e in whole_then and e.type == "file" and e.mode <= 0o777]
    assert pair.alike == [e.as_json() for e in alike]
    assert pair.now == tuple(e for e in whole_now if e not in alike)
    assert pair.then == tuple(e for e in whole_then if e not in alike)
    assert (pair.now, pair.then) == (
        tuple(e for e in trees.decode_known_dir(now, "p") if e not in alike),
        tuple(e for e in trees.decode_known_dir(then, "p") if e not in alike),
    )


def test_files_held_alike_with_a_special_mode_bit_or_chunks() -> None:
    """A setuid file stays an entry on both sides (materialization drops the bit, so the disk
    never shows it); a chunked file held alike is apart with its chunks."""
    chunks = (blob_name(b"a"), blob_name(b"b"))
    setuid = Entry(name="s", type="file", mode=0o4755, size=1, digest=blob_name(b"s"))
    big = Entry(name="big", type="file", mode=0o600, size=2, chunks=chunks)
    before = Entry(name="f", type="file", mode=0o644, size=1, digest=blob_name(b"1"))
    after = Entry(name="f", type="file", mode=0o644, size=1, digest=blob_name(b"2"))
    pair = changes.decode_known_pair(
        trees.encode_dir([big, after, setuid]), trees.encode_dir([big, before, setuid]), ""
    )
    assert pair.alike == [
        {"name": "big", "type": "file", "mode": 0o600, "size": 2, "chunks": list(chunks)}
    ]
    assert (pair.now, pair.then) == ((after, setuid), (before, setuid))
