"""Copy-back backends: copy a run's workspace directory to the execution workspace's host
directory (setting `PAPERCLIP_COPYBACK_BACKEND`).

The default, `LocalDirectoryCopyback`, copies a local tree into a staging sibling of the
destination and then swaps it in with two renames, so the destination is never a half-copied
mix. Symlinks are never followed: a link whose target stays inside the source tree is copied
as a link, any other link (absolute, escaping with `..`, or leading out through other links
once the copy is complete) is skipped and reported. Nothing outside the source is read even
when the source changes during the copy: the source is the resolved path the caller judged,
never resolved again; every directory and file is opened without following a final link, and
where the kernel says the opened object lies (/proc/self/fd) must be inside the source, else
it is skipped and reported (a directory along or below the source swapped for a link to
elsewhere after it was judged or listed; docs/security.md). Files and directories get their
source's permission bits and times, never a setuid, setgid or sticky bit. A crash
at any point leaves either the old destination or the new one plus named leftovers that the
next attempt for the same run cleans up; the source stays authoritative throughout.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol
from uuid import UUID, uuid4

from django.conf import settings
from django.utils.module_loading import import_string

# The ownership check runs at most this far apart (seconds of copying), and always once more
# between the copy and the publishing swap.
CHECK_INTERVAL_SECONDS = 0.2
# Files per task handed to the copy threads: enough to pay for the hand-over, few enough to
# keep every thread busy to the end.
_CHUNK = 64


@dataclass(frozen=True, slots=True)
class CopybackReport:
    files: int
    directories: int
    bytes: int
    symlinks: int
    skipped: tuple[str, ...] = field(default_factory=tuple)
    # Files of `files` taken unchanged from the previous destination (hard links), whose
    # `bytes` were not copied again.
    linked: int = 0


class CopybackBackend(Protocol):
    def copy_back(
        self, *, run_id: UUID, source: str, destination: str, check: Callable[[], None]
    ) -> CopybackReport:
        """Make `destination` a copy of `source` (a resolved path: no symbolic link along
        it; nothing outside it may be read, even when a directory along or below it is
        swapped for a link while the copy runs). Call `check()` regularly: it raises when
        ownership was lost, and the copy must stop without publishing anything."""


class CopybackError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _inside(root: Path, link_dir: str, target: str) -> bool:
    if os.path.isabs(target):
        return False
    resolved = os.path.normpath(os.path.join(link_dir, target))
    return resolved == str(root) or resolved.startswith(str(root) + os.sep)


def _shown(rel: str) -> str:
    """A path as text that any JSON holds: a name that is not UTF-8 (kept by Python as lone
    surrogates, which PostgreSQL's JSON refuses: the commit recording the report failed, and
    the run could never commit) with its bytes escaped, `\\xff`."""
    return os.fsencode(rel).decode("utf-8", "backslashreplace")


def _below(path: str, top: str) -> bool:
    return path == top or path.startswith(top + "/")


_PROC_FD: Final = "/proc/self/fd"
_HAS_PROC_FD: Final = os.path.isdir(_PROC_FD)
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _opened_inside(fd: int, root: str | None) -> bool:
    """The object open as `fd` lies inside `root` (a resolved path), by the kernel's own path
    of it: a link swapped into the path after the walk listed it shows here. True when there is
    no root to check against or no /proc (not Linux: the check is skipped)."""
    if root is None or not _HAS_PROC_FD:
        return True
    where = os.readlink(f"{_PROC_FD}/{fd}")
    return where == root or where.startswith(root.rstrip("/") + "/")


def _permissions(mode: int) -> int:
    """The permission bits of `mode` alone: the worker copying may run as root and owns what
    it writes, so a setuid, setgid or sticky bit the agent set on its own file or directory is
    never copied (a setuid program of the agent's would become a setuid-root one)."""
    return stat.S_IMODE(mode) & 0o777


def _same_file_state(current: os.stat_result, previous: os.stat_result) -> bool:
    """The incremental rule (docs/recovery.md#incremental-copy-back): a regular file of the
    previous destination stands for the source's when size, modification time (ns) and mode
    all match; the quick check rsync makes by default, plus the mode (the mode a copy gets,
    `_permissions`, and the previous file's must be exactly that)."""
    return (
        stat.S_ISREG(previous.st_mode)
        and previous.st_size == current.st_size
        and previous.st_mtime_ns == current.st_mtime_ns
        and stat.S_IMODE(previous.st_mode) == _permissions(current.st_mode)
    )


def default_threads() -> int:
    """Copy threads when none are configured: the machine's CPUs, at most 8."""
    return min(8, os.cpu_count() or 2)


def _copy_file(source: str, target: str, state: os.stat_result, root: str | None = None) -> int:
    """Copy one regular file's bytes, permission bits (`_permissions`) and times; returns the
    bytes copied. O_NOFOLLOW on both ends: an entry swapped for a symlink since it was listed
    is refused (ELOOP), never followed, and O_EXCL never writes through anything already at
    the target; a file reached through a directory swapped for a link (outside `root`) is
    refused the same way before a byte of it is read. Opened without blocking: a file swapped
    for a FIFO since it was listed would otherwise block the worker until someone wrote to
    it; it is refused (ELOOP, skipped) as anything no longer a regular file is."""
    fd_in = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not _opened_inside(fd_in, root):
            raise OSError(errno.ELOOP, "outside the source directory", source)
        if not stat.S_ISREG(os.fstat(fd_in).st_mode):
            raise OSError(errno.ELOOP, "no longer a regular file", source)
        os.set_blocking(fd_in, True)
        fd_out = os.open(
            target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        try:
            copied = 0
            try:
                while chunk := os.copy_file_range(fd_in, fd_out, 1 << 30):
                    copied += chunk
            except OSError as exc:  # not supported between these files: copy through memory
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                os.lseek(fd_in, copied, os.SEEK_SET)
                os.lseek(fd_out, copied, os.SEEK_SET)
                while block := os.read(fd_in, 1 << 20):
                    os.write(fd_out, block)
                    copied += len(block)
            os.fchmod(fd_out, _permissions(state.st_mode))
            os.utime(fd_out, ns=(state.st_atime_ns, state.st_mtime_ns))
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)
    return copied


type _Item = tuple[str, str, str, str | None]  # source, target, relative path, previous


@dataclass(slots=True)
class _Done:
    files: int = 0
    bytes: int = 0
    linked: int = 0
    skipped: list[str] = field(default_factory=list)


def _link_unchanged(previous: str, target: str, state: os.stat_result) -> bool:
    """Hard-link the previous destination's file into the staging tree when it stands for the
    source's (_same_file_state); False when it does not, is gone, or cannot be linked here
    (EXDEV, EPERM, EMLINK): then the file is copied."""
    try:
        if not _same_file_state(state, os.lstat(previous)):
            return False
        os.link(previous, target, follow_symlinks=False)
    except OSError:
        return False
    return True


def _copy_chunk(chunk: list[_Item], root: str | None = None) -> _Done:
    """Link or copy a chunk of files (in a copy thread); `root`: the source's resolved path,
    which every file opened must lie in."""
    done = _Done()
    for source, target, rel, previous in chunk:
        state = os.lstat(source)
        if not stat.S_ISREG(state.st_mode):  # changed since it was listed: skipped, as listed
            done.skipped.append(rel)
            continue
        if previous is not None and _link_unchanged(previous, target, state):
            done.files += 1
            done.linked += 1
            done.bytes += state.st_size
            continue
        try:
            done.bytes += _copy_file(source, target, state, root)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            done.skipped.append(rel)  # became a symlink after it was listed
            continue
        done.files += 1
    return done


class LocalDirectoryCopyback:
    """Copy a local directory tree; see the module docstring for the safety rules.

    Speed (docs/recovery.md#copy-back-speed): one scandir per directory, a few system calls per
    file (open, copy_file_range, fchmod, futimens, close), the file copies spread over
    `threads` threads while the walk goes on, the ownership check every
    CHECK_INTERVAL_SECONDS rather than every N entries, and, with `incremental`, unchanged
    files hard-linked from the previous destination instead of copied."""

    def __init__(self, *, threads: int | None = None, incremental: bool | None = None) -> None:
        # Settings are read only for what the caller leaves out (the bench runs without them).
        self.threads = threads or settings.PAPERCLIP_COPYBACK_THREADS or default_threads()
        self.incremental = (
            settings.PAPERCLIP_COPYBACK_INCREMENTAL if incremental is None else incremental
        )

    def copy_back(
        self, *, run_id: UUID, source: str, destination: str, check: Callable[[], None]
    ) -> CopybackReport:
        src = Path(source)
        dest = Path(destination)
        if not src.is_absolute() or not dest.is_absolute():
            raise CopybackError("copyback_path_not_absolute", "Both paths must be absolute.")
        src = Path(os.path.normpath(src))
        dest = Path(os.path.normpath(dest))
        if src.is_symlink() or not src.is_dir():
            raise CopybackError("copyback_source_missing", f"{src} is not a directory.")
        if os.path.realpath(src) != str(src):
            # The caller judged this very path (resolved): a link along it now means a
            # directory was swapped for one since, and the copy would read elsewhere.
            raise CopybackError(
                "copyback_source_missing",
                f"{src} is no longer the directory it was: a symbolic link now lies in its path.",
            )
        if dest == src or str(dest).startswith(str(src) + os.sep):
            raise CopybackError("copyback_destination_inside_source", "Refusing to nest.")
        if str(src).startswith(str(dest) + os.sep):
            # Swapping the destination out would take the source with it, then delete it.
            raise CopybackError(
                "copyback_source_inside_destination",
                f"{src} lies inside {dest}: refusing to replace the directory holding it.",
            )
        if dest.is_symlink():
            raise CopybackError("copyback_destination_symlink", f"{dest} is a symlink.")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = dest.parent / f".{dest.name}.copyback-{run_id}.staging"
        backup = dest.parent / f".{dest.name}.copyback-{run_id}.previous"
        # Leftovers of an earlier attempt of this run: the source is still authoritative.
        if staging.exists():
            shutil.rmtree(staging)
        if backup.exists() and dest.exists():
            shutil.rmtree(backup)
        for leftover in dest.parent.glob(f".{dest.name}.copyback-*.trash-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # of a process that died deleting it
        previous = dest if self.incremental and dest.is_dir() else None
        report = _TreeCopy(src, staging, previous, check, self.threads).run()
        check()
        if dest.exists():
            dest.rename(backup)
        staging.rename(dest)
        if backup.exists():
            # Garbage from here on: renamed out of the way at once, deleted beside the commit
            # rather than before it (a crash leaves it for the next copy-back here).
            trash = dest.parent / f".{dest.name}.copyback-{run_id}.trash-{uuid4().hex[:8]}"
            backup.rename(trash)
            _discard_in_background(trash)
        return report


class _TreeCopy:
    """One copy of `src` into a new `staging` directory (private, 0700, until it is complete:
    then every directory gets its source's permission bits and times, deepest first, as
    `cp -a` leaves them, setuid, setgid and sticky bits dropped)."""

    def __init__(
        self,
        src: Path,
        staging: Path,
        previous: Path | None,
        check: Callable[[], None],
        threads: int,
    ) -> None:
        self.src = src
        self.staging = staging
        self.previous = previous
        self.check = check
        self.threads = max(1, threads)
        self.checked_at = time.monotonic()
        # Where the source is (resolved by the caller, who judged it; never resolved again
        # here, where a link swapped in along it since would move it): every directory and
        # file opened must lie inside it, by the kernel's own path of what was opened.
        self.root = str(src)
        self.files = self.size = self.links = self.linked = 0
        self.directories = -1  # the root is not counted
        self.skipped: list[str] = []
        self.dir_states: list[tuple[str, os.stat_result]] = []
        self.copied_links: list[tuple[str, str]] = []  # (path in staging, relative path)

    def _check_due(self) -> None:
        now = time.monotonic()
        if now - self.checked_at >= CHECK_INTERVAL_SECONDS:
            self.check()
            self.checked_at = time.monotonic()

    def run(self) -> CopybackReport:
        self.check()
        with ThreadPoolExecutor(self.threads, thread_name_prefix="copyback") as pool:
            pending: set[Future[_Done]] = set()
            try:
                self._walk(pool, pending)
                while pending:
                    self._collect(pending)
            except BaseException:
                for future in pending:
                    future.cancel()
                raise
        self._drop_escaping_links()
        for path, state in reversed(self.dir_states):
            os.chmod(path, _permissions(state.st_mode))
            os.utime(path, ns=(state.st_atime_ns, state.st_mtime_ns))
        return CopybackReport(
            self.files,
            self.directories,
            self.size,
            self.links,
            tuple(sorted(_shown(rel) for rel in self.skipped)),
            self.linked,
        )

    def _drop_escaping_links(self) -> None:
        """Remove, and report as skipped, every copied link that leads out of the copy once
        the other links are followed: each was judged alone by its text (`l1 -> .` and
        `l2 -> l1/..` both stay inside by their text; `l2` names the parent). The copy is the
        worker's own, complete and private (0700) here, so resolving in it judges exactly the
        links the destination will hold."""
        top = os.path.realpath(self.staging)
        escaping = [
            (path, rel)
            for path, rel in self.copied_links
            if not _below(os.path.realpath(path), top)  # every link still in place
        ]
        for path, rel in escaping:
            os.unlink(path)
            self.links -= 1
            self.skipped.append(rel)

    def _collect(self, pending: set[Future[_Done]]) -> None:
        """Take in the chunks done within CHECK_INTERVAL_SECONDS, then check if it is due."""
        done, _ = wait(pending, timeout=CHECK_INTERVAL_SECONDS, return_when=FIRST_COMPLETED)
        for future in done:
            pending.discard(future)
            done_chunk = future.result()
            self.files += done_chunk.files
            self.size += done_chunk.bytes
            self.linked += done_chunk.linked
            self.skipped.extend(done_chunk.skipped)
        self._check_due()

    def _walk(self, pool: ThreadPoolExecutor, pending: set[Future[_Done]]) -> None:
        limit = self.threads * 4  # chunks in flight: bounded memory whatever the tree
        chunk: list[_Item] = []
        stack: list[tuple[str, str, str | None, str]] = [
            (str(self.src), str(self.staging), str(self.previous) if self.previous else None, "")
        ]
        os.mkdir(self.staging, 0o700)
        self.dir_states.append((str(self.staging), os.lstat(self.src)))
        while stack:
            here, target_dir, previous_dir, rel_dir = stack.pop()
            listed = self._list(here, rel_dir)
            if listed is None:
                continue
            dir_fd, entries = listed
            try:
                for entry in entries:
                    name = entry.name
                    rel = f"{rel_dir}{name}"
                    target = f"{target_dir}/{name}"
                    path = f"{here}/{name}"
                    # The entry's type from the directory listing (no stat); a regular file is
                    # stat-ed by the copy thread that takes it.
                    if entry.is_file(follow_symlinks=False):
                        previous = None if previous_dir is None else f"{previous_dir}/{name}"
                        chunk.append((path, target, rel, previous))
                        if len(chunk) >= _CHUNK:
                            pending.add(pool.submit(_copy_chunk, chunk, self.root))
                            chunk = []
                            while len(pending) >= limit:
                                self._collect(pending)
                        continue
                    state = entry.stat(follow_symlinks=False)
                    mode = state.st_mode
                    if stat.S_ISLNK(mode):
                        link = os.readlink(name, dir_fd=dir_fd)
                        if _inside(self.src, here, link):
                            os.symlink(link, target)
                            os.utime(
                                target,
                                ns=(state.st_atime_ns, state.st_mtime_ns),
                                follow_symlinks=False,
                            )
                            self.links += 1
                            self.copied_links.append((target, rel))
                        else:
                            self.skipped.append(rel)
                    elif stat.S_ISDIR(mode):
                        os.mkdir(target, 0o700)
                        self.dir_states.append((target, state))
                        previous = self._previous_dir(previous_dir, name)
                        stack.append((path, target, previous, f"{rel}/"))
                    else:
                        self.skipped.append(rel)  # sockets, fifos, devices
            finally:
                os.close(dir_fd)
            self._check_due()
        if chunk:
            pending.add(pool.submit(_copy_chunk, chunk, self.root))

    def _list(self, here: str, rel_dir: str) -> tuple[int, list[os.DirEntry[str]]] | None:
        """Open and list one directory of the source (the descriptor stays open for reading
        its links); None, skipped and reported, when it is no longer a directory inside the
        source (swapped for a link since its parent was listed)."""
        try:
            dir_fd = os.open(here, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            dir_fd = -1
        if dir_fd < 0 or not _opened_inside(dir_fd, self.root):
            if dir_fd >= 0:
                os.close(dir_fd)
            if not rel_dir:  # the source itself: an empty copy must not replace the destination
                raise CopybackError(
                    "copyback_source_missing", f"{here} is no longer the directory it was."
                )
            self.skipped.append(rel_dir.rstrip("/"))
            return None
        self.directories += 1
        try:
            with os.scandir(dir_fd) as listing:
                return dir_fd, list(listing)
        except BaseException:
            os.close(dir_fd)
            raise

    @staticmethod
    def _previous_dir(previous_dir: str | None, name: str) -> str | None:
        if previous_dir is None:
            return None
        candidate = os.path.join(previous_dir, name)
        try:
            return candidate if stat.S_ISDIR(os.lstat(candidate).st_mode) else None
        except FileNotFoundError:
            return None


_discards: list[threading.Thread] = []
_discards_lock = threading.Lock()


def _discard_in_background(tree: Path) -> None:
    thread = threading.Thread(
        target=shutil.rmtree, args=(tree,), kwargs={"ignore_errors": True}, daemon=True
    )
    with _discards_lock:
        _discards[:] = [t for t in _discards if t.is_alive()]
        _discards.append(thread)
    thread.start()


def copyback_discards_wait(timeout: float = 30) -> None:
    """Wait until the replaced trees of earlier copy-backs are deleted (tests, benchmarks)."""
    with _discards_lock:
        pending = list(_discards)
    for thread in pending:
        thread.join(timeout)


@functools.cache
def _backend(path: str) -> CopybackBackend:
    backend: CopybackBackend = import_string(path)()
    return backend


def copyback_backend() -> CopybackBackend:
    return _backend(str(settings.PAPERCLIP_COPYBACK_BACKEND))
