"""How much one walk of a tree may read, when its caller does not say.

A registration checks an agent's tree against the settings (`PAPERCLIP_SNAPSHOT_MAX_ENTRIES`,
`PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES`, `PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS`) and passes them
itself. Every other walk (publication, materialization, merges, restores, the console's
reads) reads trees that were registered, so it allows the larger of each setting and its
built-in bound: a setting raised lets the worker publish and materialize the trees it let
register, and a setting lowered later never strands a tree registered before. Below `trees`.
"""

from __future__ import annotations

from typing import Final

from django.conf import settings

from paperclip.snapshots.links import MAX_SYMLINK_STEPS

MAX_ENTRIES: Final = 2_000_000
# The paths of one walk added up (bytes of text): what bounds its memory when directories are
# shared by many paths.
MAX_PATH_BYTES: Final = 256 * 1024 * 1024


def walk_entries() -> int:
    return max(MAX_ENTRIES, int(settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES))


def walk_path_bytes() -> int:
    return max(MAX_PATH_BYTES, int(settings.PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES))


def walk_symlink_steps() -> int:
    return max(MAX_SYMLINK_STEPS, int(settings.PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS))
