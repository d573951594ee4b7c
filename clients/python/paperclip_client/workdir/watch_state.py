"""The CLI's side of the workdir watcher (`paperclip-agent watch`, `watching.py`): the question
it asks on `.paperclip/watch.sock` and what it keeps in `.paperclip/watch.json` for the next
scan.

The protocol, one exchange per connection, each side one line of JSON:

- asked: `{"since": <token or null>}`;
- answered: `{"token": <new token>, "full": <reason>}` when the watcher cannot vouch for every
  event since `since`, else `{"token", "full": null, "dirs": [...], "trees": [...], "names":
  {dir: [name, ...]}}`: the directories (paths relative to the workdir, `""` for its root) to
  list again (more of their entries changed than the watcher names one by one), the
  directories created or moved in since, to be read whole (their subtree too), and for other
  directories the names of the entries that changed (made, removed, written, moved, their
  mode). A token is `<instance>:<sequence>`; the new one covers every event the
  watcher read after answering, so the caller asks for it *before* it scans.

`watch.json` holds the token with what a partial scan needs besides the index: the index it
goes with (its `id`: any other index, after a checkout say, means a full scan), the tree, the
digest of `.paperclipignore`, the store's blob limit, the directory blobs' names by path, the
symlinks (kept and left out) and the files with other hard links (always looked at again: a
write through another link is an event on another directory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from paperclip_client.workdir.index import state_path
from paperclip_client.workdir.scanning import IGNORE_FILE

SOCKET = "watch.sock"
STATE = "watch.json"
STATE_VERSION = 1
ASK_TIMEOUT = 5.0  # seconds: a watcher that does not answer by then is not waited for
MAX_ANSWER = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Answer:
    token: str
    full: str | None  # why the caller must scan everything, or None
    dirs: frozenset[str] = frozenset()
    trees: frozenset[str] = frozenset()
    names: Mapping[str, frozenset[str]] = field(default_factory=dict)
    root: tuple[int, int] | None = None  # the watched directory's (device, inode)


@dataclass(slots=True)
class WatchState:
    """What `watch.json` holds (see the module's docstring)."""

    token: str
    index: str
    tree: str
    ignore: str | None
    max_blob_bytes: int
    paths: dict[str, str] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    linked: list[str] = field(default_factory=list)


def socket_address(state_fd: int) -> str:
    """The socket's address through the state directory's descriptor: a Unix socket's path is
    limited to 107 bytes, a workdir's is not."""
    return f"/proc/self/fd/{state_fd}/{SOCKET}"


def ask(workdir: Path, since: str | None, *, timeout: float = ASK_TIMEOUT) -> Answer | str:
    """The watcher's answer, or why there is none (no watcher, no answer, a bad answer)."""
    state = state_path(workdir)
    if not (state / SOCKET).exists():
        return "no watcher running (paperclip-agent watch)"
    try:
        fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return f"the state directory cannot be opened ({exc.strerror})"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(socket_address(fd))
            conn.sendall(json.dumps({"since": since}).encode() + b"\n")
            data = _read_line(conn)
    except OSError as exc:
        return f"the watcher did not answer ({exc.strerror or exc})"
    finally:
        os.close(fd)
    answer = _parse(data)
    if isinstance(answer, str) or answer.full is not None:
        return answer
    try:
        info = os.stat(workdir)
    except OSError as exc:
        return f"the workdir cannot be read ({exc.strerror})"
    if answer.root != (info.st_dev, info.st_ino):
        # A copy of the workdir made with hard links (`cp -al`) shares its socket: the
        # watcher answering watches another directory, and its answer says nothing of this.
        return "the watcher answering watches another directory (a copy of this workdir?)"
    return answer


def _read_line(conn: socket.socket) -> bytes:
    pieces: list[bytes] = []
    total = 0
    while True:
        piece = conn.recv(1024 * 1024)
        if not piece:
            break
        pieces.append(piece)
        total += len(piece)
        if piece.endswith(b"\n") or total > MAX_ANSWER:
            break
    return b"".join(pieces)


def _parse(data: bytes) -> Answer | str:
    try:
        value = json.loads(data)
        token, full = value["token"], value["full"]
        if not isinstance(token, str) or not (full is None or isinstance(full, str)):
            raise TypeError(token)
        if full is not None:
            return Answer(token=token, full=full)
        dirs, trees, names = value["dirs"], value["trees"], value["names"]
        if not all(isinstance(p, str) for p in [*dirs, *trees, *names]):
            raise TypeError(dirs)
        named = {str(d): frozenset(str(n) for n in ns) for d, ns in names.items()}
        root = value.get("root")
        if not (isinstance(root, list) and len(root) == 2 and all(type(n) is int for n in root)):
            return "the watcher did not say which directory it watches (restart it)"
    except (ValueError, KeyError, TypeError, AttributeError):
        return "the watcher's answer could not be read"
    return Answer(
        token=token,
        full=None,
        dirs=frozenset(dirs),
        trees=frozenset(trees),
        names=named,
        root=(root[0], root[1]),
    )


def ignore_digest(workdir: Path) -> str | None:
    try:
        return hashlib.sha256((workdir / IGNORE_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def load_state(workdir: Path) -> WatchState | None:
    try:
        data = json.loads((state_path(workdir) / STATE).read_bytes())
        if data.get("version") != STATE_VERSION:
            return None
        return WatchState(
            token=str(data["token"]),
            index=str(data["index"]),
            tree=str(data["tree"]),
            ignore=data["ignore"] if isinstance(data["ignore"], str) else None,
            max_blob_bytes=int(data["max_blob_bytes"]),
            paths={str(k): str(v) for k, v in data["paths"].items()},
            links={str(k): str(v) for k, v in data["links"].items()},
            left_out={str(k): str(v) for k, v in data["left_out"].items()},
            linked=[str(p) for p in data["linked"]],
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_state(workdir: Path, state: WatchState) -> None:
    """Written after the index it names (no fsync: a lost or torn file means a full scan)."""
    body = {
        "version": STATE_VERSION,
        "token": state.token,
        "index": state.index,
        "tree": state.tree,
        "ignore": state.ignore,
        "max_blob_bytes": state.max_blob_bytes,
        "paths": state.paths,
        "links": state.links,
        "left_out": state.left_out,
        "linked": state.linked,
    }
    path = state_path(workdir) / STATE
    temp = path.with_name(f"{STATE}.{os.getpid()}.tmp")
    temp.write_bytes(json.dumps(body, separators=(",", ":")).encode())
    os.replace(temp, path)


def drop_state(workdir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (state_path(workdir) / STATE).unlink()
