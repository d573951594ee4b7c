"""Helpers the core services share: path validation (also used by the API serializers and the
admin), the check that a workspace's `cwd` is no other company's (also used by the admin), the
board-only check, and the audit row every state change writes inside its transaction.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import PurePosixPath
from typing import Any
from uuid import UUID

from django.conf import settings

from paperclip.access import Actor
from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock
from paperclip.db.locking import require_transaction
from paperclip.errors import PermissionDenied, WorkspaceCwdNotAllowed
from paperclip.locks import workspace_cwds_key
from paperclip.models import ExecutionWorkspace
from paperclip.selectors import other_company_run_dirs


def absolute_path_error(value: str) -> str | None:
    """Why `value` is not an acceptable absolute directory path, or None if it is.

    Paths are POSIX, absolute, without NUL bytes and without `..` segments: the directory is
    later a copy-back destination, so it must say plainly where it points.
    """
    if "\x00" in value:
        return "Must not contain NUL bytes."
    if not value.startswith("/"):
        return "Must be an absolute path."
    if ".." in PurePosixPath(value).parts:
        return "Must not contain '..' segments."
    return None


def path_inside(path: str, parent: str) -> bool:
    """`path` lies strictly inside `parent` (both normalized, absolute)."""
    return path.startswith(parent.rstrip("/") + "/") and path != parent


def paths_related(path: str, other: str) -> bool:
    """`path` is `other`, lies inside it, or holds it (both normalized, absolute)."""
    return path == other or path_inside(path, other) or path_inside(other, path)


def run_dirs_under(run_dirs: Iterable[str], real_roots: Sequence[str]) -> list[str]:
    """The run directories, as runs named them, that lie strictly inside one of `real_roots`
    (resolved), each resolved (`realpath`: one named through a link lies where it points).
    One outside every root, or a root itself, is left out: the copy-back never reads it, and
    counting it would let a run naming `/` stand in every other company's way."""
    found = []
    for named in run_dirs:
        if not named.startswith("/") or "\x00" in named:
            continue
        real = os.path.realpath(named)
        if any(path_inside(real, root) for root in real_roots):
            found.append(real)
    return found


def cwd_overlaps(cwd: str, others: Iterable[str]) -> bool:
    """`cwd` is, holds or lies inside one of `others` (absolute paths), each compared with its
    symbolic links resolved (`realpath`): a link to another company's directory, or a `cwd`
    recorded through one, is judged by where it points."""
    path = os.path.realpath(cwd)
    return any(
        paths_related(path, os.path.realpath(other)) for other in others if other.startswith("/")
    )


def workspace_cwd_check_in_tx(*, cwd: str, company_id: UUID, superuser: bool) -> None:
    """Refuse (WorkspaceCwdNotAllowed) a `cwd` for a workspace of `company_id` that is, holds or
    lies inside another company's workspace `cwd`, the data directory or the blob store; that
    is or holds a copy-back root (`PAPERCLIP_COPYBACK_ROOTS`: they hold every company's run
    directories); or that is, holds or lies inside another company's run directory under such
    a root; unless a superuser gives it.

    The worker adopts a `cwd` as its workspace's head and writes the head back into it, often
    as root, so such a `cwd` let one company's board read or overwrite another company's
    files, or the server's own (and a `cwd` holding a root made every copy-back under it
    refused). Run directories outside every root are not counted: the server never reads
    them, and one naming `/` would otherwise refuse every `cwd`. Every path is compared with
    its links resolved, the settings' too (a relative store directory included). A superuser
    is trusted with the whole machine. Takes the advisory lock `workspace_cwds_key()` (for
    superusers too, so that a check beside their write still sees it), then reads every
    other company's distinct `cwd` and run directory; the error names none of them.
    """
    require_transaction()
    advisory_xact_lock(workspace_cwds_key())
    if superuser:
        return
    path = os.path.realpath(cwd)
    roots = [os.path.realpath(root) for root in settings.PAPERCLIP_COPYBACK_ROOTS]
    if any(path == root or path_inside(root, path) for root in roots):
        raise WorkspaceCwdNotAllowed()
    others = (
        ExecutionWorkspace.objects.exclude(company_id=company_id)
        .filter(cwd__startswith="/")
        .order_by()
        .values_list("cwd", flat=True)
        .distinct()
    )
    run_dirs = run_dirs_under(other_company_run_dirs(company_id), roots) if roots else []
    reserved = [os.path.realpath(settings.DATA_DIR), os.path.realpath(settings.PAPERCLIP_CAS_DIR)]
    if cwd_overlaps(cwd, [*reserved, *(other for other in others if other), *run_dirs]):
        raise WorkspaceCwdNotAllowed()


def require_board(actor: Actor) -> None:
    if not actor.is_board:
        raise PermissionDenied("This operation is for board members.")


def audit(
    actor: Actor,
    *,
    company_id: UUID | None,
    action: str,
    entity_type: str,
    entity_id: UUID,
    run_id: UUID | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    activity_record(
        company_id=company_id,
        actor_type=actor.actor_type,
        actor_id=actor.actor_id,
        action=action,
        entity_type=entity_type,
        entity_id=entity_id,
        run_id=run_id,
        details=details,
    )
