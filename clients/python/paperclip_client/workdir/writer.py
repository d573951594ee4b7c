"""What checkout does to the workdir, path by path: read what is there now, write files
(through a temporary sibling and a rename, copied from a local file holding the content or
fetched, small blobs ahead of time), symlinks and directories, remove entries; never
through a symlink (directories opened one component at a time with O_NOFOLLOW).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import uuid
from collections.abc import Container, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO

from paperclip_client.trees import Entry
from paperclip_client.workdir.errors import WorkdirError
from paperclip_client.workdir.index import Index, Stat
from paperclip_client.workdir.scanning import (
    PIECE,
    chunking,
    content_ok,
    file_entry,
    hash_fd,
)
from paperclip_client.workdir.transfer import (
    Limits,
    Progress,
    Say,
    Store,
)

TMP_PREFIX = ".paperclip-tmp-"
TEMP_NAME = re.compile(re.escape(TMP_PREFIX) + "[0-9a-f]{32}")  # what `temp_name` makes
# The permission bits a checkout gives what it writes: never setuid, setgid or sticky, which a
# tree (another agent's, through the head) may carry and the CLI, often root, would honour.
WRITE_MODE_BITS = 0o777


class DirFds:
    """Directories of the workdir opened one component at a time with O_NOFOLLOW: a symlink
    in the workdir is never followed (opening through one fails)."""

    FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW

    def __init__(self, root: Path) -> None:
        self.root = os.open(root, self.FLAGS)
        self.fds: dict[str, int] = {"": self.root}

    def open(self, rel: str) -> int:
        fd = self.fds.get(rel)
        if fd is not None:
            return fd
        parent, _, name = rel.rpartition("/")
        parent_fd = self.open(parent)
        if len(self.fds) > 256:
            self.forget("")
            parent_fd = self.open(parent)
        fd = os.open(name, self.FLAGS, dir_fd=parent_fd)
        self.fds[rel] = fd
        return fd

    def try_open(self, rel: str) -> int | None:
        try:
            return self.open(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return None
            raise

    def forget(self, rel: str) -> None:
        """Close what is open at or under `rel` (all but the root for "")."""
        for key in [k for k in self.fds if k and (not rel or k == rel or k.startswith(rel + "/"))]:
            os.close(self.fds.pop(key))

    def close(self) -> None:
        self.forget("")
        os.close(self.root)


SPECIAL = Entry(name="", type="symlink", target="\0")  # a fifo, socket or device


# A batch read of the blobs checkout writes next: small enough that a few are in flight at
# once and the first file is written early, large enough that a request carries many files.
BATCH_NAMES = 256
BATCH_BYTES = 2 * 1024 * 1024


def batches(wanted: Sequence[tuple[str, int]]) -> Iterator[list[str]]:
    """`wanted` (name, size) cut, in order, into batch reads of at most BATCH_NAMES names and
    BATCH_BYTES bytes (a blob bigger than that alone in its batch)."""
    batch: list[str] = []
    held = 0
    for name, size in wanted:
        if batch and (len(batch) >= BATCH_NAMES or held + size > BATCH_BYTES):
            yield batch
            batch, held = [], 0
        batch.append(name)
        held += size
    if batch:
        yield batch


class Prefetch:
    """Small blobs fetched ahead in batch reads, in the order checkout will write them (`take`
    them in that order): up to `threads` batches in flight, at most `2 * threads` held.

    A batch that fails for any reason is dropped, and `take` answers None for its blobs: the
    writer then fetches each alone, whose single read names precisely what is wrong (a blob
    gone, damaged, a store unavailable) and which any server answers."""

    def __init__(self, store: Store, wanted: Sequence[tuple[str, int]], threads: int) -> None:
        self.store = store
        self.batches = batches(wanted)
        self.ahead = 2 * max(threads, 1)
        self.where: dict[str, Future[dict[str, bytes]]] = {}
        self.untaken: dict[Future[dict[str, bytes]], int] = {}
        self.pool = (
            ThreadPoolExecutor(max(threads, 1), thread_name_prefix="paperclip-fetch")
            if wanted
            else None
        )
        self._fill()

    def _fill(self) -> None:
        if self.pool is None:
            return
        while len(self.untaken) < self.ahead:
            batch = next(self.batches, None)
            if batch is None:
                return
            future = self.pool.submit(self.store.get_batch, batch)
            self.untaken[future] = len(batch)
            self.where.update(dict.fromkeys(batch, future))

    def take(self, name: str) -> bytes | None:
        """The blob's bytes if a batch brought them (checked by the store), else None."""
        future = self.where.pop(name, None)
        if future is None:
            return None
        self.untaken[future] -= 1
        if not self.untaken[future]:
            del self.untaken[future]
            self._fill()
        try:
            return future.result().get(name)
        except Exception:
            return None

    def close(self) -> None:
        for future in self.untaken:
            future.cancel()
        self.untaken.clear()
        self.where.clear()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


class CheckoutWriter:
    def __init__(
        self,
        store: Store,
        workdir: Path,
        index: Index | None,
        limits: Limits,
        say: Say,
    ) -> None:
        self.store = store
        self.workdir = workdir
        self.index = index
        self.limits = limits
        self.say = say
        self.dirs = DirFds(workdir)
        self.stats: dict[str, Stat] = {}
        self.local: dict[str | tuple[str, ...], str] = {}  # content -> a workdir path holding it
        self.fetched = 0
        self.written = 0
        self.progress: Progress | None = None
        self.prefetch: Prefetch | None = None

    # what is there now -------------------------------------------------------------------

    def current(self, path: str) -> Entry | None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.try_open(parent)
        if fd is None:
            return None
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISDIR(info.st_mode):
            return Entry(name=name, type="dir", mode=mode)
        if stat.S_ISLNK(info.st_mode):
            return Entry(name=name, type="symlink", target=os.readlink(name, dir_fd=fd))
        if not stat.S_ISREG(info.st_mode):
            return SPECIAL
        content = self.index.cached(path, info) if self.index is not None else None
        if not content_ok(content, info.st_size, self.limits.max_blob_bytes):
            file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
            try:
                content = hash_fd(file_fd, info.st_size, self.limits.max_blob_bytes)
            finally:
                os.close(file_fd)
        assert content is not None  # noqa: S101 - hashed above when the cache had none
        self.local.setdefault(content, path)
        self.stats[path] = [
            info.st_size,
            info.st_mtime_ns,
            mode,
            info.st_ino,
            list(content) if isinstance(content, tuple) else content,
            info.st_ctime_ns,
        ]
        return file_entry(name, mode, info.st_size, content)

    def untracked_under(self, path: str, base: Container[str]) -> list[str]:
        """Paths under the workdir directory `path` that no tree the workdir held has (`base`:
        their paths)."""
        fd = self.dirs.try_open(path)
        if fd is None:
            return []
        found: list[str] = []
        with os.scandir(fd) as it:
            for item in it:
                where = f"{path}/{item.name}"
                if where not in base:
                    found.append(where)
                elif item.is_dir(follow_symlinks=False):
                    found.extend(self.untracked_under(where, base))
        return found

    # writing -----------------------------------------------------------------------------

    def remove(self, path: str, *, force: bool) -> None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.try_open(parent)
        if fd is None:
            return
        try:
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        self.written += 1
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=fd)
            return
        self.dirs.forget(path)
        if force:
            shutil.rmtree(name, dir_fd=fd)  # fd-based: never follows a symlink
            return
        with contextlib.suppress(OSError):  # not empty: untracked files stay, as in git
            os.rmdir(name, dir_fd=fd)

    def make_dir(self, path: str, mode: int) -> None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.open(parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=fd)
            self.written += 1
        os.chmod(self.dirs.open(path), mode & WRITE_MODE_BITS)

    def set_mode(self, path: str, mode: int) -> None:
        parent, _, name = path.rpartition("/")
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.dirs.open(parent)
        )
        try:
            os.fchmod(fd, mode & WRITE_MODE_BITS)
            info = os.fstat(fd)  # the change of mode moved its ctime
        finally:
            os.close(fd)
        self.written += 1
        row = self.stats[path]
        row[2] = mode
        row[5:] = [info.st_ctime_ns]

    def make_symlink(self, path: str, target: str) -> None:
        parent, _, name = path.rpartition("/")
        fd = self.dirs.open(parent)
        temp = temp_name()
        os.symlink(target, temp, dir_fd=fd)
        os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        self.written += 1

    def write_file(self, path: str, entry: Entry) -> None:
        parent, _, name = path.rpartition("/")
        # Its own descriptor of the directory: copying from another workdir file opens more
        # directories, and the cache closes its descriptors when it fills (the rename below
        # then met a closed, or reused, descriptor).
        fd = os.dup(self.dirs.open(parent))
        try:
            self._write_in(fd, path, name, entry)
        finally:
            os.close(fd)

    def _write_in(self, fd: int, path: str, name: str, entry: Entry) -> None:
        temp = temp_name()
        out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            with os.fdopen(out, "wb", closefd=False) as handle:
                ahead = (
                    self.prefetch.take(entry.digest)
                    if self.prefetch is not None and entry.digest is not None
                    else None
                )
                if ahead is not None:
                    handle.write(ahead)
                    self.fetched += len(ahead)
                    if self.progress is not None:
                        self.progress.add(len(ahead))
                elif not self._copy_local(entry, handle):
                    handle.seek(0)
                    handle.truncate()
                    for blob in entry.blobs():
                        got = self.store.get(blob, handle)
                        self.fetched += got
                        if self.progress is not None:
                            self.progress.add(got)
                if handle.tell() != entry.size:
                    raise WorkdirError(f"{path}: the store's blobs do not add up to its size")
            os.fchmod(out, entry.mode & WRITE_MODE_BITS)
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)
            raise
        try:
            os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
            info = os.fstat(out)  # after the rename, which moves the file's ctime
        finally:
            os.close(out)
        self.written += 1
        content = list(entry.chunks) if entry.chunks is not None else entry.digest
        mode = entry.mode & WRITE_MODE_BITS
        self.stats[path] = [
            info.st_size,
            info.st_mtime_ns,
            mode,
            info.st_ino,
            content,
            info.st_ctime_ns,
        ]
        key = entry.chunks if entry.chunks is not None else entry.digest
        if key is not None:
            self.local[key] = path

    def _copy_local(self, entry: Entry, handle: IO[bytes]) -> bool:
        """Copy the content from a workdir file known to hold it, checking it as it goes."""
        key = entry.chunks if entry.chunks is not None else entry.digest
        source = self.local.get(key) if key is not None else None
        if source is None:
            return False
        parent, _, name = source.rpartition("/")
        fd = self.dirs.try_open(parent)
        if fd is None:
            return False
        try:
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError:
            return False
        try:
            digests = []
            for _offset, length in chunking(entry.size, self.limits.max_blob_bytes):
                h = hashlib.sha256()
                left = length
                while left > 0:
                    piece = os.read(src, min(PIECE, left))
                    if not piece:
                        return False
                    h.update(piece)
                    handle.write(piece)
                    left -= len(piece)
                digests.append("sha256:" + h.hexdigest())
        finally:
            os.close(src)
        return digests == list(entry.blobs())

    def close(self) -> None:
        if self.prefetch is not None:
            self.prefetch.close()
        self.dirs.close()


def temp_name() -> str:
    return f"{TMP_PREFIX}{uuid.uuid4().hex}"
