"""Materialization: make a directory hold exactly a tree (docs/snapshots.md#materialization).

Plain filesystem code: no database. The caller passes the tree as `Walk.entries` maps (path →
Entry, directories included), a function that opens a blob, and a `check` that raises to stop.

- Only entries whose type, mode or content differ on disk are touched. With `previous` (the
  tree the destination last held) an entry equal in both trees is trusted when `lstat` still
  shows its type, size and mode; without it, a regular file of the right size is hashed. The
  regular files a changed directory holds alike in both trees may come apart (`alike`, as
  their blob's JSON objects): each costs one `lstat`, and is built, checked and written as
  any entry only when that differs.
- Every file is written to a temporary sibling `.<name>.pcl-tmp-<16 hex>` in its directory
  and renamed onto its path (a symlink likewise): no partly written file is ever at a path.
- Symlinks in the destination are never followed: directories are walked through file
  descriptors opened with `O_NOFOLLOW`, every create, rename and unlink is relative to one, and
  whatever is on disk where the tree wants something else (a symlink or file where it wants a
  directory, a directory where it wants a file) is removed, not descended into. A file with
  several hard links is replaced, never changed in place.
- New and changed entries are all written before any entry the target has not is deleted, so
  a failure part way (a full disk, an unreadable blob) never leaves the destination partly
  emptied: it holds every old entry, some of them already new (but an entry changing type,
  removed just before its new content is written, is missing after a failure between).
- A crash part way leaves a mix of old and new entries and at most stray temporary siblings;
  the next call with the same arguments finishes the tree and removes those siblings.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, BinaryIO, Final

from paperclip.snapshots.dirfd import (
    READ_FLAGS,
    is_temp_name,
    lstat_at,
    open_dir,
    temp_name,
)
from paperclip.snapshots.trees import (
    MAX_MODE,
    Entry,
    TreeInvalid,
    blob_name,
    check_symlinks,
    join_path,
    name_problem,
    names_problem,
)

CHUNK_BYTES: Final = 1 << 20
_EMPTY_BLOB: Final = blob_name(b"")
_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE: Final = stat.S_IFREG


@dataclass(frozen=True, slots=True)
class MaterializeReport:
    written: int  # files written (new or replaced), each through a temporary sibling
    bytes_written: int
    symlinks: int  # symlinks created or replaced
    directories: int  # directories created
    modes: int  # files and directories whose mode alone was changed, in place
    removed: int  # paths removed (each entry inside a removed directory counted)
    unchanged: int  # files, symlinks and directories left exactly as they were
    temporaries: int  # stray temporary siblings (of an interrupted attempt) removed


_COUNTS: Final = tuple(field.name for field in fields(MaterializeReport))


def _nothing() -> None:
    return None


def materialize(
    *,
    destination: str,
    target: Mapping[str, Entry],
    previous: Mapping[str, Entry] | None,
    open_blob: Callable[[str], BinaryIO],
    alike: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    check: Callable[[], None] = _nothing,
    check_every: float = 0.2,
    durable: bool = False,
    split: Callable[[Materializer, str], set[str]] | None = None,
) -> MaterializeReport:
    """Make `destination` (created if missing; its own mode is left alone) hold exactly
    `target`, touching only entries whose type, mode or content differ.

    `split(work, destination)`, when given, may write some directories first (in other
    processes: `paperclip.snapshots.processes`) and returns their paths; the rest is written
    here after, and what remains to remove is removed here last.

    `previous` is the tree the destination last held (None: unknown, compare with the disk).
    `alike` (only with `previous`), by a directory's path: regular files that both trees hold
    alike in that directory of the target, in neither map, as the JSON objects of their
    directory blob (`changes.decode_known_pair`: name, mode without bits above 0o777, size,
    digest or chunks), checked up front as the target is; each is left alone when `lstat`
    shows a regular file of its size and mode, else built and written as any entry.
    `open_blob(name)` returns a readable binary stream of a blob (closed here). `check()` is
    called before the first change and then at most every `check_every` seconds of work;
    whatever it raises stops the work and propagates. `durable` fsyncs every written file
    before its rename and every changed directory. Raises TreeInvalid, before touching
    anything, for a target that is not a tree (a bad name, an entry whose parent is not a
    directory, an escaping symlink), and TreeInvalid(path, "size_mismatch") when a file's
    blobs do not add up to its size (that file is left as it was)."""
    children = _children(target)
    alike = alike or {}
    if alike and previous is None:
        raise ValueError("files held alike by the previous tree need the previous tree")
    named = {path: _alike_names(target, children, path, raws) for path, raws in alike.items()}
    os.makedirs(destination, exist_ok=True)
    # The destination itself is the caller's configured path and may be a symlink; nothing
    # below it is followed.
    root = os.open(destination, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # One file at a time per process: threads were measured slower (2 cores; the GIL, and
        # creates and renames in one directory serialize on its lock in the kernel anyway).
        work = Materializer(children, previous, open_blob, check, check_every, durable, alike)
        work.named = named
        work.check()
        if split is not None:
            work.skip = split(work, destination)
        work.directory(root, "")
        # Only once every new and changed entry is in place: a failure before this point
        # leaves every old entry where it was (never a cwd partly emptied), but for one whose
        # type changes, removed just before its new content is written.
        work.remove_extras(root, "")
    finally:
        os.close(root)
    return work.report()


def _children(target: Mapping[str, Entry]) -> dict[str, dict[str, Entry]]:
    """The target's entries by parent path and name, after checking it is a tree. Each
    path's own name is checked, and its parent must be a directory of the target: so every
    component of every path is checked once, as the name of its own entry."""
    children: dict[str, dict[str, Entry]] = {}
    # The last parent found to be a directory, and its entries: a tree's paths come a
    # directory at a time, so most paths ask about the same parent as the one before.
    known: str | None = None
    siblings: dict[str, Entry] = {}
    for path, entry in target.items():
        if not isinstance(path, str):
            raise TreeInvalid(str(path), "bad_name")
        parent, _, name = path.rpartition("/")
        if name_problem(name) or (not parent and path != name):  # "/name" has an empty one
            raise TreeInvalid(path, "bad_name")
        if parent != known:
            if parent and (parent not in target or target[parent].type != "dir"):
                bad = any(name_problem(p) for p in parent.split("/"))
                raise TreeInvalid(path, "bad_name" if bad else "not_a_directory")
            known, siblings = parent, children.setdefault(parent, {})
        _check_entry(path, entry)
        siblings[name] = entry
    check_symlinks(target)
    return children


def _alike_names(
    target: Mapping[str, Entry],
    children: Mapping[str, Mapping[str, Entry]],
    path: str,
    alike: Sequence[Mapping[str, Any]],
) -> set[str]:
    """The names the directory at `path` is to hold, its target entries' and its files held
    alike, after checking those files (TreeInvalid before anything is touched): in a
    directory of the target, each a name, none twice, each a regular file's mode with no bit
    above 0o777 (the caller leaves such a file in the target, whose special bits are
    dropped) and a size."""
    if path and path not in children and (path not in target or target[path].type != "dir"):
        raise TreeInvalid(path, "not_a_directory")
    try:
        names = [raw["name"] for raw in alike]
        modes = [raw["mode"] for raw in alike]
        sizes = [raw["size"] for raw in alike]
    except (KeyError, TypeError):
        raise TreeInvalid(path, "bad_fields") from None
    if (problem := names_problem(names)) is not None:
        raise TreeInvalid(join_path(path, names[problem[0]]), problem[1])
    wanted = children.get(path, {})
    found = {*wanted, *names}
    if len(found) != len(wanted) + len(names):
        raise TreeInvalid(path, "duplicate_name")
    if names and (
        not {int}.issuperset(map(type, modes + sizes))  # a bool is not a mode
        or not 0 <= min(modes) <= max(modes) <= 0o777
        or min(sizes) < 0
    ):
        raise TreeInvalid(path, "bad_mode")
    return found


def _check_entry(path: str, entry: Entry) -> None:
    if entry.type == "symlink":
        if not entry.target or "\0" in entry.target or entry.target.startswith("/"):
            raise TreeInvalid(path, "bad_symlink")
        return
    if entry.type not in ("file", "dir"):
        raise TreeInvalid(path, "bad_type")
    if not 0 <= entry.mode <= MAX_MODE:
        raise TreeInvalid(path, "bad_mode")
    if entry.type == "file" and (entry.size < 0 or not entry.blobs()):
        raise TreeInvalid(path, "bad_digest")


def _copy(source: BinaryIO, out: int, limit: int, tick: Callable[[], None]) -> int:
    """Copy `source` to the descriptor `out`, stopping once more than `limit` bytes came:
    the bytes copied. A source that is a real file is copied in the kernel
    (`copy_file_range`), else piece by piece."""
    size = 0
    try:
        source_fd = source.fileno()
    except (OSError, AttributeError, io.UnsupportedOperation):
        source_fd = None
    if source_fd is not None:
        try:
            while done := os.copy_file_range(source_fd, out, max(limit - size, 0) + 1):
                size += done
                if size > limit:
                    return size
            return size
        except OSError as exc:
            if size or exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
    while data := source.read(CHUNK_BYTES):
        size += len(data)
        if size > limit:
            break
        _write_all(out, data)
        tick()
    return size


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unchanged_file(entry: Entry, before: Entry | None, found: os.stat_result) -> bool:
    """The common case of `Materializer.file_entry` with a previous tree, decided at once: a
    regular file of the entry's size and mode on disk, where the previous tree held a file of
    the same content (compared as `same_content` does, its blobs). False means only that
    `file_entry` decides."""
    return (
        before is not None
        and found.st_mode == stat.S_IFREG | entry.mode
        and found.st_size == entry.size
        and before.type == "file"
        and before.digest == entry.digest
        and before.chunks == entry.chunks
    )


class Materializer:
    def __init__(
        self,
        children: dict[str, dict[str, Entry]],
        previous: Mapping[str, Entry] | None,
        open_blob: Callable[[str], BinaryIO],
        check: Callable[[], None],
        check_every: float,
        durable: bool,
        alike: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    ) -> None:
        self.children = children
        self.previous = previous
        self.alike = alike or {}
        # The names a directory of `alike` is to hold (its target entries' and its files held
        # alike), and the files held alike built as entries when the disk differed.
        self.named: dict[str, set[str]] = {}
        self.built: dict[str, Entry] = {}
        self.open_blob = open_blob
        self._check = check
        self.check_every = check_every
        self.durable = durable
        self.last_check = 0.0
        self.written = self.bytes_written = self.symlinks = self.directories = 0
        self.modes = self.removed = self.unchanged = self.temporaries = 0
        # Directories holding entries the target has not (removed last), and their ancestors.
        self.extras: set[str] = set()
        self.on_the_way: set[str] = set()
        # Paths written by child processes (not entered here), and the directories made for
        # them beforehand (`make_directory`).
        self.skip: Collection[str] = ()
        self.made: set[str] = set()

    def report(self) -> MaterializeReport:
        return MaterializeReport(**{name: getattr(self, name) for name in _COUNTS})

    def add(self, done: tuple[MaterializeReport, set[str], set[str]]) -> None:
        """Count what a child process wrote, and note what it found to remove."""
        report, extras, on_the_way = done
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(report, name))
        self.extras |= extras
        self.on_the_way |= on_the_way

    def check(self) -> None:
        self.last_check = time.monotonic()
        self._check()

    def tick(self) -> None:
        if time.monotonic() - self.last_check >= self.check_every:
            self.check()

    def directory(self, fd: int, path: str) -> None:
        """Write the target entries of the open directory `fd` (at `path`) that differ (but
        the paths in `skip`, written already); note it for `remove_extras` when it also holds
        entries the target has not."""
        wanted = self.children.get(path, {})
        changed = False
        if not all(map(self.names_of(path).__contains__, os.listdir(fd))):
            self.extras.add(path)
            up = path
            while up:  # its ancestors, which `remove_extras` walks through
                up = up.rpartition("/")[0]
                self.on_the_way.add(up)
        prefix = f"{path}/" if path else ""
        if path in self.alike:
            changed |= self.alike_files(fd, prefix, self.alike[path])
        skip, previous = self.skip, self.previous
        for name in sorted(wanted):
            entry, where = wanted[name], prefix + name
            if where in skip:
                continue
            try:  # `lstat_at`, without its call
                found: os.stat_result | None = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                found = None
            kind = entry.type
            if (
                kind == "file"
                and previous is not None
                and found is not None
                and _unchanged_file(entry, previous.get(where), found)
            ):
                self.unchanged += 1  # what `file_entry` would find, without its layers
            elif kind == "dir":
                changed |= self.dir_entry(fd, name, where, entry, found)
            elif kind == "file":
                changed |= self.file_entry(fd, name, where, entry, found)
            else:
                changed |= self.symlink_entry(fd, name, entry, found)
        if changed and self.durable:
            os.fsync(fd)

    def names_of(self, path: str) -> Collection[str]:
        """The names the directory at `path` is to hold."""
        wanted = self.children.get(path, {})
        if path not in self.alike:
            return wanted
        if path not in self.named:
            self.named[path] = {*wanted, *(raw["name"] for raw in self.alike[path])}
        return self.named[path]

    def alike_files(self, fd: int, prefix: str, alike: Sequence[Mapping[str, Any]]) -> bool:
        """The files held alike in the open directory `fd`: one `lstat` each."""
        changed = False
        for raw in alike:
            name = raw["name"]
            try:
                found = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                found = None
            if (
                found is None
                or found.st_mode != _FILE | raw["mode"]
                or found.st_size != raw["size"]
            ):
                changed |= self.alike_entry(fd, prefix + name, raw, found)
            else:
                self.unchanged += 1
        return changed

    def alike_entry(
        self, fd: int, path: str, raw: Mapping[str, Any], found: os.stat_result | None
    ) -> bool:
        """A file held alike that is not on disk as its `lstat` should show: built as an entry
        (its name, mode and size checked up front with the others) and dealt with as any file."""
        chunks = raw.get("chunks")
        entry = Entry(
            name=raw["name"],
            type="file",
            mode=raw["mode"],
            size=raw["size"],
            digest=raw.get("digest"),
            chunks=tuple(chunks) if chunks is not None else None,
        )
        _check_entry(path, entry)
        self.built[path] = entry  # what the previous tree held there, for `same_content`
        return self.file_entry(fd, entry.name, path, entry, found)

    def remove_extras(self, fd: int, path: str) -> None:
        """Delete what the directories noted by `directory` hold beyond their target entries
        (stray temporaries included), walking to them from the open directory `fd` (at
        `path`) through descriptors that follow no link. A directory whose mode forbids it
        is given its owner's rwx for the removal and its mode back after."""
        if path in self.extras:
            wanted = self.names_of(path)
            changed = False
            for name in sorted(os.listdir(fd)):
                if name in wanted:
                    continue
                found = lstat_at(name, fd)
                if found is None:
                    continue
                self.tick()
                count = self.remove(fd, name, found)
                changed = True
                if is_temp_name(name):
                    self.temporaries += count
                else:
                    self.removed += count
            if changed and self.durable:
                os.fsync(fd)
        for name, entry in sorted(self.children.get(path, {}).items()):
            where = join_path(path, name)
            if entry.type != "dir" or (where not in self.extras and where not in self.on_the_way):
                continue
            found = lstat_at(name, fd)
            if found is None or not stat.S_ISDIR(found.st_mode):
                continue
            mode = stat.S_IMODE(found.st_mode)
            child = open_dir(name, fd)
            try:
                if mode & 0o700 != 0o700:
                    os.fchmod(child, mode | 0o700)
                self.remove_extras(child, where)
            finally:
                if stat.S_IMODE(os.fstat(child).st_mode) != mode:
                    os.fchmod(child, mode)
                os.close(child)

    def remove(self, fd: int, name: str, found: os.stat_result) -> int:
        """Remove `name` (a whole directory tree, never following a link): paths removed.
        Depth first with a stack of open directories, not recursion: a chain of directories
        deeper than Python's recursion limit is removed too."""
        if not stat.S_ISDIR(found.st_mode):
            os.unlink(name, dir_fd=fd)
            return 1
        count = 0
        stack: list[tuple[int, str, int, Iterator[str]]] = []  # parent, name, its fd, names

        def enter(parent: int, directory: str, mode: int) -> None:
            child = open_dir(directory, parent)
            try:
                if stat.S_IMODE(mode) & 0o700 != 0o700:
                    os.fchmod(child, 0o700)  # to list it and remove what it holds
                names = iter(os.listdir(child))
            except BaseException:
                os.close(child)
                raise
            stack.append((parent, directory, child, names))

        try:
            enter(fd, name, found.st_mode)
            while stack:
                parent, directory, child, names = stack[-1]
                sub = next(names, None)
                if sub is None:
                    stack.pop()
                    os.close(child)
                    os.rmdir(directory, dir_fd=parent)
                    count += 1
                    continue
                inner = lstat_at(sub, child)
                if inner is None:
                    continue
                self.tick()
                if stat.S_ISDIR(inner.st_mode):
                    enter(child, sub, inner.st_mode)
                else:
                    os.unlink(sub, dir_fd=child)
                    count += 1
        finally:
            for _parent, _directory, child, _names in stack:
                os.close(child)
        return count

    def dir_entry(
        self, fd: int, name: str, path: str, entry: Entry, found: os.stat_result | None
    ) -> bool:
        before = self.previous.get(path) if self.previous is not None else None
        if (
            before is not None
            and before.same_dir(entry)
            and found is not None
            and stat.S_ISDIR(found.st_mode)
        ):
            # The destination held this very directory (same blob): nothing inside it changed,
            # so it is not read at all (a 1% change of a large tree touches 1% of it). Its
            # entries are not in the target either (the caller's diff did not descend into
            # it): entered, it would look empty and lose what it holds. A mode changed by
            # hand is put back alone.
            if stat.S_IMODE(found.st_mode) == entry.mode:
                self.unchanged += 1
                return False
            self.tick()
            child = open_dir(name, fd)
            try:
                os.fchmod(child, entry.mode)
            finally:
                os.close(child)
            self.modes += 1
            return True
        changed = False
        if found is not None and not stat.S_ISDIR(found.st_mode):
            self.tick()
            self.removed += self.remove(fd, name, found)
            found, changed = None, True
        if found is None:
            self.tick()
            os.mkdir(name, 0o700, dir_fd=fd)
            self.directories += 1
            changed = True
        child = open_dir(name, fd)
        try:
            mode = stat.S_IMODE(os.fstat(child).st_mode)
            if mode & 0o700 != 0o700:
                # Its final mode may not let us list, create or remove inside it: that mode is
                # set once what it holds is done (a crash before leaves this one; rerun fixes).
                os.fchmod(child, mode | 0o700)
            self.directory(child, path)
            if mode != entry.mode or mode & 0o700 != 0o700:
                os.fchmod(child, entry.mode)
            if path in self.made:
                changed = True  # made here before the children wrote below it
            elif found is not None:
                if mode != entry.mode:
                    self.modes += 1
                    changed = True
                else:
                    self.unchanged += 1
        finally:
            os.close(child)
        return changed

    def make_directory(self, fd: int, name: str, path: str) -> None:
        """Make `name` in the open directory `fd` a directory its owner can write in (whatever
        is there otherwise removed, as `dir_entry` does), for child processes to write below
        it before this process enters it; `dir_entry` gives it its mode after."""
        found = lstat_at(name, fd)
        if found is not None and not stat.S_ISDIR(found.st_mode):
            self.removed += self.remove(fd, name, found)
            found = None
        if found is None:
            os.mkdir(name, 0o700, dir_fd=fd)
            self.directories += 1
            self.made.add(path)
        child = open_dir(name, fd)
        try:
            mode = stat.S_IMODE(os.fstat(child).st_mode)
            if mode & 0o700 != 0o700:
                os.fchmod(child, mode | 0o700)
        finally:
            os.close(child)

    def file_entry(
        self, fd: int, name: str, path: str, entry: Entry, found: os.stat_result | None
    ) -> bool:
        if found is not None and stat.S_ISDIR(found.st_mode):
            self.tick()
            self.removed += self.remove(fd, name, found)
            found = None
        if (
            found is not None
            and stat.S_ISREG(found.st_mode)
            and self.same_content(fd, name, path, entry, found)
        ):
            if stat.S_IMODE(found.st_mode) == entry.mode:
                self.unchanged += 1
                return False
            if found.st_nlink == 1 and self.chmod_file(fd, name, found, entry.mode):
                self.modes += 1
                return True
        self.tick()
        size = self.write_file(fd, name, path, entry)
        self.written += 1
        self.bytes_written += size
        return True

    def same_content(
        self, fd: int, name: str, path: str, entry: Entry, found: os.stat_result
    ) -> bool:
        """Whether the regular file `name` holds `entry`'s content, as cheaply as allowed."""
        if found.st_size != entry.size:
            return False
        if self.previous is not None:
            before = self.built.get(path) or self.previous.get(path)
            if before is None or before.type != "file" or before.blobs() != entry.blobs():
                return False  # changed since the destination was written: write it
            if stat.S_IMODE(found.st_mode) in (before.mode, entry.mode):
                return True
            # Someone changed it on disk since: compare by content.
        if entry.chunks is not None:
            return False  # the piece size is not known here, so the pieces cannot be hashed
        return self.hash_file(fd, name, found) == entry.digest

    def hash_file(self, fd: int, name: str, found: os.stat_result) -> str | None:
        try:
            source = os.open(name, READ_FLAGS, dir_fd=fd)
        except OSError:
            return None  # not readable (or gone): it is rewritten
        try:
            now = os.fstat(source)
            if not stat.S_ISREG(now.st_mode) or now.st_ino != found.st_ino:
                return None
            digest = hashlib.sha256()
            while data := os.read(source, CHUNK_BYTES):
                digest.update(data)
                self.tick()
        finally:
            os.close(source)
        return "sha256:" + digest.hexdigest()

    def chmod_file(self, fd: int, name: str, found: os.stat_result, mode: int) -> bool:
        try:
            handle = os.open(name, READ_FLAGS, dir_fd=fd)
        except OSError:
            return False  # not readable: it is rewritten instead
        try:
            now = os.fstat(handle)
            if not stat.S_ISREG(now.st_mode) or now.st_ino != found.st_ino or now.st_nlink != 1:
                return False
            os.fchmod(handle, mode)
        finally:
            os.close(handle)
        return True

    def write_file(self, fd: int, name: str, path: str, entry: Entry) -> int:
        """Write one file through a temporary sibling and a rename; its size."""
        temporary = temp_name(name)
        out = os.open(temporary, _CREATE_FLAGS, 0o600, dir_fd=fd)
        try:
            size = 0
            if entry.size or entry.digest != _EMPTY_BLOB:
                for blob in entry.blobs():
                    with self.open_blob(blob) as source:
                        size += _copy(source, out, entry.size - size, self.tick)
                    if size > entry.size:
                        break
            if size != entry.size:
                raise TreeInvalid(path, "size_mismatch", f"{size} bytes, {entry.size} expected")
            os.fchmod(out, entry.mode)
            if self.durable:
                os.fsync(out)
        except BaseException:
            os.close(out)
            os.unlink(temporary, dir_fd=fd)
            raise
        os.close(out)
        os.rename(temporary, name, src_dir_fd=fd, dst_dir_fd=fd)
        return size

    def symlink_entry(self, fd: int, name: str, entry: Entry, found: os.stat_result | None) -> bool:
        if (
            found is not None
            and stat.S_ISLNK(found.st_mode)
            and os.readlink(name, dir_fd=fd) == entry.target
        ):
            self.unchanged += 1
            return False
        if found is not None and stat.S_ISDIR(found.st_mode):
            self.tick()
            self.removed += self.remove(fd, name, found)
        self.tick()
        temporary = temp_name(name)
        os.symlink(entry.target, temporary, dir_fd=fd)
        os.rename(temporary, name, src_dir_fd=fd, dst_dir_fd=fd)
        self.symlinks += 1
        return True
