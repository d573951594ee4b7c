"""`finalizations_reconcile`: the periodic pass that defers a job for every finalization
still waiting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

from django.db import transaction

from paperclip.db.advisory import advisory_lock_held
from paperclip.models import HeartbeatRun
from paperclip.receipts import raw_owner
from recovery.locks import finalization_lock_key
from recovery.selectors.actions import finalizations_waiting
from recovery.selectors.finalization import owner_hold_live
from recovery.services.finalization_jobs import finalization_defer_in_tx


@dataclass(frozen=True, slots=True)
class ReconcileSummary:
    examined: int = 0
    deferred: int = 0
    already_queued: int = 0
    skipped_busy: int = 0
    skipped_held: int = 0


def finalizations_reconcile(
    *,
    batch_size: int = 50,
    progress: Callable[[UUID | None, str], None] | None = None,
) -> ReconcileSummary:
    """Defer a finalization job for every run whose coordinator waits for one (result_accepted /
    workspace_finalizing, no future retry time), in batches of `batch_size`.

    Skipped without deferring anything: a run whose finalization lock is held (a live owner is
    at work; it defers its own follow-up as it lets go), and a run held for the board whose
    prior owner has no worker platform to ask (only the board's confirmation, which defers its
    own job, can move it). A held run whose platform may still report the stop is deferred, so
    the stop proof is looked for again. Nothing counts against the retry budget here.
    `progress(run_id, text)` and `progress(None, batch_text)` report as it goes.
    """
    examined = deferred = already = busy = held = 0
    after: UUID | None = None
    batch_no = 0
    while True:
        batch = finalizations_waiting(after_run_id=after, limit=batch_size)
        if not batch:
            break
        batch_no += 1
        for company_id, run_id in batch:
            after = run_id
            examined += 1
            if advisory_lock_held(finalization_lock_key(company_id, run_id)):
                busy += 1
                text = "skipped (busy: an owner is finalizing it)"
            elif owner_hold_live(company_id=company_id, run_id=run_id) and not platform_pending(
                run_id
            ):
                held += 1
                text = "skipped (held for the board)"
            else:
                with transaction.atomic():
                    job_id = finalization_defer_in_tx(company_id=company_id, run_id=run_id)
                if job_id is None:
                    already += 1
                    text = "already queued"
                else:
                    deferred += 1
                    text = f"deferred job {job_id}"
            if progress is not None:
                progress(run_id, text)
        if progress is not None:
            progress(None, f"batch {batch_no}: {len(batch)} run(s)")
    return ReconcileSummary(examined, deferred, already, busy, held)


def platform_pending(run_id: UUID) -> bool:
    profile = HeartbeatRun.objects.filter(pk=run_id).values_list("runner_profile_json", flat=True)
    receipt = raw_owner(profile.first())
    return isinstance(receipt, dict) and receipt.get("worker") is not None
