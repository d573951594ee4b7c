"""The takeover rule (recovery/takeover.py) applied to the owner a run's receipt records, with
this process's probes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from paperclip.models import WorkspaceOperation
from paperclip.receipts import OwnerReceipt
from recovery.adapters.identity import (
    ControllerIdentity,
    TakeoverDecision,
    evaluate_receipt_takeover,
)
from recovery.adapters.platform import request_worker_stop_proof
from recovery.services.ownership.memory import active_owner_tokens, joined_owner_tokens, memory_lock
from recovery.takeover import RecordedOwner, Ruling, owner_host, takeover_ruling


@dataclass(frozen=True, slots=True)
class PriorJudged:
    ruling: Ruling
    proof: dict[str, Any] | None  # the platform's verified stop proof, when it was asked
    platform_pending: bool  # the platform has not reported the recorded worker stopped yet


def recorded_owner(prior: OwnerReceipt | None, identity: ControllerIdentity) -> RecordedOwner:
    """What the receipt says of its owner against `identity` and this process's owner memory:
    the facts the takeover rule needs without a probe (the console's verdict reads the same)."""
    same_host = prior is not None and owner_host(prior, identity) == "this_host"
    same_process = (
        same_host
        and prior is not None
        and prior.controller_boot_id == identity.boot_id
        and prior.pid == identity.pid
    )
    with memory_lock:
        live_here = prior is not None and prior.token in active_owner_tokens
        joined_here = prior is not None and prior.token in joined_owner_tokens
    return RecordedOwner(
        readable=prior is not None,
        same_host=same_host,
        same_process=same_process,
        live_here=live_here,
        joined_here=joined_here,
    )


def judge_prior(
    *,
    company_id: UUID,
    run_id: UUID,
    issue_id: UUID | None,
    prior: OwnerReceipt | None,
    identity: ControllerIdentity,
) -> PriorJudged:
    """The takeover rule (recovery/takeover.py) applied to the owner a run's receipt records,
    with this process's probes: the platform's stop proof, the OS process table and the
    copy-back barrier, each asked only when the rule reaches it."""
    proof: dict[str, Any] | None = None
    platform_pending = False

    def stop_proof_verified() -> bool:
        nonlocal proof, platform_pending
        if prior is None or prior.worker is None:
            return False
        check = request_worker_stop_proof(
            run_id=run_id, owner_token=prior.token, worker=prior.worker
        )
        proof = check.proof if check.status == "verified" else None
        platform_pending = check.status == "pending"
        return proof is not None

    def process_check() -> TakeoverDecision:
        if prior is None:  # never probed so: the rule asks only about a readable receipt
            return TakeoverDecision(False, "controller_identity_missing")
        return evaluate_receipt_takeover(prior)

    def copyback_barrier() -> bool:
        # A dead parent may have orphaned copy children; only the durable succeeded
        # copy-back barrier proves they finished.
        return issue_id is not None and copyback_barrier_exists(
            company_id=company_id, run_id=run_id, issue_id=issue_id
        )

    ruling = takeover_ruling(
        recorded_owner(prior, identity),
        stop_proof=stop_proof_verified,
        process=process_check,
        copyback_barrier=copyback_barrier,
    )
    return PriorJudged(ruling, proof, platform_pending)


def copyback_barrier_exists(*, company_id: UUID, run_id: UUID, issue_id: UUID) -> bool:
    return WorkspaceOperation.objects.filter(
        company_id=company_id,
        heartbeat_run_id=run_id,
        issue_id=issue_id,
        phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
        status=WorkspaceOperation.Status.SUCCEEDED,
    ).exists()
