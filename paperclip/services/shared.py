"""Helpers the core services share: path validation (also used by the API serializers and the
admin), the board-only check, and the audit row every state change writes inside its
transaction.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any
from uuid import UUID

from paperclip.access import Actor
from paperclip.activity import activity_record
from paperclip.errors import PermissionDenied


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
