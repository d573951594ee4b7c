"""The snapshot's scan with the watcher (`paperclip-agent watch`): the workdir read again only
where the watcher says it changed since the last snapshot, else read whole.

`scan_watched` asks the watcher first (its new token is taken before anything is read, so a
change made while the scan runs is in the next answer), then reads, when the watcher vouches
for every event since the token the workdir's state names (`watch.json`, which goes with the
index): the directories it names, listed and their entries' `lstat` checked against the stat
cache as a full scan does (a directory created or moved in is read whole, with its subtree);
the directories of racily clean index entries and of files with other hard links, whatever
the watcher says; and nothing else: every other directory's entries are the index's and its
blob the last tree's. Only the directories above a change are built again, and every symlink
of the tree is checked again (a change elsewhere can make one leave the workdir). Anything
amiss (no watcher, no answer, `full`, another index, new ignore rules, an incomplete state)
means the full scan, never an error; one line says which path was taken and why.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from paperclip_client.trees import blob_name
from paperclip_client.workdir import splice
from paperclip_client.workdir.errors import WorkdirError
from paperclip_client.workdir.index import (
    DIRS,
    INDEX,
    STATE_DIR,
    Index,
    RowChanges,
    Rows,
    Stat,
    load_dirs,
    state_path,
)
from paperclip_client.workdir.scanning import (
    IGNORE_FILE,
    MAX_DEPTH,
    Scan,
    _collect,
    collect_named,
    keep_links,
    load_ignore,
    read_found,
    scan,
)
from paperclip_client.workdir.splice import Entries
from paperclip_client.workdir.transfer import Say
from paperclip_client.workdir.watch_state import (
    STATE,
    Answer,
    WatchState,
    ask,
    ignore_digest,
    load_state,
)

type Raw = dict[str, Any]  # a directory entry as encoded (`Entry.as_json`)
# A directory's entries by name: read whole (a plain dict), or the old blob's with changes.
type Kids = dict[str, Raw] | Entries


class Fallback(Exception):
    """Why the partial scan gave up: the full scan follows."""


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _depth(path: str) -> int:
    return path.count("/") + 1 if path else 0


def scan_watched(
    workdir: Path,
    *,
    max_blob_bytes: int,
    index: Index | None,
    warn: Say,
    say: Say,
    trust: tuple[str, str] | None,
) -> Scan:
    """The workdir read into a tree, in part when the watcher vouches for the rest. A partial
    scan knows where only the blobs it read can be read (`sources`): it is taken only when
    the index is trusted for this server and workspace (`trust`), so that the upload asks
    about nothing else."""
    state = load_state(workdir)
    rules = ignore_digest(workdir)  # before the scan reads them: a change after is seen next
    reason = _unusable(rules, index, state, max_blob_bytes)
    if reason is None and (index is None or trust != (index.server, index.workspace)):
        reason = "every blob is asked about (the index is not trusted for this workspace)"
    answer = ask(workdir, state.token if reason is None and state is not None else None)
    if isinstance(answer, str):
        say(f"full scan: {answer}")
        return scan(workdir, max_blob_bytes=max_blob_bytes, index=index, warn=warn)
    reason = reason or answer.full
    if reason is None:
        assert index is not None  # noqa: S101 - checked by _unusable
        assert state is not None  # noqa: S101 - checked by _unusable
        try:
            found = Partial(workdir, index, state, answer, max_blob_bytes, warn).run()
        except Fallback as exc:
            reason = str(exc)
        else:
            changed = len(answer.dirs | answer.trees | answer.names.keys())
            dirs = "directory" if changed == 1 else "directories"
            files = "file" if found.hashed == 1 else "files"
            say(f"watcher: {changed} {dirs} changed ({found.hashed} {files} read)")
    if reason is not None:
        say(f"full scan: {reason}")
        found = scan(workdir, max_blob_bytes=max_blob_bytes, index=index, warn=warn)
    found.token, found.ignore, found.max_blob_bytes = answer.token, rules, max_blob_bytes
    return found


def _unusable(
    rules: str | None, index: Index | None, state: WatchState | None, max_blob_bytes: int
) -> str | None:
    if index is None or index.tree is None:
        return "no index yet"
    if state is None:
        return "no watcher state from an earlier snapshot"
    if not index.id or state.index != index.id or state.tree != index.tree:
        return "the index was written since the watcher's last snapshot (a checkout)"
    if state.ignore != rules:
        return "the ignore rules changed"
    if state.max_blob_bytes != max_blob_bytes:
        return "the store's blob limit changed"
    return None


class Partial:
    """One partial scan: the last tree's directories by path, changed where the workdir was
    read again."""

    def __init__(
        self,
        workdir: Path,
        index: Index,
        state: WatchState,
        answer: Answer,
        max_blob_bytes: int,
        warn: Say,
    ) -> None:
        self.workdir = workdir
        self.index = index
        self.state = state
        self.answer = answer
        self.max_blob_bytes = max_blob_bytes
        self.warn = warn
        self.paths = dict(state.paths)
        if self.paths.get("") != index.tree or not (state_path(workdir) / DIRS).is_file():
            raise Fallback("the last tree's directories are not in the state")
        if index.rows.unreadable:
            raise Fallback(f"the stat cache in {INDEX} could not be read")
        self.old = TreeDirs(workdir, self.paths.values(), {})
        self.built: dict[str, bytes] = {}
        self.spec = load_ignore(workdir)
        # The index's rows with what this scan changed in them (only those rows are looked
        # up); a scan that read nothing has the index's `Rows` as they are.
        self.stats = RowChanges(index.rows)
        self.links = dict(state.links)
        self.left_out = dict(state.left_out)
        # The directories to build again: their entries by name, as they are encoded (the
        # blobs of the last tree are the client's own, read back without the checks a tree
        # from the server gets, as the index is): a directory listed again or read whole is
        # a dict; one changed in some entries is its old blob's bytes and the changes
        # (`splice.Entries`), spliced into those bytes when it is built again.
        self.kids: dict[str, Kids] = {}
        self.fresh: set[str] = set()  # directories read whole in this scan
        # Entries left out of the tree that this scan saw (ignored, or in a directory outside
        # the tree that the watcher named), with their stat: `_refuse_hidden_links`.
        self.unread: list[tuple[str, os.stat_result]] = []
        self.named: dict[str, set[str]] = {}
        self.read = Scan(tree="", entries={}, dirs={}, sources={}, stats={})
        # The last tree's blobs read, checked (`_blob`), and its directories' entries looked
        # up to check their subdirectories' blobs, by directory.
        self.blobs: dict[str, bytes] = {}
        self.listings: dict[str, Entries] = {}

    def run(self) -> Scan:
        whole, named = self._to_read()
        self.named = named
        if whole or named:
            if not self.index.rows.readable():
                raise Fallback(f"the stat cache in {INDEX} could not be read")
            for directory in sorted(whole | named.keys(), key=_depth):
                if self._under_fresh(directory):
                    continue
                if directory not in self.paths:
                    self._outside(directory, None if directory in whole else named[directory])
                elif directory in whole:
                    self._relist(directory)
                else:
                    self._update(directory, named[directory])
            self._refuse_hidden_links()
            assert isinstance(self.read.stats, dict)  # noqa: S101 - its own, read into
            self.stats.update(self.read.stats)
            new_links = sorted(set(self.read.linked) - set(self.state.linked))
            if new_links:
                # A hard link made since the last snapshot: a write through one name is an
                # event in its directory alone, so the other names (unknown without reading
                # every directory) would never be looked at again. Read everything once; the
                # full scan lists every such file, looked at again in each partial scan.
                raise Fallback(f"{new_links[0]}: a new hard link (its other names are unknown)")
        kept, left_out = self._settle_links()
        self._rebuild()
        return self._result(kept, left_out, self.index.rows if not (whole or named) else None)

    def _rows(self) -> dict[str, Stat]:
        """The index's stat cache, parsed (a stat cache that cannot be: the full scan)."""
        rows = self.index.files
        if self.index.rows.unreadable:
            raise Fallback(f"the stat cache in {INDEX} could not be read")
        return rows

    def _to_read(self) -> tuple[set[str], dict[str, set[str]]]:
        """The directories listed again (the watcher's `dirs`), and the entries looked at
        again by directory: the watcher's `names`, the directories it says were made or moved
        in (read whole), racily clean entries and files with other hard links."""
        answer = self.answer
        whole = set(answer.dirs)
        named: dict[str, set[str]] = {d: set(ns) for d, ns in answer.names.items()}

        def add(path: str) -> None:
            directory, _, name = path.rpartition("/")
            named.setdefault(directory, set()).add(name)

        for tree in answer.trees:
            if tree:
                add(tree)
        if self.index.racy():  # the header says whether any row is: else none is looked at
            written = self.index.written_ns
            for path, row in self._rows().items():
                if row[1] >= written:
                    add(path)
        for path in self.state.linked:
            add(path)
        return whole, named

    def _under_fresh(self, path: str) -> bool:
        while True:
            if path in self.fresh:
                return True
            if not path:
                return False
            path = _parent(path)

    def _blob(self, directory: str) -> bytes:
        """The last tree's blob of `directory`, a directory of that tree this scan has not
        built again nor forgotten (`_last`)."""
        name = self.paths.get(directory)
        if name is None or name != self.state.paths.get(directory):
            raise Fallback(f"{directory or '.'}: not a directory of the last tree")
        return self._last(directory)

    def _last(self, directory: str) -> bytes:
        """The blob `watch.json`'s `paths` names for `directory`, checked: its bytes are what
        its name says (`dirs.json`), and that name is the one its parent's blob, checked the
        same way up to the root (the index's tree), gives it. The entries a partial scan does
        not touch are kept as these blobs hold them: state altered since the last snapshot
        (by hand, a bad disk, a bug) gives the full scan, never a tree the workdir does not
        hold."""
        data = self.blobs.get(directory)
        if data is None:
            name = self.state.paths.get(directory)
            if name is None:
                raise Fallback(f"{STATE}: {directory}: a directory of the last tree it omits")
            try:
                data = self.old[name]
            except WorkdirError as exc:
                raise Fallback(str(exc)) from None
            if blob_name(data) != name:
                raise Fallback(f"{DIRS}: {directory or '.'}: its blob is not what its name says")
            if directory:
                parent, _, base = directory.rpartition("/")
                self._held_as(parent, base, name)
            self.blobs[directory] = data
        return data

    def _held_as(self, directory: str, name: str, blob: str | None) -> None:
        """The last tree's `directory` holds the directory `name` with the blob `blob` (None:
        holds no directory `name`), else the full scan (`watch.json` is not that tree's)."""
        listing = self.listings.get(directory)
        if listing is None:
            listing = self.listings[directory] = Entries(self._last(directory), _decoded)
        entry = listing.get(name)
        held = entry.get("digest") if entry is not None and entry["type"] == "dir" else None
        if held != blob:
            path = _join(directory, name)
            raise Fallback(f"{STATE}: {path}: not the directory the last tree holds there")

    def _old(self, directory: str) -> Entries:
        """The entries of `directory` in the last tree, found in its blob's bytes one by one
        as they are wanted."""
        return Entries(self._blob(directory), _decoded)

    def _refuse_ignored(self, directory: str, old: Mapping[str, Raw]) -> None:
        """A path the last tree holds that the ignore rules match is not ignored (it is
        tracked: left out, the snapshot would publish its deletion); the full scan knows
        every tracked path, this partial one does not: it gives way."""
        if self.spec is None:
            return
        for name, entry in old.items():
            path = _join(directory, name)
            if self.spec.match_file(path + "/" if entry["type"] == "dir" else path):
                raise Fallback(f"{path}: tracked, and matched by {IGNORE_FILE}")

    def _relist(self, directory: str) -> None:
        """List `directory` and `lstat` its entries again; a directory that is new there, or
        that the watcher says was made or moved in, is read whole."""
        old = _decoded(self._blob(directory))
        self._refuse_ignored(directory, old)
        for name, entry in old.items():
            if entry["type"] == "file":
                self.stats.pop(_join(directory, name), None)
            elif entry["type"] == "symlink":
                self.links.pop(_join(directory, name), None)
        for path in [p for p in self.left_out if _parent(p) == directory]:
            del self.left_out[path]
        keep = {
            _join(directory, n)
            for n, e in old.items()
            if e["type"] == "dir" and _join(directory, n) not in self.answer.trees
        }
        for path in keep:  # kept, not read: the blob `paths` names must be the tree's
            self._held_as(directory, path.rpartition("/")[2], self.state.paths.get(path))
        found: dict[str, tuple[str, os.stat_result | str]] = {}
        try:
            depth = _depth(directory)
            _collect(self.workdir, directory, self.spec, found, self.warn, depth, keep, self.unread)
        except WorkdirError as exc:
            raise Fallback(str(exc)) from exc
        for name, entry in old.items():
            path = _join(directory, name)
            if entry["type"] == "dir" and (path not in keep or found.get(path, ("",))[0] != "dir"):
                self._drop(path)
        self.kids[directory] = {}
        self._take(found, keep)

    def _update(self, directory: str, names: set[str]) -> None:
        """Look at the entries `names` of `directory` again, as `_relist` would (a directory
        among them that is new there, or made or moved in, is read whole)."""
        kids = self._old(directory)
        self._refuse_ignored(directory, {n: kids[n] for n in names if n in kids})
        found: dict[str, tuple[str, os.stat_result | str]] = {}
        keep: set[str] = set()
        for name in sorted(names):
            path = _join(directory, name)
            prev = kids.pop(name, None)
            was_dir = prev is not None and prev["type"] == "dir"
            if prev is not None and prev["type"] == "file":
                self.stats.pop(path, None)
            self.links.pop(path, None)
            self.left_out.pop(path, None)
            if was_dir and path not in self.answer.trees:
                self._held_as(directory, name, self.state.paths.get(path))  # kept, not read
                keep.add(path)
            here: dict[str, tuple[str, os.stat_result | str]] = {}
            try:
                collect_named(
                    self.workdir, directory, name, self.spec, here, self.warn, keep, self.unread
                )
            except WorkdirError as exc:
                raise Fallback(str(exc)) from exc
            if was_dir and (path not in keep or here.get(path, ("",))[0] != "dir"):
                self._drop(path)
            found.update(here)
        self.kids[directory] = kids
        self._take(found, keep)

    def _outside(self, directory: str, names: set[str] | None) -> None:
        """The entries the watcher names (`names`; None: every entry) of a directory outside
        the tree (ignored, or in an ignored one), into `unread`."""
        if directory == STATE_DIR or directory.startswith(f"{STATE_DIR}/"):
            return
        if directory not in self.state.paths:  # not the last tree's: it must not hold it
            below, above = directory, _parent(directory)
            while above not in self.state.paths:
                below, above = above, _parent(above)
            self._held_as(above, below.rpartition("/")[2], None)
        try:
            with os.scandir(self.workdir / directory) as listing:
                here = {e.name for e in listing} if names is None else names
        except OSError:
            return  # gone (or never there): nothing in it to write through
        for name in sorted(here):
            try:
                info = os.lstat(self.workdir / directory / name)
            except OSError:
                continue
            self.unread.append((_join(directory, name), info))

    def _refuse_hidden_links(self) -> None:
        """A file left out of the tree (ignored, or outside it) with other hard links may be
        a new name of a tracked file (`ln d/f build/f`, `build/` ignored): a write through it
        is an event of that name alone, and the tracked name would never be read again. The
        full scan reads every tracked file's stat (and lists the linked ones, which each
        partial scan reads again): it follows when such a file's inode is a tracked file's
        in the stat cache, but for the linked files already known. A directory left out is
        looked into when it is new (made or moved in since the last snapshot, or in a
        directory that is); one that was there already had its own events."""
        suspects: list[tuple[str, int]] = []
        walked: list[str] = []
        for path, info in sorted(self.unread, key=lambda item: _depth(item[0])):
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                suspects.append((path, info.st_ino))
            elif stat.S_ISDIR(info.st_mode) and self._new(path):
                if any(path.startswith(f"{top}/") for top in walked):
                    continue  # looked into with a directory above it
                walked.append(path)
                suspects.extend(_linked_under(self.workdir, path))
        if not suspects:
            return
        rows = self._rows()
        known = {rows[p][3] for p in self.state.linked if p in rows}
        tracked = {row[3] for row in rows.values()} - known
        for path, inode in suspects:
            if inode in tracked:
                raise Fallback(f"{path}: a new hard link of a tracked file (left out of the tree)")

    def _new(self, path: str) -> bool:
        parent, _, name = path.rpartition("/")
        return (
            path in self.answer.trees
            or name in self.named.get(parent, ())
            or self._under_fresh(parent)
        )

    def _take(self, found: dict[str, tuple[str, os.stat_result | str]], keep: set[str]) -> None:
        """What a listing or a look at named entries found: its files read (or answered by
        the stat cache), its symlinks kept for the check, everything placed in the directory
        that holds it; directories not in `keep` were read whole."""
        for path, (kind, _info) in found.items():
            if kind == "dir" and path not in keep:
                self.fresh.add(path)
                self.kids[path] = {}
        targets = {p: str(v[1]) for p, v in found.items() if v[0] == "symlink"}
        self.links.update(targets)
        rest = {p: v for p, v in found.items() if v[0] != "symlink"}
        read_found(self.workdir, rest, self.read, self.index, self.max_blob_bytes)
        for path in rest:
            self.kids[_parent(path)][path.rpartition("/")[2]] = self.read.entries[path].as_json()

    def _drop(self, top: str) -> None:
        """Forget what the last tree had under `top` (gone, or read whole again)."""
        prefix = f"{top}/"
        for path in [p for p in self.paths if p == top or p.startswith(prefix)]:
            # Read whole again, a tracked path deep in it that the ignore rules match would
            # be left out, as if deleted (only the full scan knows every tracked path).
            old = _decoded(self._blob(path))
            self._refuse_ignored(path, old)
            for name, entry in old.items():
                if entry["type"] == "file":
                    self.stats.pop(_join(path, name), None)
            del self.paths[path]
            self.kids.pop(path, None)
        for links in (self.links, self.left_out):
            for path in [p for p in links if p.startswith(prefix)]:
                del links[path]

    def _settle_links(self) -> tuple[dict[str, str], dict[str, str]]:
        """Every symlink of the tree checked again, each placed in (or taken out of) the
        directory that holds it when that changed."""
        kept, left_out = keep_links({**self.links, **self.left_out})
        for path, target in left_out.items():
            self.warn(f"{path}: symlink to {target!r} leaves the workdir or loops; left out")
        before = self.state.links
        for path in [*kept, *left_out]:
            directory, _, name = path.rpartition("/")
            if directory not in self.kids:
                if before.get(path) == kept.get(path):
                    continue  # as the last tree has it
                self.kids[directory] = self._old(directory)
            if path in kept:
                self.kids[directory][name] = {"name": name, "type": "symlink", "target": kept[path]}
            else:
                self.kids[directory].pop(name, None)
        return kept, left_out

    def _rebuild(self) -> None:
        """The blobs of the directories read again and of every one above them (deepest
        first: a directory's entry in its parent takes its new blob's name)."""
        for directory in list(self.kids):
            above = directory
            while above:
                above = _parent(above)
                if above not in self.kids:
                    self.kids[above] = self._old(above)
        built: dict[str, set[str]] = {}  # the directories built again, by parent
        for directory in self.kids:
            if directory:
                built.setdefault(_parent(directory), set()).add(directory.rpartition("/")[2])
        for directory in sorted(self.kids, key=_depth, reverse=True):
            kids = self.kids[directory]
            if isinstance(kids, Entries):
                data = self._spliced(directory, kids, built.get(directory, set()))
            else:
                data = splice.encode_entries(
                    {n: self._with_digest(directory, e) for n, e in kids.items()}
                )
            name = blob_name(data)
            self.built[name] = data
            self.paths[directory] = name

    def _spliced(self, directory: str, kids: Entries, built: set[str]) -> bytes:
        """The blob of a directory changed in some entries: its directories among them and
        those built again (`built`) take their blob's name, every other entry is the old
        blob's as it is (a directory there names the blob it has in `paths`, which this scan
        changed only for those built again or gone)."""
        for name in built.union(kids.names()):
            entry = kids.get(name)
            if entry is not None and entry["type"] == "dir":
                kids[name] = self._with_digest(directory, entry)
        return kids.encode()

    def _with_digest(self, directory: str, entry: Raw) -> Raw:
        if entry["type"] != "dir":
            return entry
        return {**entry, "digest": self.paths[_join(directory, str(entry["name"]))]}

    def _result(self, kept: dict[str, str], left_out: dict[str, str], same: Rows | None) -> Scan:
        """The scan; `same`: the index's rows when nothing was read (its header's figures)."""
        stats = self.stats
        count, size, _newest = (same or stats).summary()
        return Scan(
            tree=self.paths[""],
            entries=self.read.entries,
            dirs=TreeDirs(self.workdir, self.paths.values(), self.built, self.old),
            sources=self.read.sources,
            stats=same if same is not None else stats,
            files=count,
            bytes=size,
            hashed=self.read.hashed,
            paths=self.paths,
            links=kept,
            left_out=left_out,
            linked=self.read.linked,
            vouched=frozenset(self.state.paths.values()),
        )


def _decoded(blob: bytes) -> dict[str, Raw]:
    """A directory blob of the last tree decoded whole (`splice.decode_entries`)."""
    try:
        return splice.decode_entries(blob)
    except (ValueError, KeyError, TypeError) as exc:
        raise Fallback(f"{DIRS} could not be read") from exc


def _linked_under(root: Path, top: str) -> Iterator[tuple[str, int]]:
    """The files with other hard links under `top` (symlinks not followed), and their inodes."""
    stack = [(top, _depth(top))]
    while stack:
        rel, depth = stack.pop()
        if depth > MAX_DEPTH:
            continue
        try:
            with os.scandir(root / rel) as listing:
                items = list(listing)
        except OSError:
            continue
        for item in items:
            try:
                info = item.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                stack.append((f"{rel}/{item.name}", depth + 1))
            elif stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                yield f"{rel}/{item.name}", info.st_ino


class TreeDirs(Mapping[str, bytes]):
    """A tree's directory blobs by name: those built now, the others read from `dirs.json`
    the first time one is wanted (a run that changed nothing never reads it)."""

    def __init__(
        self,
        workdir: Path,
        names: Iterable[str],
        built: dict[str, bytes],
        old: TreeDirs | None = None,
    ) -> None:
        self.workdir = workdir
        self.names = frozenset(names)
        self.built = built
        self.old = old
        self.loaded: dict[str, bytes] | None = None

    def _load(self) -> dict[str, bytes]:
        if self.loaded is None:
            loaded = self.old._load() if self.old is not None else load_dirs(self.workdir)
            if not all(n in loaded or n in self.built for n in self.names):
                raise WorkdirError(f"{DIRS} does not hold every directory of the last tree")
            self.loaded = loaded
        return self.loaded

    def __getitem__(self, name: str) -> bytes:
        if name not in self.names:
            raise KeyError(name)
        data = self.built.get(name)
        return data if data is not None else self._load()[name]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
