"""The index's rows as sorted lines (`workdir.rowlines`): whatever the paths (quotes,
backslashes, the very separators the encoding cuts at, tabs, newlines, non-ASCII), the lines
parse back to the rows, every row is found by the search and no other path is, and a change
put into the lines gives the same bytes as the changed rows encoded afresh.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from paperclip_client.workdir.rowlines import (
    encode_all,
    encode_key,
    find,
    loads_all,
    row_at,
    splice,
)

SEPARATORS = ['","', "],[", '"', "\\", "\t", "\n", ":", "[", "]", ",", "é", "\u2028", "😀"]
paths = st.lists(st.sampled_from([*SEPARATORS, "a", "b", "/"]), min_size=1, max_size=6).map("".join)
digests = st.text(alphabet="0123456789abcdef", min_size=1, max_size=4).map(lambda h: f"sha256:{h}")
contents = st.one_of(digests, st.lists(digests, min_size=1, max_size=3))
rows = st.tuples(
    st.integers(0, 2**40),
    st.integers(0, 2**62),
    st.integers(0, 0o777),
    st.integers(0, 2**40),
    contents,
    st.integers(0, 2**62),
).map(list)
tables = st.dictionaries(paths, rows, max_size=12)


@settings(max_examples=300, deadline=None)
@given(tables)
def test_the_lines_parse_back_and_every_row_is_found(table: dict[str, list[object]]) -> None:
    body = encode_all(table)
    assert loads_all(body) == table
    lines = body.splitlines()
    assert lines == sorted(lines)
    assert len(lines) == len(table)
    for path, row in table.items():
        line, end = find(body, 0, encode_key(path))
        assert end >= 0
        assert row_at(body, line, end) == row


@settings(max_examples=300, deadline=None)
@given(tables, paths)
def test_a_path_not_held_is_not_found_and_its_place_keeps_the_order(
    table: dict[str, list[object]], path: str
) -> None:
    table.pop(path, None)
    body = encode_all(table)
    line, end = find(body, 0, encode_key(path))
    assert end == -1
    key = encode_key(path)
    assert all(k < key for k in (x.split(b"\t")[0] for x in body[:line].splitlines()))
    assert all(k > key for k in (x.split(b"\t")[0] for x in body[line:].splitlines()))


@settings(max_examples=300, deadline=None)
@given(tables, st.dictionaries(paths, st.one_of(st.none(), rows), max_size=8))
def test_a_change_put_into_the_lines_is_the_changed_rows_encoded_afresh(
    table: dict[str, list[object]], changes: dict[str, list[object] | None]
) -> None:
    body = encode_all(table)
    ordered = sorted((encode_key(p), row) for p, row in changes.items())
    spliced, replaced = splice(body, 0, ordered)
    changed = {**table}
    for path, row in changes.items():
        if row is None:
            changed.pop(path, None)
        else:
            changed[path] = row
    assert spliced == encode_all(changed)
    assert replaced == [table.get(p) for p in sorted(changes, key=encode_key)]


def test_rows_unlike_the_scans_are_encoded_one_by_one() -> None:
    """A row holding the cut's separator inside a string (never one of the scan's) is still
    encoded right: the cut does not give one part per row, and each row is encoded alone."""
    table = {"a": [1, 2, 420, 3, ["x],[y"], 4], "b": [1, 2, 420, 3, "z", 4]}
    assert loads_all(encode_all(table)) == table
