"""What happens after an audit row commits: its counters move and it is logged."""

from __future__ import annotations

import logging

from paperclip.models import ActivityEvent
from paperclip.observability.metrics import audit_counters_move

logger = logging.getLogger("paperclip.audit")


def audit_committed(event: ActivityEvent) -> None:
    """on_commit of activity_record. The details are not logged: the audit row keeps them,
    and a log line must never carry what a detail might hold."""
    audit_counters_move(event.action, event.details)
    logger.info(
        "%s %s %s",
        event.action,
        event.entity_type,
        event.entity_id,
        extra={
            "event": {
                "action": event.action,
                "entity_type": event.entity_type,
                "entity_id": event.entity_id,
                "actor_type": event.actor_type,
                "actor_id": event.actor_id,
                "company_id": str(event.company_id) if event.company_id else None,
                "run_id": str(event.run_id) if event.run_id else None,
            }
        },
    )
