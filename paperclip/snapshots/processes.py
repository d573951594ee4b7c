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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, BinaryIO

from paperclip.snapshots.materialize import Materializer, MaterializeReport
from paperclip.snapshots.trees import Entry

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
    """One child's part: top-level directories `names` of `destination`, the target's and the
    previous tree's entries below them, and the file of each blob they write."""

    destination: str
    names: list[str]
    children: dict[str, dict[str, Entry]]
    previous: dict[str, Entry] | None
    files: dict[str, str]
    durable: bool
    parent: int = field(default_factory=os.getpid)


def _write_in_processes(work: Materializer, destination: str, processes: Processes) -> set[str]:
    """Write the top-level directories that hold changes in `processes.count` children,
    spawned fresh (never forked from a process holding database connections and threads),
    while this process calls `work.check()` as it would between files; a check that raises
    kills the children first. The names the children wrote; none when a child failed (this
    process then writes everything, finishing whatever the children left part way)."""
    shares = _shares(work, destination, processes)
    if len(shares) < 2:
        return set()
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
            child = context.Process(target=_child_main, args=(inbox, send), daemon=True)
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


def _shares(work: Materializer, destination: str, processes: Processes) -> list[_Share]:
    """The top-level directories with files to write, dealt to the children by size, largest
    first; none when the change is smaller than `processes.min_files` files."""
    units = [
        unit
        for name, entry in work.children.get("", {}).items()
        if entry.type == "dir" and not _same(work.previous, name, entry)
        if (unit := _unit(work, name, processes.blob_file)) is not None
    ]
    if sum(count for count, _, _ in units) < processes.min_files:
        return []
    shares = [
        _Share(destination, [], {"": {}}, None if work.previous is None else {}, {}, work.durable)
        for _ in range(min(processes.count, len(units)))
    ]
    loads = [0] * len(shares)
    for count, name, files in sorted(units, reverse=True):
        least = loads.index(min(loads))
        loads[least] += count
        share = shares[least]
        share.names.append(name)
        share.children[""][name] = work.children[""][name]
        share.files.update(files)
        for path in _subtree(work.children, name):
            share.children[path] = work.children.get(path, {})
    if work.previous is not None:
        owner = {name: share for share in shares for name in share.names}
        for path, entry in work.previous.items():
            found = owner.get(path.partition("/")[0])
            if found is not None and found.previous is not None:
                found.previous[path] = entry
    return shares


def _unit(
    work: Materializer, name: str, blob_file: Callable[[str], str | None]
) -> tuple[int, str, dict[str, str]] | None:
    """The top-level directory `name` as a child's work: its count of files and the file of
    each blob they hold; None when it has no file or a blob that is not a plain file."""
    files: dict[str, str] = {}
    count = 0
    for path in _subtree(work.children, name):
        for entry in work.children.get(path, {}).values():
            if entry.type != "file":
                continue
            count += 1
            for blob in entry.blobs():
                found = blob_file(blob)
                if found is None:
                    return None  # written by the caller, which can read any blob
                files[blob] = found
    return (count, name, files) if count else None


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
            _join(path, name) for name, e in children.get(path, {}).items() if e.type == "dir"
        )
    return found


def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


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
        share.parent,
    )


def _unpacked(packed: tuple[Any, ...]) -> _Share:
    destination, names, children, previous, files, durable, parent = packed
    return _Share(
        destination=destination,
        names=names,
        children={path: {r[0]: Entry(*r) for r in rows} for path, rows in children.items()},
        previous=None if previous is None else {p: Entry(*r) for p, r in previous.items()},
        files=files,
        durable=durable,
        parent=parent,
    )


def _child_main(inbox: Connection, send: Connection) -> None:
    """A child: read its share, write it, answer ("ok", counts and notes) or ("error", why)."""
    _die_with_parent()
    try:
        with inbox:
            share = _unpacked(inbox.recv())
        answer: tuple[str, Any] = ("ok", _write_share(share))
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


def _write_share(share: _Share) -> tuple[MaterializeReport, set[str], set[str]]:
    def check() -> None:
        if os.getppid() != share.parent:
            raise SystemExit("the materializing process is gone")

    def open_blob(name: str) -> BinaryIO:
        return io.FileIO(os.open(share.files[name], os.O_RDONLY | os.O_CLOEXEC), "rb")

    root = os.open(share.destination, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        work = Materializer(share.children, share.previous, open_blob, check, 0.2, share.durable)
        for name in share.names:
            work.dir_entry(root, name, name, share.children[""][name], _lstat(name, root))
    finally:
        os.close(root)
    return work.report(), work.extras, work.on_the_way
