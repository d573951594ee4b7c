"""Directory descriptors and temporary names: the filesystem primitives of materialization
(docs/snapshots.md#materialization). Every path below a destination is reached through
descriptors opened with `O_NOFOLLOW`, one component at a time, so no symlink on disk is ever
followed; a file or symlink is written to a temporary sibling (`temp_name`) and renamed onto
its path."""

from __future__ import annotations

import os
import re
import secrets
import stat
from typing import Final

TEMP_MARK: Final = ".pcl-tmp-"
_TEMP_NAME = re.compile(r"\..*\.pcl-tmp-[0-9a-f]{16}", re.DOTALL)
_TEMP_OVERHEAD: Final = len(".") + len(TEMP_MARK) + 16
_NAME_MAX: Final = 255
DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def lstat_at(name: str, dir_fd: int) -> os.stat_result | None:
    """`name`'s own status in the open directory `dir_fd` (a link not followed), or None."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_dir(name: str, dir_fd: int) -> int:
    """A descriptor of the directory `name` (never through a symlink)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        # Not running as root and the directory is not readable (an earlier tree gave it
        # mode 0o000, say): give its owner rwx through a handle that cannot follow a link.
        handle = os.open(
            name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
        try:
            mode = stat.S_IMODE(os.fstat(handle).st_mode)
            os.chmod(f"/proc/self/fd/{handle}", mode | 0o700)
        finally:
            os.close(handle)
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def temp_name(name: str) -> str:
    """The temporary sibling a file or symlink `name` is written to before its rename."""
    room = _NAME_MAX - _TEMP_OVERHEAD
    base = name.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f".{base}{TEMP_MARK}{secrets.token_hex(8)}"


def is_temp_name(name: str) -> bool:
    return _TEMP_NAME.fullmatch(name) is not None


def open_below(fd: int, path: str) -> int:
    """A descriptor of the directory `path` below the open directory `fd`, each component
    opened without following a link (a new descriptor of `fd` itself for "")."""
    current = os.dup(fd)
    for name in path.split("/") if path else ():
        try:
            inner = open_dir(name, current)
        finally:
            os.close(current)
        current = inner
    return current
