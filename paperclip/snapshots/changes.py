"""A tree compared with one known valid, read only where the two differ
(docs/snapshots.md#registering-against-the-head): two directories at one path compared entry by
entry as bytes (`differing_entries`), and whole trees level by level (`walk_changes`), which
registration against the head and publishing's merge use."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import compress
from typing import Any, Final

from paperclip.snapshots.bounds import MAX_ENTRIES, MAX_PATH_BYTES
from paperclip.snapshots.trees import (
    BLOB_NAME,
    MAX_DEPTH,
    Budget,
    Entry,
    TreeInvalid,
    blob_name,
    canonical_json,
    checked_entry,
    claim_size,
    decode_dir,
    decode_known_dir,
    entry_pieces,
    join_path,
    known_entries,
    known_objects,
    plain_files,
    stored_dir,
)


@dataclass(frozen=True, slots=True)
class KnownPair:
    """Two directory blobs at one path of trees known valid, as materialization reads them:
    `now` and `then`, each side's entries but the regular files both hold byte for byte
    (their mode without setuid, setgid or sticky bits), which are in `alike` instead as the
    blob's own JSON objects (name, type, mode, size, digest or chunks), in name order."""

    now: tuple[Entry, ...]
    then: tuple[Entry, ...]
    alike: list[dict[str, Any]]


def decode_known_pair(now: bytes, then: bytes, path: str) -> KnownPair:
    """Two directory blobs at `path` of trees known valid, decoded as `decode_known_dir`
    decodes each, with the entries they hold byte for byte decoded once and shared, and the
    regular files among those not built as entries at all (`KnownPair.alike`): most of a
    directory that changed is what it was, and a materialization compares such a file with
    the disk by `lstat` alone. TreeInvalid as `decode_known_dir`."""
    ours, theirs = entry_pieces(now), entry_pieces(then)
    if ours is None or theirs is None:
        return KnownPair(decode_known_dir(now, path), decode_known_dir(then, path), [])
    held = set(theirs)
    shared = [piece for piece in ours if piece in held]
    raws = known_objects(shared, path)
    plain = plain_files(raws)
    alike: list[dict[str, Any]] = list(compress(raws, plain))
    apart = set(compress(shared, plain))
    ours = [piece for piece in ours if piece not in apart]
    theirs = [piece for piece in theirs if piece not in apart]
    pieces = list(dict.fromkeys(ours + theirs))
    decoded = dict(zip(pieces, known_entries(pieces, path), strict=True))
    return KnownPair(tuple(decoded[p] for p in ours), tuple(decoded[p] for p in theirs), alike)


def differing_entries(
    data: bytes, known: bytes, path: str
) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """The entries that differ between the directory blob `data` and `known`, a directory
    blob of a tree known valid, each side's by name: an entry both hold byte for byte is in
    neither and is not decoded. `data` is validated as `decode_dir` validates it, at the cost
    of what differs: its pieces that `known` holds are valid entries already (the same bytes),
    the others are decoded and checked one by one, each must be its own canonical encoding,
    and the names must increase (for two pieces that `known` holds, their order in `known`
    proves it). Raises TreeInvalid with `decode_dir`'s reason when `data` is not a valid
    directory, and when `known` does not split as one."""
    theirs = entry_pieces(known)
    if theirs is None:
        raise TreeInvalid(path, "not_canonical")
    mine = entry_pieces(data)
    own = None if mine is None else _checked_pieces(mine, theirs, path)
    if mine is None or own is None:
        decode_dir(data, path)  # names the reason (a valid directory always passes above)
        raise TreeInvalid(path, "not_canonical")
    shared = set(mine).intersection(theirs)
    old = known_entries([piece for piece in theirs if piece not in shared], path)
    return own, {entry.name: entry for entry in old}


def _checked_pieces(pieces: list[bytes], known: list[bytes], path: str) -> dict[str, Entry] | None:
    """The entries of `pieces` that `known` (the pieces of a valid directory) has not, by
    name, each validated; None when the pieces are not those of a valid directory."""
    order = {piece: index for index, piece in enumerate(known)}
    found: dict[str, Entry] = {}
    # The previous piece: its index in `known` (None: checked here), the piece, its name's
    # bytes when known
    previous: tuple[int | None, bytes, bytes | None] | None = None
    for piece in pieces:
        index = order.get(piece)
        key = None
        if index is None:
            text = b'{"' + piece + b"}"
            try:
                raw = json.loads(text)
                entry = checked_entry(raw, path)
                if canonical_json(raw) != text:
                    return None
            except (ValueError, TypeError, RecursionError, TreeInvalid):
                return None
            found[entry.name] = entry
            key = entry.name.encode("utf-8")
        if previous is not None:
            before, earlier, earlier_key = previous
            if index is not None and before is not None:
                if before >= index:
                    return None  # `known` is strictly sorted, so these two are when in order
            elif (earlier_key or _piece_key(earlier, path)) >= (key or _piece_key(piece, path)):
                return None
        previous = (index, piece, key)
    return found


_NAME_FIRST: Final = b'name":"'
_NAME_AFTER: Final = b',"name":"'


def _piece_key(piece: bytes, path: str) -> bytes:
    """The UTF-8 bytes of the name of a piece that is a valid entry (checked or known)."""
    if piece.startswith(_NAME_FIRST):
        start = len(_NAME_FIRST)
    else:
        found = piece.find(_NAME_AFTER)
        start = found + len(_NAME_AFTER) if found >= 0 else -1
    raw = piece[start : piece.find(b'"', start)] if start >= 0 else b"\\"
    if b"\\" in raw:
        # An escaped character (a quote, a backslash, a control character) in the name, or
        # no name where one was expected: decode the piece.
        return known_entries([piece], path)[0].name.encode("utf-8")
    return raw  # canonical JSON writes a name without escapes as its UTF-8 bytes


@dataclass(slots=True)
class Changes:
    """How `root` differs from `head`, read only where the two differ: `new` holds the blobs
    `root` reaches in the parts that differ and `head` does not reach there (directory blobs,
    file contents and chunks); `files`, `bytes` and `entries` are what `root` has more than
    `head` (negative: fewer); `read` counts the directory blobs read, both sides. When the
    two directories at a path were compared piece by piece, an entry both hold alike is not
    read: a blob only it reaches there may then be in `new` though `head` has it (pinned once
    more, which is harmless)."""

    root: str
    head: str
    new: set[str] = field(default_factory=set)
    # The sizes the files `root` has in the parts that differ give their blobs (as `Walk`'s).
    sizes: dict[str, int] = field(default_factory=dict)
    chunked: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    files: int = 0
    bytes: int = 0
    entries: int = 0
    read: int = 0


def walk_changes(
    root: str,
    head: str,
    *,
    load_many: Callable[[list[str]], Mapping[str, bytes]],
    head_known_valid: bool = False,
    max_entries: int = MAX_ENTRIES,
    max_path_bytes: int = MAX_PATH_BYTES,
) -> Changes | None:
    """Compare the tree `root` with `head`, a tree known to be valid and whole, path by path,
    a level per `load_many` call: a subdirectory with the same blob at the same path in both
    is not entered (it is the same subtree at the same depth, already valid), so a change of
    a few files reads a few directories on each side whatever the tree's size. The
    directories read on `root`'s side are validated as `walk` validates them. With
    `head_known_valid` (the caller knows `head` valid and whole: `counts.known_valid_trees`),
    the two directories at one path are compared piece by piece (`differing_entries`) and only
    the entries that differ are decoded; else both are decoded whole.

    None when this cannot vouch for `root`: a directory either side lacks or one that is
    invalid, a cycle, the depth limit, or a symlink added, removed or changed (whether a
    symlink stays inside the tree depends on every other symlink, and only when the two
    trees' symlinks are the same is `head`'s check `root`'s), or more than `max_entries`
    entries compared or their paths adding up to more than `max_path_bytes` (directories
    shared by many paths: `walk`'s two bounds, here over both sides). The caller then walks
    the whole tree, which finds the exact reason or a tree that is fine after all."""
    if not (BLOB_NAME.fullmatch(root) and BLOB_NAME.fullmatch(head)):
        return None
    changes = Changes(root=root, head=head)
    if root == head:
        return changes
    ours, theirs = {root}, {head}
    links: tuple[dict[str, str], dict[str, str]] = ({}, {})
    # (path, our directory blob, theirs at the same path, our chain of directory blobs)
    level: list[tuple[str, str | None, str | None, tuple[str, ...]]] = [("", root, head, ())]
    depth = 0
    budget = Budget(max_entries, max_path_bytes)
    while level:
        if depth > MAX_DEPTH:
            return None
        names = sorted({d for _, mine, other, _ in level for d in (mine, other) if d})
        stored = load_many(names)
        changes.read += len(names)
        following: list[tuple[str, str | None, str | None, tuple[str, ...]]] = []
        for path, mine, other, chain in level:
            try:
                if head_known_valid and mine is not None and other is not None:
                    own, old = _stored_pair(stored, mine, other, path)
                else:
                    own = stored_dir(stored, mine, path)
                    old = stored_dir(stored, other, path)
            except TreeInvalid:
                return None
            if (
                own is None
                or old is None
                or (mine is not None and mine in chain)
                or not budget.spend(len(own) + len(old), _path_bytes(path, own, old))
            ):
                return None
            chain = (*chain, mine) if mine is not None else chain
            for sign, entries, against, reached, found in (
                (1, own, old, ours, links[0]),
                (-1, old, own, theirs, links[1]),
            ):
                side = _Side(sign, reached, found)
                if not _compare_level(changes, side, path, chain, entries, against, following):
                    return None  # the whole walk names the file
        level = following
        depth += 1
    if links[0] != links[1]:
        return None
    changes.new = ours - theirs
    return changes


def _path_bytes(path: str, *sides: Mapping[str, Entry]) -> int:
    """The length of the paths of the entries of `sides` in the directory at `path` added
    up, as `walk` counts each (`join_path`), without building them."""
    count = sum(len(side) for side in sides)
    return count * (len(path) + 1 if path else 0) + sum(len(n) for side in sides for n in side)


@dataclass(frozen=True, slots=True)
class _Side:
    """One side of `walk_changes`: +1 for `root`'s entries, -1 for `head`'s; the blobs it
    reaches in the parts that differ; its symlinks there (path -> target)."""

    sign: int
    reached: set[str]
    links: dict[str, str]


def _compare_level(
    changes: Changes,
    side: _Side,
    path: str,
    chain: tuple[str, ...],
    entries: dict[str, Entry],
    against: dict[str, Entry],
    following: list[tuple[str, str | None, str | None, tuple[str, ...]]],
) -> bool:
    """Count one side's entries of the directory at `path` that differ from the other side's
    (`against`) into `changes`, and queue the subdirectories to compare next. False when a
    file's blob is named with two sizes (the caller cannot vouch for the tree)."""
    sign = side.sign
    for entry in entries.values():
        twin = against.get(entry.name)
        if _same_dir(entry, twin):
            continue  # the same subtree at the same path: not entered
        where = join_path(path, entry.name)
        changes.entries += sign
        if entry.type == "dir":
            assert entry.digest is not None  # noqa: S101 - decode_dir checked it
            side.reached.add(entry.digest)
            beside = twin.digest if twin is not None and twin.type == "dir" else None
            if sign > 0:
                following.append((where, entry.digest, beside, chain))
            elif beside is None:  # a directory we no longer have: count it out
                following.append((where, None, entry.digest, chain))
        elif entry.type == "file":
            changes.files += sign
            changes.bytes += sign * entry.size
            side.reached.update(entry.blobs())
            if sign > 0 and not claim_size(changes.sizes, changes.chunked, where, entry):
                return False
        else:
            side.links[where] = entry.target
    return True


def _same_dir(entry: Entry, twin: Entry | None) -> bool:
    return (
        entry.type == "dir"
        and twin is not None
        and twin.type == "dir"
        and twin.digest == entry.digest
    )


def _stored_pair(
    stored: Mapping[str, bytes], mine: str, known: str, path: str
) -> tuple[dict[str, Entry] | None, dict[str, Entry] | None]:
    """`differing_entries` of the directory blobs `mine` and `known` (valid) as `stored`
    holds them (None for one that is not stored). Raises TreeInvalid as `decode_stored_dir`."""
    data, theirs = stored.get(mine), stored.get(known)
    if data is None or theirs is None:
        return (None if data is None else {}), (None if theirs is None else {})
    if blob_name(data) != mine or blob_name(theirs) != known:
        raise TreeInvalid(path, "digest_mismatch")
    return differing_entries(data, theirs, path)
