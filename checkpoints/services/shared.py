"""What several checkpoint service modules share: the live-run-recovery NOTIFY, sent by the
checkpoint writer and by the expired-authority sweep.
"""

from __future__ import annotations

import json
from uuid import UUID

from django.db import connection

from paperclip.db.locking import require_transaction

LIVE_RUN_RECOVERY_CHANNEL = "paperclip_live_run_recovery"


def live_run_recovery_notify(*, company_id: UUID, run_id: UUID) -> None:
    """Wake live-run recovery listeners for the run, at this transaction's commit."""
    require_transaction()
    with connection.cursor() as cursor:
        # Raw: NOTIFY has no ORM spelling. Sent inside the transaction, it is delivered only at
        # commit, after the row locks are released, so a listener never wakes before the write.
        cursor.execute(
            "SELECT pg_notify(%s, %s)",
            [
                LIVE_RUN_RECOVERY_CHANNEL,
                json.dumps({"companyId": str(company_id), "runId": str(run_id)}),
            ],
        )
