"""`trees.decode_dir`'s fast path (`_plain_dir`, one regular expression over the whole blob)
decides exactly as the full decode: for any bytes, the same entries when it accepts, the same
reason when it refuses. It only ever says yes; everything it does not match goes to the full
decode, so the danger is a yes where the full decode says no. The full decode is the oracle
here (`_decode_full`: what `decode_dir` was before the fast path)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paperclip.snapshots import trees
from paperclip.snapshots.trees import Entry, TreeInvalid, blob_name

DIGEST = blob_name(b"x")
D = DIGEST.encode()

NAMES = st.one_of(
    st.sampled_from(["a", "b", "é", ".", "..", "a},{", "\x7f", "x" * 255, "é" * 127, "日本"]),
    st.text(
        alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=5,
    ).filter(lambda n: n not in (".", "..")),
)


def _oracle(data: bytes) -> tuple[Entry, ...] | str:
    """The full decode's answer: the entries, or the reason it refuses."""
    try:
        return trees._decode_full(data, "p")
    except TreeInvalid as exc:
        return exc.reason


def _ours(data: bytes) -> tuple[Entry, ...] | str:
    try:
        return trees.decode_dir(data, "p")
    except TreeInvalid as exc:
        return exc.reason


@st.composite
def valid_entries(draw: st.DrawFn) -> list[Entry]:
    found: dict[str, Entry] = {}
    for name in draw(st.lists(NAMES.filter(lambda n: n not in (".", "..")), max_size=6)):
        kind = draw(st.sampled_from(["file", "dir", "symlink", "chunked"]))
        mode = draw(st.sampled_from([0, 7, 0o644, 0o755, 999, 1000, 4095]))
        if kind == "file":
            size = draw(st.sampled_from([0, 1, 10**15 - 1, 10**15, 2**53]))
            found[name] = Entry(name=name, type="file", mode=mode, size=size, digest=DIGEST)
        elif kind == "chunked":
            found[name] = Entry(name=name, type="file", mode=mode, size=2, chunks=(DIGEST, DIGEST))
        elif kind == "dir":
            found[name] = Entry(name=name, type="dir", mode=mode, digest=DIGEST)
        else:
            target = draw(st.sampled_from(["a", "../b", "c},{", "d e", "\x7f", 'q"', "t\tab"]))
            found[name] = Entry(name=name, type="symlink", target=target)
    return list(found.values())


# Bytes that put a blob just outside what the full decode accepts, each replacing a valid part
# (a name that sorts after "b" replaces the last entry's, so that the order alone does not
# refuse it).
SWAPS = [
    (b'"mode":420', b'"mode":4096'),
    (b'"mode":420', b'"mode":0420'),
    (b'"mode":420', b'"mode":-1'),
    (b'"mode":420', b'"mode":true'),
    (b'"mode":420', b'"mode":420.0'),
    (b'"size":1', b'"size":01'),
    (b'"size":1', b'"size":9007199254740993'),
    (b'"size":1', b'"size":-1'),
    (b'"name":"a"', b'"name":"."'),
    (b'"name":"a"', b'"name":".."'),
    (b'"name":"a"', b'"name":""'),
    (b'"name":"c"', b'"name":"' + b"x" * 256 + b'"'),
    (b'"name":"a"', b'"name":"a/b"'),
    (b'"name":"c"', b'"name":"\xff"'),
    (b'"name":"c"', b'"name":"\xed\xa0\x80"'),  # a surrogate, encoded
    (b'"name":"c"', b'"name":"\xc3"'),  # a truncated sequence
    (b'"name":"a"', b'"name":"b"'),  # out of order, or a duplicate
    (b'"name":"a"', b'"name":"a\\u0000"'),
    (b'"name":"a"', b'"name":"\\u0061"'),  # not canonical
    (b'"name":"a"', b'"name": "a"'),
    (b'"target":"t"', b'"target":"/t"'),
    (b'"target":"t"', b'"target":""'),
    (b'"target":"t"', b'"target":"t\\u0000"'),
    (b'"type":"dir"', b'"type":"file"'),
    (b'"type":"file"', b'"type":"dir"'),
    (b"sha256:", b"SHA256:"),
    (D[-4:], b"AAAA"),
    (D[-4:], D[-3:]),
    (b',"schema"', b' ,"schema"'),
    (b'"entries":[', b'"entries":[ '),
    (b'"paperclip.dir.v1"', b'"paperclip.dir.v2"'),
    (b'},{"', b'},{"name":"z","target":"t","type":"symlink"},{"'),
    (b'},{"', b'}, {"'),
    (b"}]", b"},]"),
]


@st.composite
def blobs(draw: st.DrawFn) -> bytes:
    base = [
        Entry(name="a", type="file", mode=0o644, size=1, digest=DIGEST),
        Entry(name="b", type="symlink", target="t"),
        Entry(name="c", type="dir", mode=0o755, digest=DIGEST),
    ]
    data = trees.encode_dir(draw(st.sampled_from([base, []])) + draw(valid_entries()))
    for _ in range(draw(st.integers(0, 2))):
        old, new = draw(st.sampled_from(SWAPS))
        data = data.replace(old, new, 1)
    if draw(st.booleans()):
        at = draw(st.integers(0, len(data)))
        data = (
            data[:at] + draw(st.sampled_from([b'"', b",", b"}", b"{", b"\\", b"\x00"])) + data[at:]
        )
    return data


@settings(max_examples=600)
@given(data=blobs())
def test_the_fast_path_decides_as_the_full_decode(data: bytes) -> None:
    assert _ours(data) == _oracle(data)


@pytest.mark.parametrize(("old", "new"), SWAPS, ids=[new.decode("latin-1") for _, new in SWAPS])
def test_each_fault_near_the_usual_form_is_refused_as_the_full_decode_refuses(
    old: bytes, new: bytes
) -> None:
    base = trees.encode_dir(
        [
            Entry(name="a", type="file", mode=0o644, size=1, digest=DIGEST),
            Entry(name="b", type="symlink", target="t"),
            Entry(name="c", type="dir", mode=0o755, digest=DIGEST),
        ]
    )
    assert trees._plain_dir(base)
    data = base.replace(old, new, 1)
    assert data != base
    expected = _oracle(data)
    assert _ours(data) == expected
    if isinstance(expected, str):
        assert not trees._plain_dir(data)


def test_the_usual_form_takes_the_fast_path_up_to_its_bounds() -> None:
    """Files, directories and symlinks without escapes, at the edges of their ranges: decided
    by the one expression (the full decode is not called), as the full decode decides."""
    entries = [
        Entry(name="x" * 255, type="file", mode=4095, size=10**15 - 1, digest=DIGEST),
        Entry(name="é" * 127, type="dir", mode=0, digest=DIGEST),
        Entry(name="日本", type="symlink", target="a},{ b\x7f"),
        Entry(name="a},{", type="file", mode=0o644, size=0, digest=DIGEST),
    ]
    data = trees.encode_dir(entries)
    assert trees._plain_dir(data)
    assert trees.decode_dir(data) == _oracle(data)
    assert trees.valid_pieces(data) == trees.entry_pieces(data)
    assert len(trees.valid_pieces(data)) == len(entries)
    assert trees._plain_dir(trees.EMPTY_DIR)


def test_valid_pieces_refuse_with_the_full_decodes_reason() -> None:
    data = trees.encode_dir([Entry(name="a", type="file", mode=0o644, size=1, digest=DIGEST)])
    bad = data.replace(b'"mode":420', b'"mode":4096')
    with pytest.raises(TreeInvalid) as caught:
        trees.valid_pieces(bad, "here")
    assert (caught.value.path, caught.value.reason) == ("here/a", "bad_mode")
    # Valid in an unusual form (a chunked file): the full decode accepts, the pieces follow.
    chunked = trees.encode_dir(
        [Entry(name="a", type="file", mode=0o644, size=2, chunks=(DIGEST, DIGEST))]
    )
    assert not trees._plain_dir(chunked)
    assert len(trees.valid_pieces(chunked)) == 1
