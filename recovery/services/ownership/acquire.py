"""`with_finalization_ownership`: the run's only finalization owner runs the action, or is
told why it may not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

from django.db import DEFAULT_DB_ALIAS, connections

from paperclip.db.advisory import dedicated_connection
from paperclip.models import HeartbeatRun
from paperclip.receipts import raw_owner, read_owner
from recovery.adapters.identity import ControllerIdentity, current_controller_identity
from recovery.errors import FinalizationBindingMissing
from recovery.locks import finalization_lock_key
from recovery.selectors.actions import run_issue_id
from recovery.services.ownership.lock_connection import FinalizationOwnership, LockSession
from recovery.services.ownership.memory import (
    active_owner_tokens,
    active_run_owners,
    holder_reason,
    joined_owner_tokens,
    memory_lock,
)
from recovery.services.ownership.outcomes import Acquired, NotAcquired
from recovery.services.ownership.owner_hold import require_stop_verification
from recovery.services.ownership.prior_owner import judge_prior
from recovery.services.ownership.receipt_claim import build_owner, claim_in_tx
from recovery.services.ownership.receipt_release import release_receipt
from recovery.services.ownership.task_current import binding_recheck

# Test hook: called between reading the prior receipt and the compare-and-swap claim.
before_claim_hook: Callable[[], None] | None = None


def with_finalization_ownership[T](
    *,
    company_id: UUID,
    run_id: UUID,
    action: Callable[[FinalizationOwnership], T],
    retained_repair_action_id: UUID | None = None,
    using: str = DEFAULT_DB_ALIAS,
) -> Acquired[T] | NotAcquired:
    """Run `action` as the run's only finalization owner, or say why we may not.

    Takes `pg_try_advisory_xact_lock` on the finalization key in a transaction on a dedicated
    connection (kept alive for the whole action), then claims the durable owner receipt by
    compare-and-swap. NotAcquired reasons: `busy` (another process holds the lock),
    `owner_active` (this process is finalizing the run), `owner_unverified` (a prior owner
    can't be shown to have stopped: a board-owned recovery action is recorded),
    `platform_stop_pending` (the worker platform hasn't reported the prior worker stopped),
    `binding_changed` (the receipt changed between our read and our swap).

    Must be called outside any transaction: progress writes commit on their own. Raises
    FinalizationBindingMissing for a run that isn't a native run of the company; the action's
    own exceptions (FinalizationOwnershipLost included) propagate after our receipt is removed.
    """
    if connections[using].in_atomic_block:
        raise RuntimeError(
            "with_finalization_ownership() must run outside transaction.atomic(): "
            "its progress writes commit on their own"
        )
    identity = current_controller_identity()
    owner = build_owner(identity)
    run_key = finalization_lock_key(company_id, run_id)
    with dedicated_connection(using=using, application_name="paperclip-finalization-lock") as conn:
        row = conn.execute(
            "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0)), "
            "(SELECT setting::bigint FROM pg_settings "
            "WHERE name = 'idle_in_transaction_session_timeout')",
            [run_key],
        ).fetchone()
        session = LockSession(conn, int(row[1]) if row and row[1] is not None else None)
        try:
            if not row or row[0] is not True:
                if retained_repair_action_id is not None:
                    return NotAcquired("busy")
                return NotAcquired(holder_reason(run_key, using))
            with session.keepalive():
                return _run_owned(
                    company_id=company_id,
                    run_id=run_id,
                    action=action,
                    retained_repair_action_id=retained_repair_action_id,
                    using=using,
                    identity=identity,
                    owner=owner,
                    run_key=run_key,
                    session=session,
                )
        finally:
            session.end()


def _run_owned[T](
    *,
    company_id: UUID,
    run_id: UUID,
    action: Callable[[FinalizationOwnership], T],
    retained_repair_action_id: UUID | None,
    using: str,
    identity: ControllerIdentity,
    owner: dict[str, Any],
    run_key: str,
    session: LockSession,
) -> Acquired[T] | NotAcquired:
    retained = retained_repair_action_id is not None
    modes: tuple[str, ...] = ("native", "legacy") if retained else ("native",)
    run = HeartbeatRun.objects.filter(
        pk=run_id, company_id=company_id, runtime_mode__in=modes
    ).first()
    if run is None:
        raise FinalizationBindingMissing(run_id=str(run_id))
    issue_id = run_issue_id(run)
    raw_prior = raw_owner(run.runner_profile_json)
    prior = read_owner(raw_prior)
    proof: dict[str, Any] | None = None
    platform_pending = False
    basis: str | None = None

    def hold_for_the_board() -> NotAcquired:
        return require_stop_verification(
            company_id=company_id,
            run_id=run_id,
            issue_id=issue_id,
            agent_id=run.agent_id,
            raw_prior=raw_prior,
            retained=retained,
            platform_pending=platform_pending,
        )

    if raw_prior is not None:
        judged = judge_prior(
            company_id=company_id, run_id=run_id, issue_id=issue_id, prior=prior, identity=identity
        )
        proof, platform_pending = judged.proof, judged.platform_pending
        if judged.ruling.verdict == "own_action_live":
            # Our own live action whose lock connection died: still fenced by its receipt.
            return NotAcquired("owner_unverified" if retained else holder_reason(run_key, using))
        if judged.ruling.verdict == "verify_stop":
            return hold_for_the_board()
        basis = judged.ruling.basis

    token: str = owner["token"]
    # Remember the token before the write: if the commit reply is lost, cleanup still knows
    # which receipt is ours.
    with memory_lock:
        active_owner_tokens.add(token)
        active_run_owners[run_key] = (token, using)
    claimed = True
    try:
        if before_claim_hook is not None:
            before_claim_hook()
        swapped, automatic_result_id = claim_in_tx(
            company_id=company_id,
            run_id=run_id,
            issue_id=issue_id,
            modes=modes,
            owner=owner,
            raw_prior=raw_prior,
            prior=prior,
            proof=proof,
            basis=basis,
            retained_repair_action_id=retained_repair_action_id,
            using=using,
        )
        if not swapped:
            with memory_lock:
                active_owner_tokens.discard(token)
                if active_run_owners.get(run_key, ("", ""))[0] == token:
                    del active_run_owners[run_key]
            claimed = False
            return NotAcquired("binding_changed")
        if prior is not None:
            with memory_lock:
                joined_owner_tokens.discard(prior.token)
        binding_current = binding_recheck(
            company_id=company_id,
            run_id=run_id,
            issue_id=issue_id,
            proof_used=proof is not None,
            retained_repair_action_id=retained_repair_action_id,
            automatic_result_id=automatic_result_id,
            using=using,
        )
        ownership = FinalizationOwnership(
            company_id=company_id,
            run_id=run_id,
            token=token,
            session=session,
            binding_current=binding_current,
            using=using,
        )
        ownership.assert_held()
        value = action(ownership)
        ownership.assert_held()
        return Acquired(value)
    finally:
        if claimed:
            release_receipt(company_id=company_id, run_id=run_id, token=token, run_key=run_key)
