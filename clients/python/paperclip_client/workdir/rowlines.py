"""The stat cache's rows as sorted lines (the index's version 3): one row a line,
`<path as JSON>\\t<row as JSON>\\n`, in the byte order of the encoded paths (ASCII: JSON's own
escapes). A row is found by a binary search over the bytes, without parsing the others, and
a new index is the old one's bytes with the changed lines put in: both cost what the change
costs, not what the workspace holds. The whole is still one JSON parse: JSON escapes every
tab and newline inside a string, so the lines made an object (`loads_all`) hold no others.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

type Stat = list[Any]  # [size, mtime_ns, mode, ino, digest or [chunks], ctime_ns]

_COMPACT = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def encode_key(path: str) -> bytes:
    return _COMPACT(path).encode("ascii")


def encode_row(row: Stat) -> bytes:
    return _COMPACT(row).encode("ascii")


def encode_all(rows: Mapping[str, Stat]) -> bytes:
    """Every row, a line each, sorted. The paths and the rows are each encoded by one call
    and cut apart (a per-row call costs about four times as much over 50,000 rows). Between
    two rows, `],[` is always a boundary (a row holds one list, followed by a number), and
    any other `],[` (inside a string) adds a part: a cut that does not give one part per row
    means rows unlike the scan's. Between two encoded paths `","` is a boundary too, but
    `","` also matches an escaped quote, a comma and the closing quote of a path that ends
    so (`\\",` then `"`): the part before such a match ends with a backslash. Either way,
    each row is then encoded alone."""
    if not rows:
        return b""
    keys = _cut(_COMPACT(list(rows)).encode("ascii"), b'","')
    values = _cut(_COMPACT(list(rows.values())).encode("ascii"), b"],[")
    if len(keys) == len(rows) == len(values) and not any(k.endswith(b"\\") for k in keys):
        pairs = [(b'"%s"' % k, b"[%s]" % v) for k, v in zip(keys, values, strict=True)]
    else:
        pairs = [(encode_key(k), encode_row(v)) for k, v in rows.items()]
    pairs.sort()
    return b"".join([b"%s\t%s\n" % pair for pair in pairs])


def _cut(data: bytes, between: bytes) -> list[bytes]:
    """`[a,b,c]` (strings or lists, their brackets or quotes kept off) cut at `between`."""
    return data[2:-2].split(between)


def loads_all(body: bytes) -> object:
    """The lines parsed as one JSON object (None when they are not lines of rows)."""
    if not body:
        return {}
    if not body.endswith(b"\n"):
        return None
    try:
        return json.loads(b"{%s}" % body[:-1].replace(b"\t", b":").replace(b"\n", b","))
    except (ValueError, RecursionError):
        return None


def find(body: bytes, start: int, key: bytes) -> tuple[int, int]:
    """Where the line of `key` is in the sorted lines `body[start:]`: (its start, the end of
    its line) when it is there, else (where it would go, -1)."""
    lo, hi = start, len(body)
    while lo < hi:
        mid = (lo + hi) // 2
        line = body.rfind(b"\n", lo, mid) + 1 or lo
        end = body.find(b"\n", line, hi)
        if end < 0:  # not lines: a last line without its newline
            return hi, -1
        tab = body.find(b"\t", line, end)
        found = body[line:tab] if tab >= 0 else body[line:end]
        if found == key:
            return line, end + 1
        if found < key:
            lo = end + 1
        else:
            hi = line
    return lo, -1


def row_at(body: bytes, line: int, end: int) -> Stat | None:
    """The row of the line `body[line:end]`, or None when it is not one."""
    tab = body.find(b"\t", line, end)
    try:
        row: object = json.loads(body[tab + 1 : end])
    except (ValueError, RecursionError):
        return None
    if tab < 0 or not isinstance(row, list) or not is_row(row):
        return None
    return row


def is_row(row: object) -> bool:
    return (
        isinstance(row, list)
        and len(row) in (5, 6)
        and type(row[0]) is int
        and type(row[1]) is int
        and row[0] >= 0
    )


def splice(
    body: bytes, start: int, changes: Sequence[tuple[bytes, Stat | None]]
) -> tuple[bytes, list[Stat | None]]:
    """The lines `body[start:]` with `changes` (encoded paths, sorted, each once; None
    removes) put in, and the row each change replaced (None where there was none)."""
    pieces: list[bytes] = []
    old: list[Stat | None] = []
    at = start
    for key, row in changes:
        line, end = find(body, at, key)
        pieces.append(body[at:line])
        if end >= 0:
            old.append(row_at(body, line, end))
            at = end
        else:
            old.append(None)
            at = line
        if row is not None:
            pieces.append(b"%s\t%s\n" % (key, encode_row(row)))
    pieces.append(body[at:])
    return b"".join(pieces), old
