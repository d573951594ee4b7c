"""The durable owner receipt's removal when the action ends, retried in the background while
the database is away (docs/ha.md#never-two-finalizers)."""

from __future__ import annotations

import logging
import threading
import time
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from paperclip.activity import activity_record
from paperclip.receipts import OWNER_KEY
from recovery.services.finalization_jobs import finalization_follow_up_in_tx
from recovery.services.ownership.memory import (
    active_owner_tokens,
    active_run_owners,
    joined_owner_tokens,
    memory_lock,
)

logger = logging.getLogger(__name__)


def release_receipt(*, company_id: UUID, run_id: UUID, token: str, run_key: str) -> None:
    """Remove only our receipt while the lock is still held (so no other controller can see a
    finished owner's receipt and raise a needless hold). On failure keep same-boot join
    evidence: only this boot may then take the receipt over without proof."""
    with memory_lock:
        active_owner_tokens.discard(token)
        if active_run_owners.get(run_key, ("", ""))[0] == token:
            del active_run_owners[run_key]
        joined_owner_tokens.add(token)
    try:
        _remove_receipt(company_id=company_id, run_id=run_id, token=token)
    except Exception:
        logger.exception(
            "could not remove finalization owner receipt %s of run %s; retrying in the background",
            token,
            run_id,
        )
        threading.Thread(
            target=_retry_release,
            kwargs={"company_id": company_id, "run_id": run_id, "token": token},
            name="finalization-receipt-release",
            daemon=True,
        ).start()
        return
    with memory_lock:
        joined_owner_tokens.discard(token)


# After a failed removal (the database was failing over): seconds between the retries, about
# five minutes in all.
RELEASE_RETRY_DELAYS: tuple[float, ...] = (1, 2, 4, 8, 15, 30, 60, 60, 60, 60)


def _retry_release(*, company_id: UUID, run_id: UUID, token: str) -> None:
    """Remove a finished owner's receipt once the database answers again
    (docs/ha.md#never-two-finalizers): this process knows its action ended, and as long as the
    receipt stays, only this very process could take the run over; another worker would have to
    hold it for the board. The removal matches our token only, so a takeover meanwhile (which
    writes its own) is never undone; it defers the run's next attempt as a release does."""
    try:
        for delay in RELEASE_RETRY_DELAYS:
            time.sleep(delay)
            with memory_lock:
                if token not in joined_owner_tokens:
                    return  # taken over in this process meanwhile
            try:
                _remove_receipt(company_id=company_id, run_id=run_id, token=token)
            except Exception as exc:
                logger.warning("receipt %s of run %s: still not removed (%s)", token, run_id, exc)
                connections[DEFAULT_DB_ALIAS].close()
                continue
            with memory_lock:
                joined_owner_tokens.discard(token)
            logger.info("receipt %s of run %s removed after the database came back", token, run_id)
            return
        logger.error(
            "receipt %s of run %s: gave up removing it; the run may need the board", token, run_id
        )
    finally:
        connections[DEFAULT_DB_ALIAS].close()


def _remove_receipt(*, company_id: UUID, run_id: UUID, token: str) -> None:
    """Remove the receipt if it is still `token`'s (audited, with the run's follow-up)."""
    with transaction.atomic(durable=True):
        with transaction.get_connection().cursor() as cursor:
            cursor.execute(
                "UPDATE heartbeat_runs SET runner_profile_json = "
                "coalesce(runner_profile_json, '{}'::jsonb) - %s, updated_at = now() "
                "WHERE id = %s AND company_id = %s "
                "AND runner_profile_json -> %s ->> 'token' = %s",
                [OWNER_KEY, run_id, company_id, OWNER_KEY, token],
            )
            released = cursor.rowcount
        if released:
            activity_record(
                company_id=company_id,
                actor_type="system",
                actor_id="finalization-controller",
                action="run.finalization_owner_released",
                entity_type="heartbeat_run",
                entity_id=run_id,
                run_id=run_id,
                details={"token": token},
            )
            finalization_follow_up_in_tx(company_id=company_id, run_id=run_id)
