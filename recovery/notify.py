"""PostgreSQL NOTIFY signals that wake reconcilers (docs/recovery.md#notify-signals).

NOTIFY is transactional: a signal sent inside a transaction is delivered only at commit, so a
listener never wakes for work that was rolled back. Payloads are JSON `{companyId, runId?}`.
"""

from __future__ import annotations

import json
from uuid import UUID

from django.db import connection

from paperclip.db.locking import require_transaction

FINALIZATION_CHANNEL = "paperclip_native_finalization"
RESULT_COMMIT_CHANNEL = "paperclip_native_result_commit"
STATUS_REASSESSMENT_CHANNEL = "paperclip_native_status_reassessment"
RUN_DISPATCH_CHANNEL = "paperclip_run_dispatch"
DEFERRED_EXECUTION_CHANNEL = "paperclip_deferred_execution"
FINALIZATION_RELEASED_CHANNEL = "paperclip_native_finalization_released"


def _notify(channel: str, payload: dict[str, str]) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [channel, json.dumps(payload, sort_keys=True)])


def notify_finalization_wake(*, company_id: UUID | str, run_id: UUID | str) -> None:
    """Tell finalization reconcilers that a run has work (result accepted, owner released)."""
    require_transaction()
    _notify(FINALIZATION_CHANNEL, {"companyId": str(company_id), "runId": str(run_id)})


def notify_owner_released(*, company_id: UUID | str, run_id: UUID | str) -> None:
    """The five signals sent when a finalization owner lets go (result commit, finalization,
    status reassessment, queued-run dispatch, deferred execution work) plus a release signal."""
    require_transaction()
    run_payload = {"companyId": str(company_id), "runId": str(run_id)}
    company_payload = {"companyId": str(company_id)}
    _notify(RESULT_COMMIT_CHANNEL, run_payload)
    _notify(FINALIZATION_CHANNEL, run_payload)
    _notify(STATUS_REASSESSMENT_CHANNEL, run_payload)
    _notify(RUN_DISPATCH_CHANNEL, company_payload)
    _notify(DEFERRED_EXECUTION_CHANNEL, company_payload)
    _notify(FINALIZATION_RELEASED_CHANNEL, run_payload)
