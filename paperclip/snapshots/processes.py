"""Materialization of a large change in several processes (docs/snapshots.md#materialization):
the top-level directories that hold changes are dealt to child processes by size, each a fresh
interpreter (spawned: never a fork of a worker holding database connections and threads) that
writes its directories exactly as the calling process would, with the same temporary siblings
and renames; the caller waits, checks its lock between, then writes the rest itself and removes
what the target has not. Plain filesystem code, no database: the children open the blob files
the caller names (the filesystem backend's)."""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, BinaryIO

from paperclip.snapshots.dirfd import lstat_at, open_below
from paperclip.snapshots.materialize import Materializer, MaterializeReport
from paperclip.snapshots.trees import Entry, join_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Processes:
    """Writing a large change in child processes: `count` of them (2 or more) when at least
    `min_files` files are to be written; `blob_file(name)` is the path of a blob's plain file
    (None: not one, its directory is written by the calling process)."""

    count: int
    blob_file: Callable[[str], str | None]
    min_files: int = 4000

    def __call__(self, work: Materializer, destination: str) -> set[str]:
        return _write_in_processes(work, destination, self)


@dataclass(slots=True)
class _Share:
    """One child's part: directories `names` (paths below `destination`), the target's
    entries at and below them, the previous tree's below them and the files both hold alike
    there (`materialize`'s `alike`), and the file of each blob they write."""

    destination: str
    names: list[str]
    children: dict[str, dict[str, Entry]]
    previous: dict[str, Entry] | None
    files: dict[str, str]
    durable: bool
    alike: dict[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict)


def _write_in_processes(work: Materializer, destination: str, processes: Processes) -> set[str]:
    """Write the directories that hold most of the change (`_shares`) in `processes.count`
    children, spawned fresh (never forked from a process holding database connections and
    threads), while this process calls `work.check()` as it would between files; a check that
    raises kills the children first. The paths the children wrote; none when a child failed
    (this process then writes everything, finishing whatever the children left part way)."""
    shares, expanded = _shares(work, destination, processes)
    if len(shares) < 2:
        return set()
    _make_directories(work, destination, expanded)
    context = multiprocessing.get_context("spawn")
    running: list[tuple[Any, Connection]] = []
    answers: dict[int, tuple[str, Any]] = {}
    try:
        inboxes = []
        for _ in shares:
            # The share goes through a pipe of its own once every child is started: passed as
            # an argument it would be written while `start()` waits, one child after the other.
            inbox, post = context.Pipe(duplex=False)
            receive, send = context.Pipe(duplex=False)
            child = context.Process(
                target=_child_main, args=(inbox, send, os.getpid()), daemon=True
            )
            child.start()
            send.close()
            inbox.close()
            running.append((child, receive))
            inboxes.append(post)
        for post, share in zip(inboxes, shares, strict=True):
            with post:
                post.send(_packed(share))
        waiting = {receive: index for index, (_, receive) in enumerate(running)}
        while waiting:
            for ready in multiprocessing.connection.wait(list(waiting), work.check_every):
                assert isinstance(ready, Connection)  # noqa: S101 - only connections wait here
                index = waiting.pop(ready)
                try:
                    answers[index] = ready.recv()
                except EOFError:  # died without answering (killed, out of memory)
                    answers[index] = ("error", f"exit code {running[index][0].exitcode}")
            work.check()
    finally:
        for child, receive in running:
            if child.is_alive():
                child.kill()
            child.join()
            receive.close()
    failed = [answer[1] for answer in answers.values() if answer[0] != "ok"]
    if failed:
        logger.warning("a materializing process failed (%s): writing here instead", failed[0])
        return set()
    for _, (_, result) in answers.items():
        work.add(result)
    return {name for share in shares for name in share.names}


def _shares(
    work: Materializer, destination: str, processes: Processes
) -> tuple[list[_Share], list[str]]:
    """The directories with files to write, dealt to the children by size, largest first,
    and the directories above them that this process makes first (`_make_directories`);
    none when the change is smaller than `processes.min_files` files."""
    files = _file_counts(work)
    if files.get("", 0) < processes.min_files:  # the whole change: not worth the children
        return [], []
    units, expanded = _split(work, files, processes.count)
    if sum(files[path] for path in units) < processes.min_files:
        return [], []
    found = [
        (files[path], path, blobs)
        for path in units
        if (blobs := _blob_files(work, path, processes.blob_file)) is not None
    ]
    shares = [
        _Share(destination, [], {}, None if work.previous is None else {}, {}, work.durable)
        for _ in range(min(processes.count, len(found)))
    ]
    loads = [0] * len(shares)
    for count, path, blobs in sorted(found, reverse=True):
        least = loads.index(min(loads))
        loads[least] += count
        share = shares[least]
        share.names.append(path)
        parent, _, name = path.rpartition("/")
        share.children.setdefault(parent, {})[name] = work.children[parent][name]
        share.files.update(blobs)
        for below in _subtree(work.children, path):
            share.children[below] = work.children.get(below, {})
            if below in work.alike:
                share.alike[below] = work.alike[below]
    if work.previous is not None:
        _deal_previous(work.previous, shares)
    return shares, expanded


def _file_counts(work: Materializer) -> dict[str, int]:
    """The files to write at and below each directory of the target that needs work: a file
    or a directory the previous tree held alike is not counted (its file is only compared
    with the disk; that directory is not entered)."""
    counts: dict[str, int] = {}
    previous = work.previous
    for path in sorted(work.children, key=lambda p: p.count("/") + bool(p), reverse=True):
        total = 0
        for name, entry in work.children[path].items():
            where = join_path(path, name)
            if entry.type == "file":
                total += previous is None or not entry.same_as(previous.get(where))
            elif entry.type == "dir" and not _same(work.previous, where, entry):
                total += counts.get(where, 0)
        counts[path] = total
    return counts


def _split(work: Materializer, files: Mapping[str, int], count: int) -> tuple[list[str], list[str]]:
    """Directories to deal out, at least four per child where the tree allows: from the
    top-level ones, the largest replaced by its subdirectories while it is larger than its
    share (its own files then stay with this process), and the directories so replaced."""

    def below(path: str) -> list[str]:
        return [
            where
            for name, entry in work.children.get(path, {}).items()
            if entry.type == "dir"
            and not _same(work.previous, where := join_path(path, name), entry)
            and files.get(where, 0)
        ]

    units = below("")
    expanded: list[str] = []
    limit = max(files.get("", 0) // (count * 4), 1)
    while units:
        largest = max(units, key=lambda path: files.get(path, 0))
        inner = below(largest)
        if files.get(largest, 0) <= limit or not inner:
            break
        units.remove(largest)
        units.extend(inner)
        expanded.append(largest)
    return units, expanded


def _blob_files(
    work: Materializer, top: str, blob_file: Callable[[str], str | None]
) -> dict[str, str] | None:
    """The file of each blob the files at and below `top` hold; None when one is not a plain
    file (that directory is then written by the calling process, which can read any blob)."""
    found: dict[str, str] = {}
    for path in _subtree(work.children, top):
        for entry in work.children.get(path, {}).values():
            if entry.type != "file":
                continue
            for blob in entry.blobs():
                where = blob_file(blob)
                if where is None:
                    return None
                found[blob] = where
    return found


def _deal_previous(previous: Mapping[str, Entry], shares: list[_Share]) -> None:
    """Give each child the previous tree's entries below its directories."""
    owner = {path: share for share in shares for path in share.names}
    for path, entry in previous.items():
        parts = path.split("/")
        for depth in range(1, len(parts)):
            share = owner.get("/".join(parts[:depth]))
            if share is not None and share.previous is not None:
                share.previous[path] = entry
                break


def _make_directories(work: Materializer, destination: str, paths: list[str]) -> None:
    """Make the directories above the children's (top down), for them to write inside."""
    root = os.open(destination, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path in sorted(paths, key=lambda p: p.count("/")):
            parent, _, name = path.rpartition("/")
            fd = open_below(root, parent)
            try:
                work.make_directory(fd, name, path)
            finally:
                os.close(fd)
    finally:
        os.close(root)


def _same(previous: Mapping[str, Entry] | None, path: str, entry: Entry) -> bool:
    before = previous.get(path) if previous is not None else None
    return before is not None and before.same_dir(entry)


def _subtree(children: Mapping[str, Mapping[str, Entry]], top: str) -> list[str]:
    """The directory `top` and every directory below it in the target."""
    found, stack = [], [top]
    while stack:
        path = stack.pop()
        found.append(path)
        stack.extend(
            join_path(path, name) for name, e in children.get(path, {}).items() if e.type == "dir"
        )
    return found


type _Row = tuple[str, str, int, int, str | None, tuple[str, ...] | None, str]


def _row(entry: Entry) -> _Row:
    """An entry as the plain tuple sent to a child (a fifth of pickling the dataclass)."""
    return (
        entry.name,
        entry.type,
        entry.mode,
        entry.size,
        entry.digest,
        entry.chunks,
        entry.target,
    )


def _packed(share: _Share) -> tuple[Any, ...]:
    children = {path: [_row(e) for e in found.values()] for path, found in share.children.items()}
    previous = None
    if share.previous is not None:
        previous = {path: _row(e) for path, e in share.previous.items()}
    return (
        share.destination,
        share.names,
        children,
        previous,
        share.files,
        share.durable,
        share.alike,
    )


def _unpacked(packed: tuple[Any, ...]) -> _Share:
    destination, names, children, previous, files, durable, alike = packed
    return _Share(
        destination=destination,
        names=names,
        children={path: {r[0]: Entry(*r) for r in rows} for path, rows in children.items()},
        previous=None if previous is None else {p: Entry(*r) for p, r in previous.items()},
        files=files,
        durable=durable,
        alike=alike,
    )


def _child_main(inbox: Connection, send: Connection, parent: int) -> None:
    """A child: read its share, write it, answer ("ok", counts and notes) or ("error", why).
    Ends at once when `parent` died before the child could ask to die with it."""
    _die_with_parent()
    if os.getppid() != parent:
        return
    try:
        with inbox:
            share = _unpacked(inbox.recv())
        answer: tuple[str, Any] = ("ok", _write_share(share, parent))
    except BaseException as exc:  # every failure is answered, never raised
        answer = ("error", f"{type(exc).__name__}: {exc}")
    send.send(answer)
    send.close()


def _die_with_parent() -> None:
    """Be killed when the process that started this one dies (Linux's PR_SET_PDEATHSIG): a
    materializer killed part way must not leave a child writing behind the next one."""
    # Not Linux: the check between files (is the parent still this one?) still stops it.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _write_share(share: _Share, parent: int) -> tuple[MaterializeReport, set[str], set[str]]:
    def check() -> None:
        if os.getppid() != parent:
            raise SystemExit("the materializing process is gone")

    def open_blob(name: str) -> BinaryIO:
        if name not in share.files:  # a file held alike, changed on disk: the caller writes it
            raise LookupError(f"blob {name} was not given to this process")
        return io.FileIO(os.open(share.files[name], os.O_RDONLY | os.O_CLOEXEC), "rb")

    root = os.open(share.destination, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        work = Materializer(
            share.children, share.previous, open_blob, check, 0.2, share.durable, share.alike
        )
        for path in share.names:
            above, _, name = path.rpartition("/")
            fd = open_below(root, above)
            try:
                work.dir_entry(fd, name, path, share.children[above][name], lstat_at(name, fd))
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return work.report(), work.extras, work.on_the_way
