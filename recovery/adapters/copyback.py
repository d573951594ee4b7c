"""Copy-back backends: copy a run's workspace directory to the execution workspace's host
directory (setting `PAPERCLIP_COPYBACK_BACKEND`).

The default, `LocalDirectoryCopyback`, copies a local tree into a staging sibling of the
destination and then swaps it in with two renames, so the destination is never a half-copied
mix. Symlinks are never followed: a link whose target stays inside the source tree is copied
as a link, any other link (absolute, or escaping with `..`) is skipped and reported. A crash
at any point leaves either the old destination or the new one plus named leftovers that the
next attempt for the same run cleans up; the source stays authoritative throughout.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from uuid import UUID

from django.conf import settings
from django.utils.module_loading import import_string

# How many entries to copy between two ownership checks.
CHECK_EVERY = 200


@dataclass(frozen=True, slots=True)
class CopybackReport:
    files: int
    directories: int
    bytes: int
    symlinks: int
    skipped: tuple[str, ...] = field(default_factory=tuple)


class CopybackBackend(Protocol):
    def copy_back(
        self, *, run_id: UUID, source: str, destination: str, check: Callable[[], None]
    ) -> CopybackReport:
        """Make `destination` a copy of `source`. Call `check()` regularly: it raises when
        ownership was lost, and the copy must stop without publishing anything."""


class CopybackError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _inside(root: Path, link_dir: Path, target: str) -> bool:
    if os.path.isabs(target):
        return False
    resolved = os.path.normpath(os.path.join(link_dir, target))
    return resolved == str(root) or resolved.startswith(str(root) + os.sep)


class LocalDirectoryCopyback:
    """Copy a local directory tree; see the module docstring for the safety rules."""

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
        report = self._copy_tree(src, staging, check)
        # The staging directory was made private (0700) while it filled; the published
        # directory gets the source's own mode and times, as `cp -a` would give it.
        shutil.copystat(src, staging, follow_symlinks=False)
        check()
        if dest.exists():
            dest.rename(backup)
        staging.rename(dest)
        if backup.exists():
            shutil.rmtree(backup)
        return report

    def _copy_tree(self, src: Path, staging: Path, check: Callable[[], None]) -> CopybackReport:
        files = directories = size = links = 0
        skipped: list[str] = []
        staging.mkdir(mode=0o700)
        seen = 0
        for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
            here = Path(dirpath)
            rel_dir = here.relative_to(src)
            target_dir = staging / rel_dir
            for name in sorted([*dirnames, *filenames]):
                seen += 1
                if seen % CHECK_EVERY == 0:
                    check()
                entry = here / name
                rel = str(rel_dir / name)
                mode = entry.lstat().st_mode
                if stat.S_ISLNK(mode):
                    link = os.readlink(entry)
                    if _inside(src, here, link):
                        os.symlink(link, target_dir / name)
                        links += 1
                    else:
                        skipped.append(rel)
                elif stat.S_ISDIR(mode):
                    (target_dir / name).mkdir()
                    shutil.copystat(entry, target_dir / name, follow_symlinks=False)
                    directories += 1
                elif stat.S_ISREG(mode):
                    shutil.copy2(entry, target_dir / name, follow_symlinks=False)
                    files += 1
                    size += entry.lstat().st_size
                else:
                    skipped.append(rel)  # sockets, fifos, devices
            # Never descend into symlinked directories (os.walk lists them in dirnames).
            dirnames[:] = [d for d in dirnames if not (here / d).is_symlink()]
        return CopybackReport(files, directories, size, links, tuple(skipped))


@functools.cache
def _backend(path: str) -> CopybackBackend:
    backend: CopybackBackend = import_string(path)()
    return backend


def copyback_backend() -> CopybackBackend:
    return _backend(str(settings.PAPERCLIP_COPYBACK_BACKEND))
