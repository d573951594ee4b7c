"""`paperclip-agent watch`: a resident watcher of one workdir (Linux inotify, through libc).

It watches every directory of the workdir but the state directory, and answers the CLI's
"what changed since this token" on `.paperclip/watch.sock` (`watch_state.py` has the
protocol). It answers `full` whenever it cannot vouch for every event since the token: a
token of another instance (it restarted) or none, the kernel's queue overflowed, a directory
could not be watched (`max_user_watches`), or more directories changed than `--max-pending`.

Before answering it reads every event that happened before the question: it creates a file
in `.paperclip/cookies/` (watched too) and answers once that file's event arrives (git's
fsmonitor cookie), since one inotify queue keeps the order in which the events happened.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import socket
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

from paperclip_client.workdir.index import STATE_DIR, state_path
from paperclip_client.workdir.watch_state import SOCKET, socket_address

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
DIR_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_DONT_FOLLOW
)
EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then the name, NUL-padded)
COOKIES = "cookies"
LOCK = "watch.lock"
MAX_PENDING = 50_000
MAX_NAMES = 64  # changed entries of one directory named before the directory is, whole
COOKIE_WAIT = 5.0
MAX_REQUEST = 4096


class Stop(Exception):
    """SIGTERM or SIGINT: leave the loop and clean up."""


class Refused(Exception):
    """The watcher cannot start (another one runs, no inotify): the message says why."""


class Inotify:
    """One inotify instance, through libc (no dependency)."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise Refused(f"inotify_init1 failed: {os.strerror(ctypes.get_errno())}")

    def add(self, path: str, mask: int) -> int:
        """The watch descriptor, or raises OSError."""
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path), ctypes.c_uint32(mask))
        if wd < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
        return int(wd)

    def remove(self, wd: int) -> None:
        self.libc.inotify_rm_watch(self.fd, wd)

    def read(self) -> Iterator[tuple[int, int, str]]:
        """The queued events: (wd, mask, name)."""
        while True:
            try:
                data = os.read(self.fd, 256 * 1024)
            except BlockingIOError:
                return
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, size = EVENT.unpack_from(data, offset)
                offset += EVENT.size
                raw = data[offset : offset + size].rstrip(b"\0")
                offset += size
                yield wd, mask, os.fsdecode(raw)

    def close(self) -> None:
        os.close(self.fd)


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


class Watcher:
    """The watches, the changes by token sequence, and the answers."""

    def __init__(self, workdir: Path, *, max_pending: int, say: Callable[[str], None]) -> None:
        self.root = os.fspath(workdir)
        # Which directory this is (device, inode), in every answer: a copy of the workdir
        # made with hard links (`cp -al`) shares the socket, and must not take this one's.
        info = os.stat(self.root)
        self.identity = [info.st_dev, info.st_ino]
        self.say = say
        self.max_pending = max_pending
        self.instance = uuid.uuid4().hex[:16]
        self.seq = 0  # the last token issued
        self.vouch_from = 1  # the oldest token still answered in part
        self.lost = "no token issued by this watcher yet"
        self.changed: dict[str, int] = {}  # directory -> sequence when it last changed
        self.trees: dict[str, int] = {}  # directory created or moved in -> sequence
        self.names: dict[str, dict[str, int]] = {}  # directory -> its changed entries
        self.paths: dict[int, str] = {}  # watch descriptor -> directory
        self.wds: dict[str, int] = {}  # directory -> watch descriptor
        self.blind: str | None = None  # a directory could not be watched: why
        self.inotify = Inotify()
        self.cookies = os.path.join(self.root, STATE_DIR, COOKIES)
        self.cookie_wd = -1
        self.cookie_seen: set[str] = set()
        self.cookie_count = 0
        self.gone: str | None = None  # the workdir itself was moved or deleted

    # --- watches ---------------------------------------------------------------------------

    def start(self) -> int:
        os.makedirs(self.cookies, exist_ok=True)
        for name in os.listdir(self.cookies):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.cookies, name))
        self.cookie_wd = self.inotify.add(self.cookies, IN_CREATE | IN_ONLYDIR)
        self.walk("")
        if self.blind is not None:
            self.say(f"watch: warning: {self.blind}; every answer is `full` until it can")
        return len(self.paths)

    def walk(self, top: str) -> None:
        """Watch `top` and every directory under it (each watched before it is listed, so
        nothing created in it meanwhile is missed), the state directory excepted."""
        stack = [top]
        while stack:
            rel = stack.pop()
            if not self._watch(rel):
                continue
            try:
                with os.scandir(_join(self.root, rel) if rel else self.root) as it:
                    items = [(i.name, i.is_dir(follow_symlinks=False)) for i in it]
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed meanwhile: its parent's event says so
            except OSError as exc:
                self._go_blind(f"{rel or '.'}: cannot be listed ({exc.strerror})")
                continue
            for name, is_dir in items:
                if is_dir and not (not rel and name == STATE_DIR):
                    stack.append(_join(rel, name))

    def _watch(self, rel: str) -> bool:
        try:
            wd = self.inotify.add(_join(self.root, rel) if rel else self.root, DIR_MASK)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                return False  # removed (or replaced) meanwhile: its parent's event says so
            hint = " (raise fs.inotify.max_user_watches)" if exc.errno == errno.ENOSPC else ""
            self._go_blind(f"{rel or '.'}: cannot be watched ({exc.strerror}){hint}")
            return False
        previous = self.paths.get(wd)  # the same directory watched under another path
        if previous is not None and previous != rel and self.wds.get(previous) == wd:
            del self.wds[previous]
        self.paths[wd] = rel
        self.wds[rel] = wd
        return True

    def _go_blind(self, reason: str) -> None:
        if self.blind is None:
            self.blind = reason
        self.lose(reason)

    def unwatch(self, top: str) -> None:
        if top not in self.wds:
            return  # the common case, a new directory: no walk over every watch
        prefix = f"{top}/"
        for wd, rel in list(self.paths.items()):
            if rel == top or rel.startswith(prefix):
                self._forget(wd)
                self.inotify.remove(wd)

    def _forget(self, wd: int) -> None:
        rel = self.paths.pop(wd)
        if self.wds.get(rel) == wd:
            del self.wds[rel]

    def lose(self, reason: str) -> None:
        """Every token issued so far is answered `full` from now on."""
        if self.vouch_from <= self.seq:
            self.say(f"watch: earlier tokens get full scans: {reason}")
        self.vouch_from = self.seq + 1
        self.lost = reason
        self.changed.clear()
        self.trees.clear()
        self.names.clear()

    # --- events ----------------------------------------------------------------------------

    def drain(self) -> None:
        for wd, mask, name in self.inotify.read():
            self.event(wd, mask, name)

    def event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self.lose("the kernel's event queue overflowed")
            self.walk("")  # directories made among the lost events get their watches
            return
        if wd == self.cookie_wd:
            if mask & IN_IGNORED:
                self.gone = "the state directory was removed"
            self.cookie_seen.add(name)
            return
        rel = self.paths.get(wd)
        if rel is None:
            return  # a watch removed since (moved away, deleted)
        if mask & IN_IGNORED:
            self._forget(wd)
            return
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT):
            self._self_gone(rel)
            return
        self._entry(rel, mask, name)

    def _self_gone(self, rel: str) -> None:
        if rel == "":
            self.gone = "the workdir itself was moved, deleted or unmounted"
            self.lose(self.gone)
        else:
            self.mark_name(_parent(rel), rel.rpartition("/")[2])

    def _entry(self, rel: str, mask: int, name: str) -> None:
        """An event about `name` in the directory `rel` (no name: the directory itself)."""
        if not name:  # the directory itself (its mode): an entry of its parent
            if rel:
                self.mark_name(_parent(rel), rel.rpartition("/")[2])
            return
        if not rel and name == STATE_DIR:
            return
        self.mark_name(rel, name)
        if mask & IN_ISDIR:
            child = _join(rel, name)
            if mask & IN_MOVED_FROM:
                self.unwatch(child)
                if os.path.isdir(_join(self.root, child)) and not os.path.islink(
                    _join(self.root, child)
                ):
                    # Something is there again already: two directories exchanged in one
                    # step (renameat2's RENAME_EXCHANGE: moved from a, to b, from b, to a),
                    # whose later "moved from" would otherwise unwatch what the earlier
                    # "moved to" just watched. Watched and read whole, as if moved in.
                    self.mark_tree(child)
                    self.walk(child)
            elif mask & (IN_CREATE | IN_MOVED_TO):
                self.unwatch(child)  # a directory moved back in gets its paths again
                self.mark_tree(child)
                self.walk(child)

    def mark_name(self, rel: str, name: str) -> None:
        """The entry `name` of the directory `rel` changed (made, removed, written, moved, its
        mode): past MAX_NAMES of them, the whole directory is named instead."""
        names = self.names.setdefault(rel, {})
        names[name] = self.seq
        if len(names) > MAX_NAMES:
            del self.names[rel]
            self.changed[rel] = self.seq
        self._bound()

    def mark_tree(self, rel: str) -> None:
        self.trees[rel] = self.seq
        self._bound()

    def _bound(self) -> None:
        if len(self.changed) + len(self.trees) + len(self.names) > self.max_pending:
            self.lose(f"more than {self.max_pending} directories changed (--max-pending)")

    # --- answers ---------------------------------------------------------------------------

    def sync(self, deadline: float) -> bool:
        """Read every event that happened before now (the cookie's arrives after them)."""
        self.cookie_count += 1
        name = f"{self.instance}-{self.cookie_count}"
        path = os.path.join(self.cookies, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        os.close(fd)
        try:
            while name not in self.cookie_seen:
                left = deadline - time.monotonic()
                if left <= 0 or self.gone is not None:
                    return False
                select.select([self.inotify.fd], [], [], left)
                self.drain()
            return True
        finally:
            self.cookie_seen.discard(name)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def answer(self, since: object) -> dict[str, object]:
        """The answer to "changed since `since`" (events read up to now) and a new token."""
        if self.blind is not None:
            was, self.blind = self.blind, None
            self.walk("")  # try again: what failed may have been freed
            # Even when it now succeeds, no token issued so far is vouched for: a directory
            # had no watch from when it failed until this walk, and the answers given in
            # between (`full`) carried tokens that a later answer would otherwise take up.
            self.lose(self.blind or f"{was}, until now")
        reason = self._refusal(since)
        body: dict[str, object]
        if reason is not None:
            body = {"full": reason}
        else:
            assert isinstance(since, str)  # noqa: S101 - checked by _refusal
            start = int(since.rpartition(":")[2])
            body = {
                "full": None,
                "dirs": sorted(p for p, s in self.changed.items() if s >= start),
                "trees": sorted(p for p, s in self.trees.items() if s >= start),
                "names": self._names_since(start),
            }
            # Older tokens are no longer needed (the CLI keeps its latest): forget them.
            self.changed = {p: s for p, s in self.changed.items() if s >= start}
            self.trees = {p: s for p, s in self.trees.items() if s >= start}
            self.names = {
                p: {n: s for n, s in names.items() if s >= start}
                for p, names in self.names.items()
                if max(names.values()) >= start
            }
            self.vouch_from = max(self.vouch_from, start)
        self.seq += 1
        body["token"] = f"{self.instance}:{self.seq}"
        body["root"] = self.identity
        return body

    def _names_since(self, start: int) -> dict[str, list[str]]:
        found = {}
        for rel, names in self.names.items():
            changed = sorted(n for n, s in names.items() if s >= start)
            if changed and self.changed.get(rel, -1) < start:
                found[rel] = changed
        return found

    def _refusal(self, since: object) -> str | None:
        if self.gone is not None:
            return self.gone
        if self.blind is not None:
            return self.blind
        if not isinstance(since, str):
            return "no token yet (the first scan with this watcher)"
        instance, _, seq = since.rpartition(":")
        if instance != self.instance:
            return "the token is another watcher's (it was restarted)"
        try:
            start = int(seq)
        except ValueError:
            return "the token could not be read"
        if start > self.seq:
            return "the token could not be read"
        if start < self.vouch_from:
            return self.lost
        return None

    def serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2.0)
            try:
                request = json.loads(_read_request(conn))
                since = request.get("since") if isinstance(request, dict) else None
                body: dict[str, object]
                if not self.sync(time.monotonic() + COOKIE_WAIT):
                    body = {"full": self.gone or "the watcher's cookie did not arrive in time"}
                    self.lose(str(body["full"]))
                    self.seq += 1
                    body["token"] = f"{self.instance}:{self.seq}"
                else:
                    body = self.answer(since)
                conn.sendall(json.dumps(body).encode() + b"\n")
            except (OSError, ValueError):
                return  # the CLI gave up or sent nonsense: it scans in full


def _read_request(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_REQUEST:
        piece = conn.recv(MAX_REQUEST)
        if not piece:
            break
        data += piece
    return data


def _stop(_signum: int, _frame: FrameType | None) -> None:
    raise Stop


def _lock(state: Path) -> int:
    """The workdir's watcher lock (held for the watcher's life), or Refused."""
    fd = os.open(state / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise Refused(f"another watcher already runs for this workdir (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def run(workdir: Path, *, max_pending: int = MAX_PENDING, say: Callable[[str], None]) -> None:
    """Watch `workdir` until SIGTERM or SIGINT (Refused when it cannot start)."""
    if not workdir.is_dir() or not stat.S_ISDIR(os.lstat(workdir).st_mode):
        raise Refused(f"{workdir}: not a directory")
    state = state_path(workdir)
    state.mkdir(exist_ok=True)
    lock = _lock(state)
    state_fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    watcher: Watcher | None = None
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET, dir_fd=state_fd)  # a dead watcher's (the lock says none runs)
        watcher = Watcher(workdir, max_pending=max_pending, say=say)
        count = watcher.start()
        listener.bind(socket_address(state_fd))
        os.chmod(socket_address(state_fd), 0o600)  # its answers name the workdir's paths
        listener.listen(16)
        say(f"watch: {count} directories watched in {workdir}; answering on {STATE_DIR}/{SOCKET}")
        _loop(watcher, listener)
        say(f"watch: stopping: {watcher.gone}")
    except Stop:
        say("watch: stopped")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(SOCKET, dir_fd=state_fd)
        if watcher is not None:
            watcher.inotify.close()
            with contextlib.suppress(OSError):
                os.rmdir(watcher.cookies)
        os.close(state_fd)
        os.close(lock)


def _loop(watcher: Watcher, listener: socket.socket) -> None:
    poller = select.poll()
    poller.register(watcher.inotify.fd, select.POLLIN)
    poller.register(listener.fileno(), select.POLLIN)
    while watcher.gone is None:
        for fd, _events in poller.poll():
            if fd == watcher.inotify.fd:
                watcher.drain()
            else:
                conn, _ = listener.accept()
                watcher.serve(conn)
