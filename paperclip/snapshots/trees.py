"""Workspace trees as Merkle directories (docs/snapshots.md#trees), as plain functions.

A directory is a blob of canonical JSON `{"entries": [...], "schema": "paperclip.dir.v1"}`
(keys sorted, separators `,` `:`, UTF-8, no whitespace), its entries sorted by the UTF-8 bytes
of their names. A tree is the name of its root directory blob. Nothing here touches the
database or a filesystem: `walk` reads blobs through the `load` function it is given.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

SCHEMA: Final = "paperclip.dir.v1"
MAX_DEPTH: Final = 256
MAX_NAME_BYTES: Final = 255
MAX_MODE: Final = 0o7777
MAX_SYMLINK_HOPS: Final = 40
BLOB_NAME = re.compile(r"sha256:[0-9a-f]{64}")
EMPTY_DIR: Final = b'{"entries":[],"schema":"paperclip.dir.v1"}'

type EntryType = Literal["file", "dir", "symlink"]


class TreeInvalid(ValueError):
    """A tree or one of its directories breaks a rule: `path` names where (`""` is the root),
    `reason` is a stable snake_case word."""

    def __init__(self, path: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{path or '/'}: {reason}" + (f" ({detail})" if detail else ""))
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    type: EntryType
    mode: int = 0
    size: int = 0
    digest: str | None = None  # a file's content, or a dir's blob
    chunks: tuple[str, ...] | None = None  # a large file's content, in order
    target: str = ""  # a symlink's

    def as_json(self) -> dict[str, Any]:
        if self.type == "symlink":
            return {"name": self.name, "type": "symlink", "target": self.target}
        if self.type == "dir":
            return {"name": self.name, "type": "dir", "mode": self.mode, "digest": self.digest}
        content: dict[str, Any] = (
            {"chunks": list(self.chunks)} if self.chunks is not None else {"digest": self.digest}
        )
        return {"name": self.name, "type": "file", "mode": self.mode, "size": self.size, **content}

    def same_dir(self, other: Entry) -> bool:
        """Both directories with the same content and mode."""
        return (
            self.type == other.type == "dir"
            and self.digest is not None
            and self.digest == other.digest
            and self.mode == other.mode
        )

    def blobs(self) -> tuple[str, ...]:
        """The content blobs this entry names itself (a dir's own blob included)."""
        if self.chunks is not None:
            return self.chunks
        return (self.digest,) if self.digest is not None else ()

    def same_as(self, other: Entry | None) -> bool:
        """Equal for a merge: type, mode and content (a directory by type and mode alone; what
        is inside it is compared path by path)."""
        if other is None or other.type != self.type:
            return False
        if self.type == "dir":
            return self.mode == other.mode
        if self.type == "symlink":
            return self.target == other.target
        # What `as_json` shows of a file but its name, compared without building it: mode,
        # size, and its chunks or else its digest.
        if self.chunks is not None or other.chunks is not None:
            same_content = self.chunks == other.chunks
        else:
            same_content = self.digest == other.digest
        return self.mode == other.mode and self.size == other.size and same_content


def blob_name(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _name_key(entry: Entry) -> bytes:
    return entry.name.encode("utf-8", "surrogatepass")


def encode_dir(entries: Iterable[Entry]) -> bytes:
    """The canonical bytes of a directory holding `entries` (sorted here)."""
    ordered = sorted(entries, key=_name_key)
    return canonical_json({"schema": SCHEMA, "entries": [e.as_json() for e in ordered]})


def name_problem(name: object) -> str | None:
    """Why `name` cannot name an entry, or None."""
    if not isinstance(name, str):
        return "bad_name"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "bad_name"
    if not 1 <= size <= MAX_NAME_BYTES or name in (".", "..") or "/" in name or "\0" in name:
        return "bad_name"
    return None


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


def _int(value: object, low: int, high: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return None
    return value


_KEYS: Final[Mapping[str, tuple[frozenset[str], ...]]] = {
    "file": (
        frozenset({"name", "type", "mode", "size", "digest"}),
        frozenset({"name", "type", "mode", "size", "chunks"}),
    ),
    "dir": (frozenset({"name", "type", "mode", "digest"}),),
    "symlink": (frozenset({"name", "type", "target"}),),
}


def _entry(raw: object, path: str) -> Entry:
    if not isinstance(raw, dict):
        raise TreeInvalid(path, "bad_entry")
    problem = name_problem(raw.get("name"))
    if problem:
        raise TreeInvalid(path, problem)
    name: str = raw["name"]
    where = _join(path, name)
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in _KEYS:
        raise TreeInvalid(where, "bad_type")
    if frozenset(raw) not in _KEYS[kind]:
        raise TreeInvalid(where, "bad_fields", ", ".join(sorted(raw)))
    if kind == "symlink":
        return _symlink_entry(raw, name, where)
    mode = _int(raw["mode"], 0, MAX_MODE)
    if mode is None:
        raise TreeInvalid(where, "bad_mode")
    if kind == "dir":
        return Entry(name=name, type="dir", mode=mode, digest=_digest(raw["digest"], where))
    return _file_entry(raw, name, where, mode)


def _symlink_entry(raw: dict[str, Any], name: str, where: str) -> Entry:
    target = raw["target"]
    if not isinstance(target, str) or not target or "\0" in target:
        raise TreeInvalid(where, "bad_symlink")
    if target.startswith("/"):
        raise TreeInvalid(where, "absolute_symlink")
    return Entry(name=name, type="symlink", target=target)


def _file_entry(raw: dict[str, Any], name: str, where: str, mode: int) -> Entry:
    size = _int(raw["size"], 0, 2**53)
    if size is None:
        raise TreeInvalid(where, "bad_size")
    if "chunks" in raw:
        chunks = raw["chunks"]
        if (
            not isinstance(chunks, list)
            or len(chunks) < 2
            or not all(isinstance(c, str) and BLOB_NAME.fullmatch(c) for c in chunks)
        ):
            raise TreeInvalid(where, "bad_chunks")
        return Entry(name=name, type="file", mode=mode, size=size, chunks=tuple(chunks))
    return Entry(name=name, type="file", mode=mode, size=size, digest=_digest(raw["digest"], where))


def _digest(value: object, where: str) -> str:
    if not isinstance(value, str) or not BLOB_NAME.fullmatch(value):
        raise TreeInvalid(where, "bad_digest")
    return value


def decode_dir(data: bytes, path: str = "") -> tuple[Entry, ...]:
    """The entries of one directory blob, validated strictly: canonical bytes, the schema,
    known fields of the right types, good and unique names (TreeInvalid otherwise)."""
    entries = _decode_canonical(data, path)
    return entries if entries is not None else _decode_strict(data, path)


def decode_stored_dir(
    data: bytes, digest: str, path: str = "", *, known_valid: bool = False
) -> tuple[Entry, ...]:
    """The entries of the directory blob `digest`, read as `data`: TreeInvalid(path,
    "digest_mismatch") when those are not its bytes, else as `decode_dir` (`decode_known_dir`
    for a blob of a tree known valid)."""
    if blob_name(data) != digest:
        raise TreeInvalid(path, "digest_mismatch")
    return decode_known_dir(data, path) if known_valid else decode_dir(data, path)


_DIR_HEAD: Final = b'{"entries":['
_DIR_TAIL: Final = b'],"schema":"' + SCHEMA.encode() + b'"}'
_ENTRY_BETWEEN: Final = b'},{"'


def entry_pieces(data: bytes) -> list[bytes] | None:
    """The entries of a valid directory blob as raw pieces, in order, without decoding them:
    each is one entry's canonical JSON without its opening `{"` and closing `}`. Two entries
    are equal exactly when their pieces are, so two directories can be compared piece by piece
    and only the entries that differ decoded (`known_entries`). None when the blob is not framed
    as a directory. Splitting is exact for a valid (canonical) blob only: an entry holds no
    object, and a string holds `"` only as `\\"`, so `},{"` occurs only between entries; the
    caller must know the blob valid (`decode_dir` passed, now or when its tree was recorded)."""
    if not (data.startswith(_DIR_HEAD) and data.endswith(_DIR_TAIL)):
        return None
    body = data[len(_DIR_HEAD) : len(data) - len(_DIR_TAIL)]
    if not body:
        return []
    if not (body.startswith(b'{"') and body.endswith(b"}")):
        return None
    return body[2:-1].split(_ENTRY_BETWEEN)


def known_entries(pieces: list[bytes], path: str) -> list[Entry]:
    """The entries of `pieces` of one directory (at `path`) of a tree known valid, decoded in
    one parse and built without `decode_dir`'s checks (they passed when the tree was
    recorded) but their shape. TreeInvalid when they do not parse as entries of that shape."""
    if not pieces:
        return []
    try:
        raws = json.loads(b'[{"' + _ENTRY_BETWEEN.join(pieces) + b"}]")
        if not isinstance(raws, list) or len(raws) != len(pieces):
            raise ValueError("not one entry per piece")
    except ValueError as exc:  # UnicodeDecodeError too
        raise TreeInvalid(path, "not_json", str(exc)[:200]) from exc
    return [_known_entry(raw, path) for raw in raws]


def decode_known_dir(data: bytes, path: str = "") -> tuple[Entry, ...]:
    """The entries of a directory blob of a tree known valid (`counts.known_valid_trees`),
    built from its pieces without `decode_dir`'s checks (they passed when the tree was
    recorded): about half its cost. TreeInvalid as `decode_dir` for bytes that do not split
    as a directory."""
    pieces = entry_pieces(data)
    if pieces is None:
        return decode_dir(data, path)
    return tuple(known_entries(pieces, path))


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
                entry = _entry(raw, path)
                if canonical_json(raw) != text:
                    return None
            except (ValueError, TypeError, TreeInvalid):
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


def _known_entry(raw: Any, path: str) -> Entry:
    # Only the shape (what building the entry needs): a wrong one is refused, not guessed.
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(kind, str) or frozenset(raw) not in _KEYS.get(kind, ()):
        raise TreeInvalid(path, "bad_fields")
    chunks = raw.get("chunks")
    return Entry(
        name=raw["name"],
        type=raw["type"],
        mode=raw.get("mode", 0),
        size=raw.get("size", 0),
        digest=raw.get("digest"),
        chunks=tuple(chunks) if chunks is not None else None,
        target=raw.get("target", ""),
    )


def _decode_canonical(data: bytes, path: str) -> tuple[Entry, ...] | None:
    """The entries of a blob that is valid and canonical, checked without the duplicate-key
    hook and without re-encoding the entries: the bytes must equal the canonical encoding of
    what they parse to (which has every key once, so they hold no duplicate key) and the names
    must be strictly increasing as UTF-8 bytes (so unique, and in `encode_dir`'s order); a
    validated entry's `as_json()` is exactly its parsed object. None for any other blob:
    `_decode_strict` then finds the reason."""
    try:
        value = json.loads(data)
        if (
            not isinstance(value, dict)
            or len(value) != 2
            or value.get("schema") != SCHEMA
            or not isinstance(value.get("entries"), list)
            or canonical_json(value) != data
        ):
            return None
        entries = tuple(_entry(raw, path) for raw in value["entries"])
    except (UnicodeDecodeError, ValueError, TypeError, TreeInvalid):
        return None
    previous = b""
    for entry in entries:
        key = entry.name.encode("utf-8")
        if previous and key <= previous:
            return None
        previous = key
    return entries


def _decode_strict(data: bytes, path: str) -> tuple[Entry, ...]:
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise TreeInvalid(path, "not_json", str(exc)[:200]) from exc
    if not isinstance(value, dict) or set(value) != {"schema", "entries"}:
        raise TreeInvalid(path, "not_a_directory")
    if value["schema"] != SCHEMA:
        raise TreeInvalid(path, "unknown_schema")
    if not isinstance(value["entries"], list):
        raise TreeInvalid(path, "not_a_directory")
    entries = tuple(_entry(raw, path) for raw in value["entries"])
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise TreeInvalid(_join(path, entry.name), "duplicate_name")
        seen.add(entry.name)
    if encode_dir(entries) != data:
        raise TreeInvalid(path, "not_canonical")
    return entries


@dataclass(slots=True)
class Walk:
    """A tree read through: `entries` by path (directories included, the root not), the
    blobs it reaches (directory blobs, file contents and chunks), and the names it reached
    that `load` could not find (a missing directory is not descended into)."""

    root: str
    entries: dict[str, Entry] = field(default_factory=dict)
    directories: dict[str, str] = field(default_factory=dict)  # dir blob name → a path to it
    contents: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)
    # The size each file names its content blob with (one size per blob: two are refused), and
    # the files stored in chunks, by path (their size is the chunks' sum): what registration
    # compares with the stored sizes.
    sizes: dict[str, int] = field(default_factory=dict)
    chunked: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)
    files: int = 0
    bytes: int = 0
    count: int = 0  # entries of every kind, the root not counted

    def reached(self) -> set[str]:
        return {self.root, *self.directories, *self.contents}


def claim_size(
    sizes: dict[str, int], chunked: dict[str, tuple[int, tuple[str, ...]]], path: str, entry: Entry
) -> bool:
    """Record the size the file `entry` at `path` gives its content: False when its single
    blob was already named with another size (a blob has one size, so one of them lies)."""
    if entry.chunks is not None:
        chunked[path] = (entry.size, entry.chunks)
        return True
    assert entry.digest is not None  # noqa: S101 - decode_dir checked it
    return sizes.setdefault(entry.digest, entry.size) == entry.size


def walk(
    root: str,
    load: Callable[[str], bytes | None] | None = None,
    *,
    max_entries: int = 2_000_000,
    contents: Callable[[Iterable[str]], Iterable[str]] | None = None,
    load_many: Callable[[list[str]], Mapping[str, bytes]] | None = None,
    keep_files: bool = True,
    known_valid: bool = False,
) -> Walk:
    """Read the tree `root`, validating every directory, the depth (at most 256 directories),
    cycles and symlinks (a target must stay inside the tree, also through the tree's other
    symlinks). Directories are read level by level: through `load_many(names)` (the stored
    ones among them, by name: one call per level) when given, else `load(name)` (None: not
    stored) one by one. `contents(names)`, when given, answers which file blobs are missing;
    else none are looked up. `keep_files=False` leaves files out of `entries` (directories
    and symlinks stay: the symlink check needs them), for callers that need only the counts
    and the blobs of a large tree. `known_valid` (the caller knows the tree valid:
    `counts.known_valid_trees`) decodes each directory without the checks it passed when the
    tree was recorded (`decode_known_dir`; the depth, cycle and symlink checks still run).
    Raises TreeInvalid."""
    if not isinstance(root, str) or not BLOB_NAME.fullmatch(root):
        raise TreeInvalid("", "bad_digest")
    result = Walk(root=root)
    level: list[tuple[str, str, tuple[str, ...]]] = [("", root, ())]
    depth = 0
    count = 0
    while level:
        if depth > MAX_DEPTH:
            raise TreeInvalid(level[0][0], "too_deep")
        names = sorted({digest for _, digest, _ in level})
        stored = _load_level(names, load, load_many)
        following: list[tuple[str, str, tuple[str, ...]]] = []
        for path, digest, chain in level:
            if digest in chain:
                raise TreeInvalid(path, "cycle")
            data = stored.get(digest)
            if data is None:
                result.missing.append(digest)
                continue
            entries = decode_stored_dir(data, digest, path, known_valid=known_valid)
            result.directories.setdefault(digest, path)
            for entry in entries:
                where = _join(path, entry.name)
                count += 1
                if count > max_entries:
                    raise TreeInvalid(where, "too_many_entries")
                _walk_record(result, where, entry, keep_files=keep_files)
                if entry.type == "dir":
                    assert entry.digest is not None  # noqa: S101 - decode_dir checked it
                    following.append((where, entry.digest, (*chain, digest)))
        level = following
        depth += 1
    result.count = count
    result.missing = list(dict.fromkeys(result.missing))
    check_symlinks(result.entries)
    if contents is not None:
        result.missing.extend(contents(sorted(result.contents)))
    return result


def _load_level(
    names: list[str],
    load: Callable[[str], bytes | None] | None,
    load_many: Callable[[list[str]], Mapping[str, bytes]] | None,
) -> Mapping[str, bytes]:
    """The stored directory blobs among `names`, by name: one `load_many` call, else `load`
    one by one."""
    if load_many is not None:
        return load_many(names)
    assert load is not None  # noqa: S101 - one of the two is required
    return {n: d for n in names if (d := load(n)) is not None}


def _walk_record(result: Walk, where: str, entry: Entry, *, keep_files: bool) -> None:
    """Keep `entry` in the walk's entries (a file only with `keep_files`) and count a file:
    its bytes, its blobs, the size its blob is named with."""
    if keep_files or entry.type != "file":
        result.entries[where] = entry
    if entry.type != "file":
        return
    result.files += 1
    result.bytes += entry.size
    result.contents.update(entry.blobs())
    if not claim_size(result.sizes, result.chunked, where, entry):
        raise TreeInvalid(where, "size_mismatch", "its blob is named with two sizes")


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
    trees' symlinks are the same is `head`'s check `root`'s). The caller then walks the
    whole tree, which finds the exact reason or a tree that is fine after all."""
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
            if own is None or old is None or (mine is not None and mine in chain):
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
        where = _join(path, entry.name)
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


def stored_dir(
    stored: Mapping[str, bytes], digest: str | None, path: str, *, known_valid: bool = False
) -> dict[str, Entry] | None:
    """The entries by name of the directory blob `digest` ({} for None; None: not stored);
    `known_valid`: of a tree known valid (`decode_known_dir`)."""
    if digest is None:
        return {}
    data = stored.get(digest)
    if data is None:
        return None
    return {
        entry.name: entry
        for entry in decode_stored_dir(data, digest, path, known_valid=known_valid)
    }


def check_symlinks(entries: Mapping[str, Entry]) -> None:
    """Every symlink resolves inside the tree, to a path and not round a loop: its target is
    followed lexically and through the tree's own symlinks, its last component included (a
    link to `..` inside a subdirectory is fine; two links that together climb out are not;
    nor are links that resolve to each other). A target that names nothing in the tree is
    fine while it stays inside."""
    resolved: dict[str, str] = {}  # link path → the path it resolves to, once known
    for path, entry in entries.items():
        if entry.type == "symlink":
            _follow(entries, path, entry, link=path, hops=0, resolved=resolved)


def _follow(
    entries: Mapping[str, Entry],
    path: str,
    entry: Entry,
    *,
    link: str,
    hops: int,
    resolved: dict[str, str],
) -> str:
    """Where the symlink `entry` at `path` resolves (`link`: the symlink being checked, named
    in the error). Each link is resolved once: a loop never resolves, so it stops at the hop
    limit whatever the order."""
    if path in resolved:
        return resolved[path]
    if hops > MAX_SYMLINK_HOPS:
        raise TreeInvalid(link, "symlink_loop")
    parts = [p for p in path.rpartition("/")[0].split("/") if p]
    for component in (c for c in entry.target.split("/") if c not in ("", ".")):
        if component == "..":
            if not parts:
                raise TreeInvalid(link, "escaping_symlink")
            parts.pop()
            continue
        parts.append(component)
        here = "/".join(parts)
        found = entries.get(here)
        if found is not None and found.type == "symlink":
            through = _follow(entries, here, found, link=link, hops=hops + 1, resolved=resolved)
            parts = [p for p in through.split("/") if p]
    resolved[path] = "/".join(parts)
    return resolved[path]


def build(entries: Mapping[str, Entry]) -> tuple[str, dict[str, bytes]]:
    """The tree holding `entries` (by path; a directory's own entry gives its mode, and its
    digest is recomputed here): its root name and every directory blob by name."""
    children: dict[str, list[str]] = {"": []}
    for path in entries:
        children.setdefault(path.rpartition("/")[0], []).append(path)
        if entries[path].type == "dir":
            children.setdefault(path, [])
    for parent in children:
        if parent and (parent not in entries or entries[parent].type != "dir"):
            raise TreeInvalid(parent, "not_a_directory")
    blobs: dict[str, bytes] = {}
    digests: dict[str, str] = {}
    # Deepest first, so each directory's children have their digests when it is encoded.
    order = sorted(children, key=lambda p: p.count("/") + (1 if p else 0), reverse=True)
    for directory in order:
        own: list[Entry] = []
        for path in children[directory]:
            entry, name = entries[path], path.rpartition("/")[2]
            if entry.type == "dir":
                entry = Entry(name=name, type="dir", mode=entry.mode, digest=digests[path])
            elif entry.name != name:
                entry = replace(entry, name=name)
            own.append(entry)
        data = encode_dir(own)
        name = blob_name(data)
        blobs[name] = data
        digests[directory] = name
    return digests[""], blobs
