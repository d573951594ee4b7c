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
from collections.abc import Iterable
from pathlib import Path

from paperclip_client.trees import Entry, TreeError, blob_name, decode_dir, encode_dir
from paperclip_client.workdir.errors import WorkdirError
from paperclip_client.workdir.index import Index, Stat, load_dirs
from paperclip_client.workdir.scanning import (
    Scan,
    _collect,
    chunking,
    content_ok,
    keep_links,
    load_ignore,
    read_found,
    scan,
)
from paperclip_client.workdir.transfer import Say
from paperclip_client.workdir.watch_state import (
    Answer,
    WatchState,
    ask,
    ignore_digest,
    load_state,
)


class Fallback(Exception):
    """Why the partial scan gave up: the full scan follows."""


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _depth(path: str) -> int:
    return path.count("/") + 1 if path else 0


def scan_watched(
    workdir: Path, *, max_blob_bytes: int, index: Index | None, warn: Say, say: Say
) -> Scan:
    """The workdir read into a tree, in part when the watcher vouches for the rest."""
    state = load_state(workdir)
    rules = ignore_digest(workdir)  # before the scan reads them: a change after is seen next
    reason = _unusable(rules, index, state)
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
        except (Fallback, TreeError) as exc:
            reason = str(exc)
        else:
            changed = len(answer.dirs | answer.trees)
            say(f"watcher: {changed} directories changed ({found.hashed} files read)")
    if reason is not None:
        say(f"full scan: {reason}")
        found = scan(workdir, max_blob_bytes=max_blob_bytes, index=index, warn=warn)
    found.token, found.ignore = answer.token, rules
    return found


def _unusable(rules: str | None, index: Index | None, state: WatchState | None) -> str | None:
    if index is None or index.tree is None:
        return "no index yet"
    if state is None:
        return "no watcher state from an earlier snapshot"
    if not index.id or state.index != index.id or state.tree != index.tree:
        return "the index was written since the watcher's last snapshot (a checkout)"
    if state.ignore != rules:
        return "the ignore rules changed"
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
        self.blobs = load_dirs(workdir)
        self.paths = dict(state.paths)
        names = self.paths.values()
        if self.paths.get("") != index.tree or not all(n in self.blobs for n in names):
            raise Fallback("the last tree's directories are not all in the state")
        self.spec = load_ignore(workdir)
        self.stats: dict[str, Stat] = dict(index.files)
        self.links = dict(state.links)
        self.left_out = dict(state.left_out)
        self.kids: dict[str, dict[str, Entry]] = {}  # directories to build again
        self.fresh: set[str] = set()  # directories read whole in this scan
        self.read = Scan(tree="", entries={}, dirs={}, sources={}, stats={})

    def run(self) -> Scan:
        for directory in sorted(self._to_read(), key=_depth):
            if directory in self.paths and not self._under_fresh(directory):
                self._relist(directory)
        self.stats.update(self.read.stats)
        kept, left_out = self._settle_links()
        self._rebuild()
        return self._result(kept, left_out)

    def _to_read(self) -> set[str]:
        """The directories read again: the watcher's, the parents of the ones it says were
        made or moved in, and those of racily clean entries and of hard-linked files."""
        answer = self.answer
        wanted = set(answer.dirs) | set(answer.trees)
        wanted.update(_parent(t) for t in answer.trees if t)
        written = self.index.written_ns
        wanted.update(_parent(p) for p, row in self.index.files.items() if row[1] >= written)
        wanted.update(_parent(p) for p in self.state.linked)
        return wanted

    def _under_fresh(self, path: str) -> bool:
        while True:
            if path in self.fresh:
                return True
            if not path:
                return False
            path = _parent(path)

    def _old(self, directory: str) -> dict[str, Entry]:
        return {e.name: e for e in decode_dir(self.blobs[self.paths[directory]], directory)}

    def _relist(self, directory: str) -> None:
        """List `directory` and `lstat` its entries again; a directory that is new there, or
        that the watcher says was made or moved in, is read whole."""
        old = self._old(directory)
        for name, entry in old.items():
            if entry.type == "file":
                self.stats.pop(_join(directory, name), None)
            elif entry.type == "symlink":
                self.links.pop(_join(directory, name), None)
        for path in [p for p in self.left_out if _parent(p) == directory]:
            del self.left_out[path]
        keep = {
            _join(directory, n)
            for n, e in old.items()
            if e.type == "dir" and _join(directory, n) not in self.answer.trees
        }
        found: dict[str, tuple[str, os.stat_result | str]] = {}
        try:
            _collect(self.workdir, directory, self.spec, found, self.warn, _depth(directory), keep)
        except WorkdirError as exc:
            raise Fallback(str(exc)) from exc
        for name, entry in old.items():
            path = _join(directory, name)
            if entry.type == "dir" and (path not in keep or found.get(path, ("",))[0] != "dir"):
                self._drop(path)
        self.kids[directory] = {}
        for path, (kind, _info) in found.items():
            if kind == "dir" and path not in keep:
                self.fresh.add(path)
                self.kids[path] = {}
        targets = {p: str(v[1]) for p, v in found.items() if v[0] == "symlink"}
        self.links.update(targets)
        rest = {p: v for p, v in found.items() if v[0] != "symlink"}
        read_found(self.workdir, rest, self.read, self.index, self.max_blob_bytes)
        for path in rest:
            self.kids[_parent(path)][path.rpartition("/")[2]] = self.read.entries[path]

    def _drop(self, top: str) -> None:
        """Forget what the last tree had under `top` (gone, or read whole again)."""
        prefix = f"{top}/"
        for path in [p for p in self.paths if p == top or p.startswith(prefix)]:
            for entry in decode_dir(self.blobs[self.paths[path]], path):
                if entry.type == "file":
                    self.stats.pop(_join(path, entry.name), None)
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
            self.warn(f"{path}: symlink to {target!r} leaves the workdir; left out")
        before = self.state.links
        for path in [*kept, *left_out]:
            directory, _, name = path.rpartition("/")
            if directory not in self.kids:
                if before.get(path) == kept.get(path):
                    continue  # as the last tree has it
                self.kids[directory] = self._old(directory)
            if path in kept:
                self.kids[directory][name] = Entry(name=name, type="symlink", target=kept[path])
            else:
                self.kids[directory].pop(name, None)
        return kept, left_out

    def _rebuild(self) -> None:
        """The blobs of the directories read again and of every one above them."""
        for directory in list(self.kids):
            above = directory
            while above:
                above = _parent(above)
                if above not in self.kids:
                    self.kids[above] = self._old(above)
        for directory in sorted(self.kids, key=_depth, reverse=True):
            own = [self._with_digest(directory, e) for e in self.kids[directory].values()]
            data = encode_dir(own)
            name = blob_name(data)
            self.blobs[name] = data
            self.paths[directory] = name

    def _with_digest(self, directory: str, entry: Entry) -> Entry:
        if entry.type != "dir":
            return entry
        digest = self.paths[_join(directory, entry.name)]
        return Entry(name=entry.name, type="dir", mode=entry.mode, digest=digest)

    def _result(self, kept: dict[str, str], left_out: dict[str, str]) -> Scan:
        sources, files, size = _sources(self.stats.items(), self.max_blob_bytes)
        sources.update(self.read.sources)
        return Scan(
            tree=self.paths[""],
            entries=self.read.entries,
            dirs={name: self.blobs[name] for name in self.paths.values()},
            sources=sources,
            stats=self.stats,
            files=files,
            bytes=size,
            hashed=self.read.hashed,
            paths=self.paths,
            links=kept,
            left_out=left_out,
            linked=self.read.linked,
        )


def _sources(
    rows: Iterable[tuple[str, Stat]], max_blob_bytes: int
) -> tuple[dict[str, tuple[str, int, int]], int, int]:
    """Where each blob of the stat cache can be read, the files and their bytes."""
    sources: dict[str, tuple[str, int, int]] = {}
    files = total = 0
    for path, row in rows:
        size, content = row[0], row[4]
        files += 1
        total += size
        if content.__class__ is str and size <= max_blob_bytes:
            if content not in sources:
                sources[content] = (path, 0, size)
            continue
        chunks = tuple(content) if isinstance(content, list) else content
        if not content_ok(chunks, size, max_blob_bytes):
            raise Fallback("the store's blob limit changed since the last snapshot")
        for blob, (offset, length) in zip(chunks, chunking(size, max_blob_bytes), strict=True):
            sources.setdefault(blob, (path, offset, length))
    return sources, files, total
