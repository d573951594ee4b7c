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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Any, Final, Literal

from paperclip.snapshots import bounds
from paperclip.snapshots.bounds import MAX_PATH_BYTES
from paperclip.snapshots.links import LinkInvalid, check_links

SCHEMA: Final = "paperclip.dir.v1"
MAX_DEPTH: Final = 256
# Names a tree may not hold at its root: the agent CLI's own state directory (a checkout
# writing it would replace the CLI's index).
RESERVED_ROOT_NAMES: Final = frozenset({".paperclip"})
# The longest symlink target Linux writes (PATH_MAX, 4,096 bytes with its NUL).
MAX_SYMLINK_TARGET_BYTES: Final = 4095
MAX_NAME_BYTES: Final = 255
MAX_MODE: Final = 0o7777
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


def names_problem(names: list[Any]) -> tuple[int, str] | None:
    """The first of `names` that cannot name an entry (its index and `name_problem`'s reason),
    or None. Short plain names, the common case, are checked all at once: joined (not a str:
    TypeError) and encoded (a lone surrogate), with no `/` and no NUL, none empty, `.` or
    `..`, and none over a quarter of the limit in characters (4 bytes each at most)."""
    try:
        joined = "\0".join(names)
        joined.encode("utf-8")
    except (TypeError, UnicodeEncodeError):
        joined = "/"
    if (
        "/" not in joined
        and joined.count("\0") == len(names) - 1
        and {"", ".", ".."}.isdisjoint(names)
        and max(map(len, names), default=0) <= MAX_NAME_BYTES // 4
    ):
        return None
    return next(((i, why) for i, name in enumerate(names) if (why := name_problem(name))), None)


def join_path(parent: str, name: str) -> str:
    """The path of `name` inside the directory at `parent` ("" for the root)."""
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


def checked_entry(raw: object, path: str) -> Entry:
    """One entry of a directory blob, parsed, checked strictly (TreeInvalid naming why)."""
    if not isinstance(raw, dict):
        raise TreeInvalid(path, "bad_entry")
    problem = name_problem(raw.get("name"))
    if problem:
        raise TreeInvalid(path, problem)
    name: str = raw["name"]
    where = join_path(path, name)
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
    if len(target.encode("utf-8", "surrogatepass")) > MAX_SYMLINK_TARGET_BYTES:
        # No filesystem makes such a link (ENAMETOOLONG): the tree could never be written.
        raise TreeInvalid(where, "symlink_target_too_long")
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
    if _plain_dir(data):
        return tuple(known_entries(entry_pieces(data) or [], path))
    return _decode_full(data, path)


def _decode_full(data: bytes, path: str) -> tuple[Entry, ...]:
    entries = _decode_canonical(data, path)
    return entries if entries is not None else _decode_strict(data, path)


def valid_pieces(data: bytes, path: str = "") -> list[bytes]:
    """The pieces (`entry_pieces`) of a directory blob validated as `decode_dir` validates
    it, without building its entries when it is in the usual form (`_plain_dir`): TreeInvalid
    with `decode_dir`'s reason."""
    if not _plain_dir(data):
        _decode_full(data, path)  # refuses with the reason, or it is valid in an unusual form
    pieces = entry_pieces(data)
    if pieces is None:  # a valid directory always splits
        raise TreeInvalid(path, "not_canonical")
    return pieces


# A directory blob in its usual form, matched whole in one pass in C: files with a digest,
# directories and symlinks whose names and targets need no escape, modes and sizes in range
# (a size below 10**15). What it does not match (a chunked file, an escaped name, any fault)
# goes to the full decode, so it never accepts what that refuses.
_NAME: Final = rb'[^"\\\x00-\x1f/]{1,255}'
_MODE: Final = rb"(?:[0-9]|[1-9][0-9]{1,2}|[1-3][0-9]{3}|40[0-8][0-9]|409[0-5])"
_ENTRY: Final = b"".join([
    rb'\{"(?:digest":"sha256:[0-9a-f]{64}","mode":', _MODE, rb',"name":"', _NAME,
    rb'",(?:"size":(?:0|[1-9][0-9]{0,14}),"type":"file"|"type":"dir")',
    rb'|name":"', _NAME, rb'","target":"(?!/)[^"\\\x00-\x1f]{1,4095}","type":"symlink")\}',
])  # fmt: skip
_PLAIN_DIR: Final = re.compile(b"".join([
    rb'\{"entries":\[(?:', _ENTRY, rb"(?:,", _ENTRY, rb")*)?\]",
    rb',"schema":"', re.escape(SCHEMA.encode()), rb'"\}',
]))  # fmt: skip
_NAMES: Final = re.compile(rb'"name":"([^"]*)"')


def _plain_dir(data: bytes) -> bool:
    """True when `data` is a valid directory blob in the usual form (`_PLAIN_DIR`), decided
    in a few passes in C: it matches, it is UTF-8, no name is `.` or `..`, and its names
    increase strictly as bytes. Such a blob is exactly the canonical encoding of its entries.
    False decides nothing: `decode_dir` then does."""
    if _PLAIN_DIR.fullmatch(data) is None or b'"name":".",' in data or b'"name":"..",' in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    # A name or a target holds no `"` here, so every `"name":"` is a key's.
    names = _NAMES.findall(data)
    return all(map(bytes.__lt__, names, names[1:]))


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
# How every entry's canonical JSON ends: "type" is the last of its sorted keys, whatever the kind.
_ENTRY_ENDS: Final = (b',"type":"file"', b',"type":"dir"', b',"type":"symlink"')


def entry_pieces(data: bytes) -> list[bytes] | None:
    """The entries of a valid directory blob as raw pieces, in order, without decoding them:
    each is one entry's canonical JSON without its opening `{"` and closing `}`. Two entries
    are equal exactly when their pieces are, so two directories can be compared piece by piece
    and only the entries that differ decoded (`known_entries`). None when the blob is not framed
    as a directory.

    Splitting is exact for a valid (canonical) blob only, so the caller must know the blob
    valid (`decode_dir` passed, now or when its tree was recorded) or validate every piece
    (`changes.differing_entries`). `},{"` also occurs inside an entry, where a name or a
    symlink's target ends with `},{` (its closing quote follows), so the blob is split there
    and a part is joined to the next until it ends as every entry ends, with its `"type"`
    (last of the sorted keys): a string cannot hold that ending, because it holds `"` only
    as `\\"`."""
    if not (data.startswith(_DIR_HEAD) and data.endswith(_DIR_TAIL)):
        return None
    body = data[len(_DIR_HEAD) : len(data) - len(_DIR_TAIL)]
    if not body:
        return []
    if not (body.startswith(b'{"') and body.endswith(b"}")):
        return None
    parts = body[2:-1].split(_ENTRY_BETWEEN)
    if all(map(bytes.endswith, parts, repeat(_ENTRY_ENDS))):
        return parts
    pieces: list[bytes] = []
    pending: list[bytes] = []
    for part in parts:
        pending.append(part)
        if part.endswith(_ENTRY_ENDS):
            pieces.append(_ENTRY_BETWEEN.join(pending))
            pending = []
    if pending:  # not a valid directory: the caller's validation refuses it
        pieces.append(_ENTRY_BETWEEN.join(pending))
    return pieces


def known_entries(pieces: list[bytes], path: str) -> list[Entry]:
    """The entries of `pieces` of one directory (at `path`) of a tree known valid, decoded in
    one parse and built without `decode_dir`'s checks (they passed when the tree was
    recorded) but their shape. TreeInvalid when they do not parse as entries of that shape."""
    return [_known_entry(raw, path) for raw in known_objects(pieces, path)]


def known_objects(pieces: list[bytes], path: str) -> list[Any]:
    """The JSON values of `pieces` of one directory (at `path`), in one parse, unchecked.
    TreeInvalid when they do not parse as one value per piece."""
    if not pieces:
        return []
    try:
        raws = json.loads(b'[{"' + _ENTRY_BETWEEN.join(pieces) + b"}]")
        if not isinstance(raws, list) or len(raws) != len(pieces):
            raise ValueError("not one entry per piece")
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError too; nesting too deep
        raise TreeInvalid(path, "not_json", str(exc)[:200]) from exc
    return raws


def plain_files(raws: list[Any]) -> list[bool]:
    """For each of `raws` (values of `known_objects`): whether it has the shape of a regular
    file's entry, its mode (no bit above 0o777: setuid, setgid, sticky) and size integers."""
    digest, chunks = _KEYS["file"]
    return [
        type(raw) is dict
        and (raw.keys() == digest or raw.keys() == chunks)
        and raw["type"] == "file"
        and type(raw["mode"]) is int is type(raw["size"])
        and 0 <= raw["mode"] <= 0o777
        for raw in raws
    ]


def decode_known_dir(data: bytes, path: str = "") -> tuple[Entry, ...]:
    """The entries of a directory blob of a tree known valid (`counts.known_valid_trees`),
    built from its pieces without `decode_dir`'s checks (they passed when the tree was
    recorded): about half its cost. TreeInvalid as `decode_dir` for bytes that do not split
    as a directory."""
    pieces = entry_pieces(data)
    if pieces is None:
        return decode_dir(data, path)
    return tuple(known_entries(pieces, path))


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
        entries = tuple(checked_entry(raw, path) for raw in value["entries"])
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError, TreeInvalid):
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
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # RecursionError: nesting deeper than the parser goes (an agent's blob, never a
        # directory): refused as not JSON, never a 500.
        raise TreeInvalid(path, "not_json", str(exc)[:200]) from exc
    if not isinstance(value, dict) or set(value) != {"schema", "entries"}:
        raise TreeInvalid(path, "not_a_directory")
    if value["schema"] != SCHEMA:
        raise TreeInvalid(path, "unknown_schema")
    if not isinstance(value["entries"], list):
        raise TreeInvalid(path, "not_a_directory")
    entries = tuple(checked_entry(raw, path) for raw in value["entries"])
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise TreeInvalid(join_path(path, entry.name), "duplicate_name")
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
    max_entries: int | None = None,
    max_path_bytes: int | None = None,
    contents: Callable[[Iterable[str]], Iterable[str]] | None = None,
    load_many: Callable[[list[str]], Mapping[str, bytes]] | None = None,
    keep_files: bool = True,
    known_valid: bool = False,
    max_symlink_steps: int | None = None,
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
    A directory blob reached by several paths is decoded once; every path counts against
    `max_entries`, and the paths' lengths added up against `max_path_bytes` (a few kilobytes
    of directories sharing subdirectories name millions of long paths: the walk's memory is
    bounded by these, not by what was uploaded); the symlinks' targets, resolved path by path,
    against `max_symlink_steps` (`check_symlinks`). The bounds not given are `bounds`'s, for
    trees that were registered. Raises TreeInvalid."""
    if not isinstance(root, str) or not BLOB_NAME.fullmatch(root):
        raise TreeInvalid("", "bad_digest")
    result = Walk(root=root)
    level: list[tuple[str, str, tuple[str, ...]]] = [("", root, ())]
    depth = 0
    count = 0
    budget = Budget(
        bounds.walk_entries() if max_entries is None else max_entries,
        bounds.walk_path_bytes() if max_path_bytes is None else max_path_bytes,
    )
    decoded: dict[str, Sequence[Entry]] = {}
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
            entries = _decoded_once(decoded, data, digest, path, known_valid=known_valid)
            result.directories.setdefault(digest, path)
            for entry in entries:
                where = join_path(path, entry.name)
                count += 1
                if not budget.spend(1, len(where)):
                    raise TreeInvalid(where, "too_many_entries", budget.why())
                _walk_record(result, where, entry, keep_files=keep_files)
                if entry.type == "dir":
                    assert entry.digest is not None  # noqa: S101 - decode_dir checked it
                    following.append((where, entry.digest, (*chain, digest)))
        level = following
        depth += 1
    result.count = count
    result.missing = list(dict.fromkeys(result.missing))
    check_symlinks(result.entries, max_steps=max_symlink_steps)
    if contents is not None:
        result.missing.extend(contents(sorted(result.contents)))
    return result


class Budget:
    """What a walk may still spend: entries (each path counts once, however many paths share
    a directory) and bytes of path text."""

    __slots__ = ("entries", "limits", "path_bytes")

    def __init__(self, entries: int, path_bytes: int = MAX_PATH_BYTES) -> None:
        self.entries, self.path_bytes = entries, path_bytes
        self.limits = (entries, path_bytes)

    def spend(self, entries: int, path_bytes: int = 0) -> bool:
        """Spend; False once either is overspent."""
        self.entries -= entries
        self.path_bytes -= path_bytes
        return self.entries >= 0 and self.path_bytes >= 0

    def why(self) -> str:
        if self.entries < 0:
            return f"more than {self.limits[0]} entries"
        return f"its paths add up to over {self.limits[1]} bytes"


def _decoded_once(
    decoded: dict[str, Sequence[Entry]], data: bytes, digest: str, path: str, *, known_valid: bool
) -> Sequence[Entry]:
    """The entries of the directory `digest`, decoded (and validated) the first time a walk
    meets it, reused wherever else it is reached."""
    entries = decoded.get(digest)
    if entries is None:
        entries = decode_stored_dir(data, digest, path, known_valid=known_valid)
        decoded[digest] = entries
    return entries


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


def check_symlinks(entries: Mapping[str, Entry], *, max_steps: int | None = None) -> None:
    """Every symlink resolves inside the tree, to a path and not round a loop: its target is
    followed lexically and through the tree's own symlinks, its last component included (a
    link to `..` inside a subdirectory is fine; two links that together climb out are not;
    nor are links that resolve to each other). A target that names nothing in the tree is
    fine while it stays inside. Each path's links are resolved on their own, so a shared
    directory's links are resolved wherever it stands: past `max_steps` components of targets
    resolved the tree is `too_many_entries` (`links.check_links`; by default `bounds`'s, for
    trees that were registered)."""
    links = {path: entry.target for path, entry in entries.items() if entry.type == "symlink"}
    directories = (path for path, entry in entries.items() if entry.type == "dir")
    steps = bounds.walk_symlink_steps() if max_steps is None else max_steps
    try:
        check_links(links, directories, max_steps=steps)
    except LinkInvalid as exc:
        raise TreeInvalid(exc.path, exc.reason, exc.detail) from None


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
