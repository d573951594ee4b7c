"""A directory blob changed in a few entries, built from the old blob's bytes: the entries that
did not change are kept as they are encoded, only the changed ones are encoded (each alone, as
`canonical_json` encodes it inside the list) and put in their place, so that a partial scan's
cost follows the change, not the size of the directories above it.

Why cutting the bytes is exact, for a blob in the canonical form (`trees.canonical_json` of
`{"entries": [...], "schema": ...}`, which every blob of the last tree is: the client wrote
it, or the server, which refuses any other form): a JSON string holds `"` only as `\\"`, so

- `"name":` followed by the name encoded (`json.dumps(name, ensure_ascii=False)`) and `,`
  is the name field of exactly one entry: the `"` before `name` is followed by a letter, so it
  opens a string (a closing quote is followed by `,` `:` `}` or `]`), the one after `name`
  follows a letter, so it closes it, and a string followed by `:` is a key; the name's
  encoding is then the whole value. Every kind of entry has a key after `name` (`size`,
  `type` or `target`), hence the `,`.
- `},{"` followed by a letter is the separator between two entries: the `"` opens a string
  (a letter follows), so the `}`, `,` and `{` before it are outside any string; entries hold
  no nested object. (`},{"` followed by anything else may end a name or a target.)
- an entry's fields before its name (`chunks` or `digest`, `mode`) hold no `{"`, so the last
  `{"` before the name field opens the entry.

Each piece found so is checked all the same: it must parse to an entry of that name whose
canonical encoding is the piece. Anything else (a blob not framed as a directory, a piece
that does not check, positions out of order, too many changes for the blob's size) means the
blob is decoded whole and encoded again, as before this module: slower, never different.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from paperclip_client.trees import SCHEMA, canonical_json

type Raw = dict[str, Any]  # a directory entry as encoded (`Entry.as_json`)

HEAD: Final = b'{"entries":['
TAIL: Final = b'],"schema":"' + SCHEMA.encode() + b'"}'
BETWEEN: Final = b'},{"'
# Lookups (or changes) times blob bytes past which the blob is decoded whole instead: each
# entry looked up in the bytes searches them once.
MAX_SEARCHED: Final = 64 * 1024 * 1024


class NotSpliced(Exception):
    """The blob is not one the changes can be spliced into: it is decoded whole instead."""


def decode_entries(blob: bytes) -> dict[str, Raw]:
    """A directory blob's entries by name, decoded whole (ValueError, KeyError or TypeError
    when it is not a directory blob)."""
    entries = json.loads(blob)["entries"]
    return {str(e["name"]): e for e in entries}


def encode_entries(entries: dict[str, Raw]) -> bytes:
    """The canonical blob of a directory holding `entries` (sorted here by name: a str's order
    is its UTF-8 bytes', and names are UTF-8)."""
    own = sorted(entries.values(), key=_name)
    return canonical_json({"schema": SCHEMA, "entries": own})


def _name(entry: Raw) -> str:
    return str(entry["name"])


class Entries:
    """A directory's entries by name: those of its old blob, looked up one by one in its bytes,
    with the changes made since (`changes`, None for an entry gone). Decoded whole (`whole`)
    only when a lookup or the splice cannot be done on the bytes."""

    __slots__ = ("_decode", "_spans", "_starts", "blob", "changes", "whole")

    def __init__(self, blob: bytes, decode: Callable[[bytes], dict[str, Raw]]) -> None:
        self.blob = blob
        self._decode = decode  # the whole decoding (its errors are the caller's)
        self.changes: dict[str, Raw | None] = {}
        self.whole: dict[str, Raw] | None = None
        self._spans: dict[str, tuple[int, int, Raw] | None] = {}  # old entries found, by name
        self._starts: list[int] | None = None  # where each old entry starts, once wanted

    def get(self, name: str) -> Raw | None:
        if self.whole is not None:
            return self.whole.get(name)
        if name in self.changes:
            return self.changes[name]
        try:
            found = self._find(name)
        except NotSpliced:
            return self._all().get(name)
        return found[2] if found is not None else None

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name: str) -> Raw:
        entry = self.get(name)
        if entry is None:
            raise KeyError(name)
        return entry

    def __setitem__(self, name: str, entry: Raw) -> None:
        if self.whole is not None:
            self.whole[name] = entry
        else:
            self.changes[name] = entry

    def pop(self, name: str, default: None = None) -> Raw | None:
        entry = self.get(name)
        if self.whole is not None:
            self.whole.pop(name, None)
        else:
            self.changes[name] = None
        return entry

    def names(self) -> list[str]:
        """The names changed (or, decoded whole, every name)."""
        return list(self.whole if self.whole is not None else self.changes)

    def encode(self) -> bytes:
        """The directory's canonical blob: the old blob's bytes with the changes spliced in,
        else the entries decoded whole and encoded again."""
        if self.whole is None:
            try:
                return self._splice()
            except NotSpliced:
                pass
        return encode_entries(self._all())

    def _all(self) -> dict[str, Raw]:
        if self.whole is None:
            whole = self._decode(self.blob)
            for name, entry in self.changes.items():
                if entry is None:
                    whole.pop(name, None)
                else:
                    whole[name] = entry
            self.whole, self.changes = whole, {}
        return self.whole

    def _find(self, name: str) -> tuple[int, int, Raw] | None:
        """The old entry `name`: where its bytes start and end in the blob, and it decoded
        (NotSpliced past as many lookups as `MAX_SEARCHED` allows: one decoding is then
        cheaper than the searches)."""
        if name not in self._spans:
            if (len(self._spans) + 1) * len(self.blob) > MAX_SEARCHED:
                raise NotSpliced
            self._spans[name] = _locate(self.blob, name)
        return self._spans[name]

    def _splice(self) -> bytes:
        blob = self.blob
        if not (blob.startswith(HEAD) and blob.endswith(TAIL)):
            raise NotSpliced
        if len(self.changes) * len(blob) > MAX_SEARCHED:
            raise NotSpliced
        stop = len(blob) - len(TAIL)
        parts: list[bytes] = []
        pos = len(HEAD)  # where the old entries not yet copied start (or `stop`)
        for key, name in _ordered(self.changes):
            entry = self.changes[name]
            found = self._find(name)
            if found is not None:
                at, end = found[0], found[1]
            elif entry is None:
                continue  # gone, and not in the old blob either
            else:
                at = end = self._insert_at(key, stop)
            if at < pos:
                raise NotSpliced  # out of order: not the canonical form
            if at > pos:  # the old entries in between, without the `,` before `at`
                parts.append(blob[pos : at - 1 if at < stop else stop])
            if entry is not None:
                parts.append(canonical_json(entry))
            # Past the old entry and the `,` after it; a new entry goes before the one at `at`.
            pos = (end + 1 if end < stop else stop) if found is not None else at
        if pos < stop:
            parts.append(blob[pos:stop])
        return HEAD + b",".join(parts) + TAIL

    def _insert_at(self, key: bytes, stop: int) -> int:
        """Where an entry named `key` (UTF-8), not in the old blob, goes: the start of the first
        old entry after it (by a search over the entries, each probe decoded alone), or
        `stop`."""
        starts = self._starts
        if starts is None:
            starts = self._starts = _starts(self.blob, stop)
        low, high = 0, len(starts)
        while low < high:
            middle = (low + high) // 2
            end = starts[middle + 1] - 1 if middle + 1 < len(starts) else stop
            probe = str(_checked(self.blob[starts[middle] : end], None)["name"]).encode("utf-8")
            if probe == key:
                raise NotSpliced  # there after all: `_locate` should have found it
            if probe < key:
                low = middle + 1
            else:
                high = middle
        return starts[low] if low < len(starts) else stop


def _ordered(changes: dict[str, Raw | None]) -> list[tuple[bytes, str]]:
    """The changed names in the canonical order, with their UTF-8 bytes; a removed name that
    is not UTF-8 (in no blob) is left out."""
    ordered: list[tuple[bytes, str]] = []
    for name, entry in changes.items():
        try:
            ordered.append((name.encode("utf-8"), name))
        except UnicodeEncodeError:
            if entry is not None:
                raise NotSpliced from None
    ordered.sort()
    return ordered


def _locate(blob: bytes, name: str) -> tuple[int, int, Raw] | None:
    """The entry `name` of a canonical blob: its start and end, and it decoded; None when the
    blob has no such entry. NotSpliced when what is found does not check."""
    if not (blob.startswith(HEAD) and blob.endswith(TAIL)):
        raise NotSpliced
    stop = len(blob) - len(TAIL)
    try:
        field = b'"name":' + json.dumps(name, ensure_ascii=False).encode("utf-8") + b","
    except UnicodeEncodeError:
        return None  # not UTF-8 (a name on disk the tree cannot hold): in no blob
    at = blob.find(field, len(HEAD), stop)
    if at < 0:
        return None
    start = blob.rfind(b'{"', len(HEAD), at + 1)
    if start < 0 or (start > len(HEAD) and blob[start - 2 : start] != b"},"):
        raise NotSpliced
    end = _entry_end(blob, at, stop)
    return start, end, _checked(blob[start:end], name)


def _entry_end(blob: bytes, at: int, stop: int) -> int:
    """The end of the entry holding `at`: after its `}`, before the next entry's `,{"`."""
    cut = blob.find(BETWEEN, at, stop)
    while cut >= 0 and not blob[cut + 4 : cut + 5].isalpha():
        cut = blob.find(BETWEEN, cut + 1, stop)
    return stop if cut < 0 else cut + 1


def _starts(blob: bytes, stop: int) -> list[int]:
    """Where each entry of a canonical blob starts (none for an empty directory)."""
    if stop == len(HEAD):
        return []
    starts = [len(HEAD)]
    cut = blob.find(BETWEEN, len(HEAD), stop)
    while cut >= 0:
        if blob[cut + 4 : cut + 5].isalpha():
            starts.append(cut + 2)
        cut = blob.find(BETWEEN, cut + 1, stop)
    return starts


def _checked(piece: bytes, name: str | None) -> Raw:
    """The entry `piece` decoded, which must be its canonical encoding (and, given, have
    the name `name`); NotSpliced otherwise."""
    try:
        entry = json.loads(piece)
    except (ValueError, RecursionError) as exc:
        raise NotSpliced from exc
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise NotSpliced
    if (name is not None and entry["name"] != name) or canonical_json(entry) != piece:
        raise NotSpliced
    return entry
