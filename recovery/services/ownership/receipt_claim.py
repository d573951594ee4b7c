"""The durable owner receipt's claim: built from this controller's identity, swapped in by
compare-and-swap in one audited transaction."""

from __future__ import annotations

import json
import uuid
from typing import Any
from uuid import UUID

from django.db import transaction

from paperclip.activity import activity_record
from paperclip.receipts import OWNER_KEY, STOP_PROOF_KEY, OwnerReceipt
from recovery.adapters.identity import ControllerIdentity
from recovery.adapters.platform import current_workspace_worker
from recovery.services.ownership.owner_hold import record_platform_takeover
from recovery.services.ownership.task_current import (
    current_recovery_result_id,
    retained_repair_current,
)


def build_owner(identity: ControllerIdentity) -> dict[str, Any]:
    owner: dict[str, Any] = {
        "token": str(uuid.uuid4()),
        "controllerBootId": identity.boot_id,
        "hostname": identity.hostname,
        "pid": identity.pid,
        "processStartedAt": identity.process_started_at.isoformat(),
    }
    if identity.kernel_boot_id is not None:
        owner["kernelBootId"] = identity.kernel_boot_id
    if identity.process_start_ticks is not None:
        owner["processStartTicks"] = identity.process_start_ticks
    worker = current_workspace_worker()
    if worker is not None:
        owner["worker"] = worker
    return owner


def _cas_claim(
    *,
    company_id: UUID,
    run_id: UUID,
    modes: tuple[str, ...],
    owner: dict[str, Any],
    raw_prior: Any,
    prior: OwnerReceipt | None,
    proof: dict[str, Any] | None,
) -> bool:
    """Compare-and-swap the receipt: ours replaces exactly the prior value we judged."""
    extra = {STOP_PROOF_KEY: proof} if proof is not None else {}
    sql = (
        "UPDATE heartbeat_runs SET runner_profile_json = "
        "jsonb_set(coalesce(runner_profile_json, '{}'::jsonb), %s::text[], %s::jsonb) "
        "|| %s::jsonb, updated_at = now() "
        "WHERE id = %s AND company_id = %s AND runtime_mode = ANY(%s) AND "
    )
    params: list[Any] = [
        [OWNER_KEY],
        json.dumps(owner),
        json.dumps(extra),
        run_id,
        company_id,
        list(modes),
    ]
    if prior is not None:
        sql += "(runner_profile_json -> %s) = %s::jsonb"
        params += [OWNER_KEY, json.dumps(raw_prior)]
    else:
        sql += "(runner_profile_json ->> %s) IS NULL"
        params += [OWNER_KEY]
    with transaction.get_connection().cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


def _audit_claim(
    *,
    company_id: UUID,
    run_id: UUID,
    owner: dict[str, Any],
    prior: OwnerReceipt | None,
    basis: str | None,
) -> None:
    activity_record(
        company_id=company_id,
        actor_type="system",
        actor_id="finalization-controller",
        action="run.finalization_owner_takeover" if prior else "run.finalization_owner_claimed",
        entity_type="heartbeat_run",
        entity_id=run_id,
        run_id=run_id,
        details={
            "owner": owner,
            "priorToken": prior.token if prior else None,
            "takeoverBasis": basis,
        },
    )


def claim_in_tx(
    *,
    company_id: UUID,
    run_id: UUID,
    issue_id: UUID | None,
    modes: tuple[str, ...],
    owner: dict[str, Any],
    raw_prior: Any,
    prior: OwnerReceipt | None,
    proof: dict[str, Any] | None,
    basis: str | None,
    retained_repair_action_id: UUID | None,
    using: str,
) -> tuple[bool, UUID | None]:
    """The receipt compare-and-swap in one durable transaction, audited. A platform stop proof
    proves the worker exited, not that its task is still current: with one, the swap happens
    only while the retained repair (or the run's automatic recovery result) is current,
    rechecked under row locks, and the proof-based takeover is recorded. Returns whether the
    swap happened and the automatic result it was checked against."""
    automatic_result_id: UUID | None = None
    with transaction.atomic(using=using, durable=True):
        current_ok = True
        if proof is not None:
            if issue_id is not None and retained_repair_action_id is not None:
                current_ok = retained_repair_current(
                    company_id=company_id,
                    run_id=run_id,
                    issue_id=issue_id,
                    action_id=retained_repair_action_id,
                )
            else:
                automatic_result_id = current_recovery_result_id(
                    company_id=company_id, run_id=run_id, lock=True
                )
                current_ok = automatic_result_id is not None
        swapped = current_ok and _cas_claim(
            company_id=company_id,
            run_id=run_id,
            modes=modes,
            owner=owner,
            raw_prior=raw_prior,
            prior=prior,
            proof=proof,
        )
        if swapped:
            _audit_claim(
                company_id=company_id, run_id=run_id, owner=owner, prior=prior, basis=basis
            )
            if proof is not None and issue_id is not None:
                record_platform_takeover(
                    company_id=company_id,
                    run_id=run_id,
                    issue_id=issue_id,
                    raw_prior=raw_prior,
                    proof=proof,
                )
    return swapped, automatic_result_id
