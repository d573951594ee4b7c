"""Adopting a workspace's existing cwd as its first head
(docs/snapshots.md#adopting-an-existing-cwd)."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO, Final
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.locking import require_transaction
from paperclip.models import ExecutionWorkspace
from paperclip.snapshots.counts import counts_of, tree_counts_record
from paperclip.snapshots.diff import ChangeCounts
from paperclip.snapshots.dirfd import DIR_FLAGS, READ_FLAGS
from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.history import SYSTEM_ACTOR, head_move_record_in_tx
from paperclip.snapshots.store.uploads import cas_put, cas_store_blobs
from paperclip.snapshots.trees import RESERVED_ROOT_NAMES, Entry, TreeInvalid, build, check_symlinks
from paperclip.worker.jobs import job_defer_in_tx

ADOPT_TASK: Final = "adopt_workspace_cwd"


class CwdUnadoptable(Exception):
    """The cwd holds something a tree cannot: publishing waits until an operator tidies it."""

    code = "workspace_cwd_unadoptable"


def workspace_cwd_adopt_defer_in_tx(*, company_id: UUID, workspace_id: UUID) -> int | None:
    """Defer the adoption job (the worker sees the cwd; a web node may not)."""
    require_transaction()
    return job_defer_in_tx(
        ADOPT_TASK,
        queueing_lock=f"adopt-workspace:{workspace_id}",
        company_id=str(company_id),
        workspace_id=str(workspace_id),
    )


def _open_file(cwd: str, path: str, entry: Entry) -> BinaryIO:
    """The cwd's file at `path`, opened a directory at a time without following any link
    and without blocking (a file swapped for a FIFO since the walk hashed it), refused unless
    it is still a regular file of the walked size: its bytes are then checked against the
    digests as they are stored."""
    parts = path.split("/")
    fd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            inner = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = inner
        opened = os.open(parts[-1], READ_FLAGS, dir_fd=fd)
    except OSError as exc:
        raise CwdUnadoptable(f"{path}: changed while the cwd was adopted ({exc.strerror})") from exc
    finally:
        os.close(fd)
    info = os.fstat(opened)
    if not stat.S_ISREG(info.st_mode) or info.st_size != entry.size:
        os.close(opened)
        raise CwdUnadoptable(f"{path}: changed while the cwd was adopted")
    os.set_blocking(opened, True)
    return os.fdopen(opened, "rb")


class _Piece:
    """Bytes `offset .. offset + size` of an open file, readable as a stream."""

    def __init__(self, handle: BinaryIO, offset: int, size: int) -> None:
        handle.seek(offset)
        self._handle, self._left = handle, size

    def read(self, size: int = -1, /) -> bytes:
        want = self._left if size < 0 else min(size, self._left)
        data = self._handle.read(want)
        self._left -= len(data)
        return data


def workspace_cwd_adopt(*, company_id: UUID, workspace_id: UUID) -> str | None:
    """A workspace that never had a head but whose cwd already holds files (created over an
    existing checkout, or written by local copy-back) gets that content as its head before
    the first publish, so the first run's tree merges with it instead of replacing it
    (docs/snapshots.md#adopting-an-existing-cwd). Returns the adopted tree, or None when there
    was nothing to adopt. The head moves only if it is still empty (compare-and-set); audited.
    Raises CwdUnadoptable when the cwd holds something a tree cannot (a FIFO, a name that is not
    UTF-8, a symlink leaving it): publishing waits until an operator tidies it.

    Run by the worker (it sees the cwd) as soon as a workspace is created with a cwd, so the
    first run's checkout already holds what was there, and again before a first publish."""
    row = (
        ExecutionWorkspace.objects.filter(pk=workspace_id, company_id=company_id)
        .values("cwd", "head_tree", "cwd_tree")
        .first()
    )
    if row is None or row["head_tree"] is not None or not row["cwd"]:
        return None
    cwd = row["cwd"]
    if not os.path.isdir(cwd) or not os.listdir(cwd):
        return None
    limit = int(settings.PAPERCLIP_CAS_MAX_BLOB_BYTES)
    try:
        # The agent CLI's own state directory is never content (registration refuses a tree
        # naming it at its root): a cwd that is also a CLI's workdir keeps it out of the head.
        entries = read_tree(cwd, max_blob_bytes=limit, leave_out=RESERVED_ROOT_NAMES)
        # A tree never holds an absolute link (decoding refuses one); a cwd may.
        for path, entry in entries.items():
            if entry.type == "symlink" and (entry.target or "").startswith("/"):
                raise TreeInvalid(path, "absolute_symlink")
        check_symlinks(entries)
    except (TreeInvalid, OSError) as exc:
        raise CwdUnadoptable(f"the cwd {cwd} cannot be read as a tree: {exc}") from exc
    for path, entry in entries.items():
        if entry.type != "file":
            continue
        with _open_file(cwd, path, entry) as handle:
            for index, name in enumerate(entry.blobs()):
                size = min(limit, entry.size - index * limit) if entry.chunks else entry.size
                cas_put(
                    company_id=company_id,
                    digest=name,
                    stream=_Piece(handle, index * limit, size),
                    length=size,
                )
    root, blobs = build(entries)
    cas_store_blobs(company_id=company_id, blobs=blobs)
    tree_counts_record(company_id=company_id, tree=root, counts=counts_of(entries))
    with transaction.atomic(durable=True):
        adopted = ExecutionWorkspace.objects.filter(
            pk=workspace_id, company_id=company_id, head_tree__isnull=True
        ).update(head_tree=root, cwd_tree=root, head_committed_at=Now(), updated_at=Now())
        if adopted:
            activity_record(
                company_id=company_id,
                actor_type="system",
                actor_id="workspace_publisher",
                action="workspace.head_adopted",
                entity_type="execution_workspace",
                entity_id=workspace_id,
                details={"tree": root, "cwd": cwd, "entries": len(entries)},
            )
            head_move_record_in_tx(
                company_id=company_id,
                workspace_id=workspace_id,
                tree=root,
                previous_tree=None,
                kind="adoption",
                actor_type="system",
                actor_id=SYSTEM_ACTOR,
                counts=ChangeCounts(added=len(entries)),
            )
    return root if adopted else None
