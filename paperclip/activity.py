"""The audit log writer. Every state change records one row in the caller's transaction."""

from __future__ import annotations

from functools import partial
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models import Model

from paperclip.db.locking import require_transaction
from paperclip.models import ActivityEvent
from paperclip.observability.events import audit_committed


def activity_record(
    *,
    company_id: UUID | str | None,
    actor_type: str,
    actor_id: str,
    action: str,
    entity_type: str,
    entity_id: UUID | str,
    run_id: UUID | str | None = None,
    details: dict[str, Any] | None = None,
) -> ActivityEvent:
    """Write one audit row. Must be called inside the transaction that makes the change."""
    require_transaction()
    event = ActivityEvent.objects.create(
        company_id=company_id,
        actor_type=actor_type,
        actor_id=str(actor_id),
        action=action,
        entity_type=entity_type,
        entity_id=str(entity_id),
        run_id=run_id,
        details=details or {},
    )
    transaction.on_commit(partial(audit_committed, event))
    return event


def row_update_audited(instance: Model, values: dict[str, Any], **event: Any) -> None:
    """Update `instance`'s row with `values` (database expressions allowed), write the one
    audit row `event` describes (activity_record's arguments) in the same transaction, and
    reload the fields the update set."""
    require_transaction()
    type(instance)._default_manager.filter(pk=instance.pk).update(**values)
    activity_record(**event)
    instance.refresh_from_db(fields=list(values))
