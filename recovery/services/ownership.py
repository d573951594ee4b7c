"""Finalization ownership (docs/recovery.md#finalization-ownership): one controller at a time
finalizes a run's workspace, and a slow or crashed finalization is never copied over by a second
controller.

Two fences work together:

- a transaction-scoped advisory lock on `native-workspace-finalization:<company>:<run>`, held
  on a dedicated connection (outside Django's) for the whole action. It serializes live
  controllers without holding row locks across copy-back I/O. A keepalive pings that
  connection so `idle_in_transaction_session_timeout` can't end the lock transaction;
- the durable owner receipt in `heartbeat_runs.runner_profile_json ->
  'nativeWorkspaceFinalizationOwner'`, claimed by compare-and-swap. Losing the lock
  connection does not prove that copy-back stopped, so a receipt is only taken over when its
  controller is provably gone: a platform stop proof, same-boot join evidence, or a dead
  same-host process *and* a durable succeeded `workspace_finalize` barrier (a dead parent may
  leave copy children running). Everything else becomes a board-owned recovery action.

There is deliberately no wall-clock timeout that lets anyone take over a slow finalization.
All reads and progress writes go through the ordinary Django connection and commit on their
own; the lock transaction only answers liveness checks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

import psycopg
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.db.models import F, Func, JSONField, Q, Value
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock, dedicated_connection
from paperclip.models import (
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
    WorkspaceOperation,
)
from paperclip.receipts import OWNER_KEY, STOP_PROOF_KEY, OwnerReceipt, raw_owner, read_owner
from recovery.adapters.identity import (
    ControllerIdentity,
    TakeoverDecision,
    current_controller_identity,
    evaluate_receipt_takeover,
)
from recovery.adapters.platform import current_workspace_worker, request_worker_stop_proof
from recovery.canonical import canonical_sha256
from recovery.errors import FinalizationBindingMissing, FinalizationOwnershipLost
from recovery.locks import (
    coordinators_for_update,
    finalization_lock_key,
    issues_for_update,
    recovery_actions_for_update,
    recovery_source_key,
    runs_for_update,
)
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, WAITING_PHASES, run_issue_id
from recovery.services.actions import RecoveryActionInput, upsert_source_scoped_in_tx
from recovery.services.finalization_jobs import finalization_follow_up_in_tx
from recovery.takeover import RecordedOwner, Ruling, owner_host, takeover_ruling

logger = logging.getLogger(__name__)

WaitReason = Literal[
    "busy", "owner_active", "platform_stop_pending", "owner_unverified", "binding_changed"
]

OWNER_UNVERIFIED_NEXT_ACTION = (
    "The previous finalization controller of this run can't be shown to have stopped. Check "
    "through your deployment platform that this exact controller and every workspace "
    'copy-back process it started have exited, then use "Confirm owner stopped and resume '
    'finalization" (admin) or POST /api/issues/{issue_id}/recovery-actions/'
    "resume-workspace-finalization with the stop evidence. That releases only this owner "
    "receipt; the saved result is then finalized without another provider turn. Do not start "
    "a replacement run and do not delete workspace files."
)

# Keepalive cadence: well inside the server's idle-in-transaction timeout.
_KEEPALIVE_FRACTION = 3
_KEEPALIVE_MIN_SECONDS = 0.02
_KEEPALIVE_MAX_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Acquired[T]:
    value: T
    acquired: Literal[True] = True


@dataclass(frozen=True, slots=True)
class NotAcquired:
    reason: WaitReason
    acquired: Literal[False] = False


# Process-local memory (docs/recovery.md#process-local-owner-memory), guarded by one mutex:
# tokens whose action is running in this process, the run key each token owns (with the
# database alias: a token joins only within the same database), and tokens whose action finished but
# whose receipt removal could not be confirmed: positive evidence that lets this same boot take them
# over.
_state = threading.Lock()
_active_owner_tokens: set[str] = set()
_active_run_owners: dict[str, tuple[str, str]] = {}
_joined_owner_tokens: set[str] = set()

# Test hook: called between reading the prior receipt and the compare-and-swap claim.
before_claim_hook: Callable[[], None] | None = None


def owner_fingerprint(run_id: UUID | str, raw_prior: Any) -> str:
    """Identity of an owner-unverified hold: sha256 of canonical `{runId, owner}`."""
    return canonical_sha256({"runId": str(run_id), "owner": raw_prior})


class _LockSession:
    """The dedicated lock connection. psycopg connections are not for concurrent use, so the
    keepalive thread and `assert_held` share it under a mutex."""

    def __init__(self, conn: psycopg.Connection[Any], idle_timeout_ms: int | None) -> None:
        self._conn = conn
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self.failure: BaseException | None = None
        self.backend_pid = conn.info.backend_pid
        self.interval: float | None = None
        if idle_timeout_ms:
            seconds = idle_timeout_ms / 1000 / _KEEPALIVE_FRACTION
            self.interval = min(max(seconds, _KEEPALIVE_MIN_SECONDS), _KEEPALIVE_MAX_SECONDS)

    def ping(self) -> None:
        with self._mutex:
            self._conn.execute("SELECT 1").fetchone()

    def _keepalive_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.ping()
            except Exception as exc:  # the next assert_held reports it
                self.failure = exc
                return

    @contextmanager
    def keepalive(self) -> Iterator[None]:
        thread = None
        if self.interval is not None:
            thread = threading.Thread(
                target=self._keepalive_loop,
                args=(self.interval,),
                name="finalization-lock-keepalive",
                daemon=True,
            )
            thread.start()
        try:
            yield
        finally:
            self._stop.set()
            if thread is not None:
                thread.join(timeout=5)

    def end(self) -> None:
        """Roll back the lock transaction, releasing the advisory lock."""
        # A dead connection has already lost the lock; nothing to roll back then.
        with self._mutex, contextlib.suppress(psycopg.Error):
            self._conn.rollback()


class FinalizationOwnership:
    """The handle passed to the action. `assert_held()` rechecks the lock connection, our
    receipt and (after a platform-proof takeover) the recovery result."""

    def __init__(
        self,
        *,
        company_id: UUID,
        run_id: UUID,
        token: str,
        session: _LockSession,
        binding_current: Callable[[], bool] | None,
        using: str,
    ) -> None:
        self.company_id = company_id
        self.run_id = run_id
        self.token = token
        self._session = session
        # After a platform-proof takeover: is the task we resumed still the current one?
        self._binding_current = binding_current
        self._using = using

    @property
    def lock_backend_pid(self) -> int:
        return self._session.backend_pid

    def assert_held(self) -> None:
        """Raise FinalizationOwnershipLost unless we still hold the lock and the receipt."""
        try:
            if self._session.failure is not None:
                raise FinalizationOwnershipLost("lock_connection_lost") from self._session.failure
            # A failed lock transaction is never reconnected: it would be a new, unlocked one.
            self._session.ping()
        except FinalizationOwnershipLost:
            raise
        except Exception as exc:
            raise FinalizationOwnershipLost("lock_connection_lost") from exc
        try:
            still_owner = receipt_is_ours(
                company_id=self.company_id, run_id=self.run_id, token=self.token, using=self._using
            )
            recheck = self._binding_current
            task_current = recheck() if recheck is not None and still_owner else True
        except Exception as exc:
            raise FinalizationOwnershipLost("database_unavailable") from exc
        if not still_owner:
            raise FinalizationOwnershipLost("owner_replaced")
        if not task_current:
            raise FinalizationOwnershipLost("task_replaced")


def receipt_is_ours(
    *, company_id: UUID, run_id: UUID, token: str, using: str = DEFAULT_DB_ALIAS
) -> bool:
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM heartbeat_runs WHERE id = %s AND company_id = %s"
            " AND runner_profile_json -> %s ->> 'token' = %s",
            [run_id, company_id, OWNER_KEY, token],
        )
        return cursor.fetchone() is not None


def _holder_reason(run_key: str, using: str) -> WaitReason:
    with _state:
        holder = _active_run_owners.get(run_key)
    return "owner_active" if holder is not None and holder[1] == using else "busy"


def _copyback_barrier_exists(*, company_id: UUID, run_id: UUID, issue_id: UUID) -> bool:
    return WorkspaceOperation.objects.filter(
        company_id=company_id,
        heartbeat_run_id=run_id,
        issue_id=issue_id,
        phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
        status=WorkspaceOperation.Status.SUCCEEDED,
    ).exists()


def _current_recovery_result_id(
    *, company_id: UUID, run_id: UUID, lock: bool, committed_ok: bool = False
) -> UUID | None:
    """The accepted result still waiting for this run's finalization, or None when the task
    moved on. With `lock`, rows are locked in the global order (issue → coordinator → run).
    `committed_ok`: a coordinator that committed this very result still counts (the owner's
    own action commits it before the final `assert_held`)."""
    run = HeartbeatRun.objects.filter(pk=run_id, company_id=company_id).first()
    issue_id = run_issue_id(run) if run is not None else None
    if run is None or issue_id is None:
        return None
    issues = issues_for_update() if lock else Issue.objects.all()
    coordinators = coordinators_for_update() if lock else NativeRunFinalization.objects.all()
    runs = runs_for_update() if lock else HeartbeatRun.objects.all()
    issue = issues.filter(pk=issue_id, company_id=company_id).first()
    coordinator = coordinators.filter(run_id=run_id, company_id=company_id).first()
    current_run = runs.filter(pk=run_id, company_id=company_id).first()
    if issue is None or coordinator is None or current_run is None:
        return None
    if coordinator.issue_id != issue.pk or coordinator.result_id is None:
        return None
    phases: tuple[str, ...] = (*WAITING_PHASES, "retryable_failure")
    if committed_ok:
        phases += (NativeRunFinalization.Phase.COMMITTED,)
    if coordinator.phase not in phases:
        return None
    # Another run holding the issue now does not replace this one's saved result: a later run
    # takes the slots of a run whose result was accepted, whose finalization still waits.
    accepted = NativeRunResult.objects.filter(
        pk=coordinator.result_id,
        company_id=company_id,
        issue_id=issue.pk,
        run_id=run_id,
        schema_status=NativeRunResult.SchemaStatus.ACCEPTED,
    ).exists()
    return coordinator.result_id if accepted else None


def _retained_repair_current(
    *, company_id: UUID, run_id: UUID, issue_id: UUID, action_id: UUID, lock: bool = True
) -> bool:
    """Retained repair (docs/recovery.md#retained-repair): the repair action still names this
    terminal run, no controller lease is live, and no other run holds the issue (except the
    independent continuation run recorded on the action). With `lock`, rows are locked in the global
    order (issue → coordinator → run → action)."""
    issues = issues_for_update() if lock else Issue.objects.all()
    coordinators = coordinators_for_update() if lock else NativeRunFinalization.objects.all()
    runs = runs_for_update() if lock else HeartbeatRun.objects.all()
    actions = recovery_actions_for_update() if lock else IssueRecoveryAction.objects.all()
    issue = issues.filter(pk=issue_id, company_id=company_id).first()
    coordinator = coordinators.filter(run_id=run_id, company_id=company_id).first()
    run = runs.filter(pk=run_id, company_id=company_id).first()
    repair = actions.filter(pk=action_id, company_id=company_id, source_issue_id=issue_id).first()
    if issue is None or run is None or repair is None:
        return False
    evidence = repair.evidence if isinstance(repair.evidence, dict) else {}
    continuation = evidence.get("explicitUserContinuation")
    independent: str | None = None
    if isinstance(continuation, dict):
        readiness = continuation.get("readiness")
        if (
            isinstance(readiness, dict)
            and readiness.get("mode") == "fresh_isolated_workspace"
            and readiness.get("sourceRunId") == str(run_id)
            and isinstance(continuation.get("runId"), str)
        ):
            independent = continuation["runId"]
    allowed_holders = {None, independent}
    return (
        evidence.get("runId") == str(run.pk)
        and bool(evidence.get("workspaceRecovery"))
        and (coordinator is None or not coordinator.lease_owner)
        and run.status in HeartbeatRun.TERMINAL_STATUSES
        and (str(issue.execution_run_id) if issue.execution_run_id else None) in allowed_holders
        and (str(issue.checkout_run_id) if issue.checkout_run_id else None) in allowed_holders
    )


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


def _require_stop_verification(
    *,
    company_id: UUID,
    run_id: UUID,
    issue_id: UUID | None,
    agent_id: UUID,
    raw_prior: Any,
    retained: bool,
    platform_pending: bool,
) -> NotAcquired:
    """docs/recovery.md#owner-unverified-hold: record (or restore) the board-owned owner-unverified
    hold."""
    if retained:
        return NotAcquired("owner_unverified")
    reason: WaitReason = "platform_stop_pending" if platform_pending else "owner_unverified"
    if issue_id is None:
        return NotAcquired(reason)
    fingerprint = owner_fingerprint(run_id, raw_prior)
    with transaction.atomic(durable=True):
        advisory_xact_lock(recovery_source_key(company_id, issue_id))
        # The run's own live hold (other runs' holds of the issue are theirs).
        existing = (
            IssueRecoveryAction.objects.filter(
                company_id=company_id, cause=OWNER_UNVERIFIED_CAUSE, status__in=LIVE_STATUSES
            )
            .filter(Q(held_run_id=run_id) | Q(held_run__isnull=True, evidence__runId=str(run_id)))
            .order_by("-updated_at", "-id")
            .first()
        )
        if (
            existing is not None
            and existing.cause == OWNER_UNVERIFIED_CAUSE
            and existing.fingerprint == fingerprint
        ):
            # Rechecking the same physical owner is not a new recovery attempt: restore the
            # copy-back instructions and the operator_required state, spend nothing.
            with transaction.get_connection().cursor() as cursor:
                cursor.execute(
                    "UPDATE issue_recovery_actions SET next_action = %s, "
                    "evidence = jsonb_set(coalesce(evidence, '{}'::jsonb), "
                    "'{workspaceOwnerRecovery}', '{\"state\": \"operator_required\"}'::jsonb), "
                    "updated_at = now() "
                    "WHERE company_id = %s AND id = %s AND fingerprint = %s AND cause = %s "
                    "AND status IN ('active', 'escalated') "
                    "AND evidence -> 'workspaceOwnerStop' IS NULL "
                    "AND (next_action IS DISTINCT FROM %s OR "
                    "evidence #>> '{workspaceOwnerRecovery,state}' "
                    "IS DISTINCT FROM 'operator_required')",
                    [
                        OWNER_UNVERIFIED_NEXT_ACTION,
                        company_id,
                        existing.pk,
                        fingerprint,
                        OWNER_UNVERIFIED_CAUSE,
                        OWNER_UNVERIFIED_NEXT_ACTION,
                    ],
                )
                restored = cursor.rowcount
            if restored:
                activity_record(
                    company_id=company_id,
                    actor_type="system",
                    actor_id="finalization-controller",
                    action="recovery_action.owner_hold_restored",
                    entity_type="issue_recovery_action",
                    entity_id=existing.pk,
                    run_id=run_id,
                    details={"fingerprint": fingerprint},
                )
            return NotAcquired(reason)
        upsert_source_scoped_in_tx(
            company_id=company_id,
            source_issue_id=issue_id,
            data=RecoveryActionInput(
                kind=IssueRecoveryAction.Kind.ACTIVE_RUN_WATCHDOG,
                owner_type=IssueRecoveryAction.OwnerType.BOARD,
                return_owner_agent_id=agent_id,
                cause=OWNER_UNVERIFIED_CAUSE,
                fingerprint=fingerprint,
                evidence={
                    "runId": str(run_id),
                    "owner": raw_prior,
                    "workspaceOwnerRecovery": {"state": "operator_required"},
                },
                next_action=OWNER_UNVERIFIED_NEXT_ACTION,
                wake_policy=None,
                max_attempts=1,
                supersede_on_identity_change=True,
                held_run_id=run_id,
            ),
            actor_id="finalization-controller",
        )
    return NotAcquired(reason)


def _build_owner(identity: ControllerIdentity) -> dict[str, Any]:
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
    owner = _build_owner(identity)
    run_key = finalization_lock_key(company_id, run_id)
    with dedicated_connection(using=using, application_name="paperclip-finalization-lock") as conn:
        row = conn.execute(
            "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0)), "
            "(SELECT setting::bigint FROM pg_settings "
            "WHERE name = 'idle_in_transaction_session_timeout')",
            [run_key],
        ).fetchone()
        session = _LockSession(conn, int(row[1]) if row and row[1] is not None else None)
        try:
            if not row or row[0] is not True:
                if retained_repair_action_id is not None:
                    return NotAcquired("busy")
                return NotAcquired(_holder_reason(run_key, using))
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


@dataclass(frozen=True, slots=True)
class _PriorJudged:
    ruling: Ruling
    proof: dict[str, Any] | None  # the platform's verified stop proof, when it was asked
    platform_pending: bool  # the platform has not reported the recorded worker stopped yet


def _judge_prior(
    *,
    company_id: UUID,
    run_id: UUID,
    issue_id: UUID | None,
    prior: OwnerReceipt | None,
    identity: ControllerIdentity,
) -> _PriorJudged:
    """The takeover rule (recovery/takeover.py) applied to the owner a run's receipt records,
    with this process's probes: the platform's stop proof, the OS process table and the
    copy-back barrier, each asked only when the rule reaches it."""
    same_host = prior is not None and owner_host(prior, identity) == "this_host"
    same_process = (
        same_host
        and prior is not None
        and prior.controller_boot_id == identity.boot_id
        and prior.pid == identity.pid
    )
    with _state:
        live_here = prior is not None and prior.token in _active_owner_tokens
        joined_here = prior is not None and prior.token in _joined_owner_tokens
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
        return issue_id is not None and _copyback_barrier_exists(
            company_id=company_id, run_id=run_id, issue_id=issue_id
        )

    ruling = takeover_ruling(
        RecordedOwner(
            readable=prior is not None,
            same_host=same_host,
            same_process=same_process,
            live_here=live_here,
            joined_here=joined_here,
        ),
        stop_proof=stop_proof_verified,
        process=process_check,
        copyback_barrier=copyback_barrier,
    )
    return _PriorJudged(ruling, proof, platform_pending)


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
    session: _LockSession,
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

    def require_stop_verification() -> NotAcquired:
        return _require_stop_verification(
            company_id=company_id,
            run_id=run_id,
            issue_id=issue_id,
            agent_id=run.agent_id,
            raw_prior=raw_prior,
            retained=retained,
            platform_pending=platform_pending,
        )

    if raw_prior is not None:
        judged = _judge_prior(
            company_id=company_id, run_id=run_id, issue_id=issue_id, prior=prior, identity=identity
        )
        proof, platform_pending = judged.proof, judged.platform_pending
        if judged.ruling.verdict == "own_action_live":
            # Our own live action whose lock connection died: still fenced by its receipt.
            return NotAcquired("owner_unverified" if retained else _holder_reason(run_key, using))
        if judged.ruling.verdict == "verify_stop":
            return require_stop_verification()
        basis = judged.ruling.basis

    token: str = owner["token"]
    # Remember the token before the write: if the commit reply is lost, cleanup still knows
    # which receipt is ours.
    with _state:
        _active_owner_tokens.add(token)
        _active_run_owners[run_key] = (token, using)
    claimed = True
    try:
        if before_claim_hook is not None:
            before_claim_hook()
        swapped, automatic_result_id = _claim_in_tx(
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
            with _state:
                _active_owner_tokens.discard(token)
                if _active_run_owners.get(run_key, ("", ""))[0] == token:
                    del _active_run_owners[run_key]
            claimed = False
            return NotAcquired("binding_changed")
        if prior is not None:
            with _state:
                _joined_owner_tokens.discard(prior.token)
        binding_current = _binding_recheck(
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
            _release_receipt(company_id=company_id, run_id=run_id, token=token, run_key=run_key)


def _claim_in_tx(
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
                current_ok = _retained_repair_current(
                    company_id=company_id,
                    run_id=run_id,
                    issue_id=issue_id,
                    action_id=retained_repair_action_id,
                )
            else:
                automatic_result_id = _current_recovery_result_id(
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
                _record_platform_takeover(
                    company_id=company_id,
                    run_id=run_id,
                    issue_id=issue_id,
                    raw_prior=raw_prior,
                    proof=proof,
                )
    return swapped, automatic_result_id


def _binding_recheck(
    *,
    company_id: UUID,
    run_id: UUID,
    issue_id: UUID | None,
    proof_used: bool,
    retained_repair_action_id: UUID | None,
    automatic_result_id: UUID | None,
    using: str,
) -> Callable[[], bool] | None:
    """What `assert_held` rechecks after a platform-proof takeover (docs/recovery.md#assert-held):
    the stop receipt proved the old worker exited, not that its task is still current."""
    if not proof_used:
        return None
    if retained_repair_action_id is not None and issue_id is not None:
        repair_id = retained_repair_action_id

        def repair_current() -> bool:
            with transaction.atomic(using=using):
                return _retained_repair_current(
                    company_id=company_id,
                    run_id=run_id,
                    issue_id=issue_id,
                    action_id=repair_id,
                    lock=False,
                )

        return repair_current

    def result_current() -> bool:
        with transaction.atomic(using=using):
            current = _current_recovery_result_id(
                company_id=company_id, run_id=run_id, lock=False, committed_ok=True
            )
        return current is not None and current == automatic_result_id

    return result_current


def _record_platform_takeover(
    *, company_id: UUID, run_id: UUID, issue_id: UUID, raw_prior: Any, proof: dict[str, Any]
) -> None:
    activity_record(
        company_id=company_id,
        actor_type="system",
        actor_id="workspace-recovery",
        action="issue.workspace_owner_stop_verified",
        entity_type="issue",
        entity_id=issue_id,
        run_id=run_id,
        details={"proof": proof},
    )
    IssueRecoveryAction.objects.filter(
        company_id=company_id,
        source_issue_id=issue_id,
        cause=OWNER_UNVERIFIED_CAUSE,
        fingerprint=owner_fingerprint(run_id, raw_prior),
        status__in=LIVE_STATUSES,
    ).update(evidence=_jsonb_set_state("resuming"), updated_at=Now())


def _jsonb_set_state(state: str) -> Func:
    """`jsonb_set(coalesce(evidence, '{}'), '{workspaceOwnerRecovery}', {"state": state})`."""
    return Func(
        Func(F("evidence"), Value({}, output_field=JSONField()), function="coalesce"),
        Value("{workspaceOwnerRecovery}"),
        Value({"state": state}, output_field=JSONField()),
        function="jsonb_set",
        output_field=JSONField(),
    )


def _release_receipt(*, company_id: UUID, run_id: UUID, token: str, run_key: str) -> None:
    """Remove only our receipt while the lock is still held (so no other controller can see a
    finished owner's receipt and raise a needless hold). On failure keep same-boot join
    evidence: only this boot may then take the receipt over without proof."""
    with _state:
        _active_owner_tokens.discard(token)
        if _active_run_owners.get(run_key, ("", ""))[0] == token:
            del _active_run_owners[run_key]
        _joined_owner_tokens.add(token)
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
    with _state:
        _joined_owner_tokens.discard(token)


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
            with _state:
                if token not in _joined_owner_tokens:
                    return  # taken over in this process meanwhile
            try:
                _remove_receipt(company_id=company_id, run_id=run_id, token=token)
            except Exception as exc:
                logger.warning("receipt %s of run %s: still not removed (%s)", token, run_id, exc)
                connections[DEFAULT_DB_ALIAS].close()
                continue
            with _state:
                _joined_owner_tokens.discard(token)
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
