"""Why a held finalization waits for the board, in words (the admin's verdict panel).

Mirrors the takeover rules of finalization ownership (docs/recovery.md#owner-unverified-hold)
from the point of view of the process rendering the page: the recorded owner is on another
host, or under this host name but another kernel boot, or on this host and still alive, or on
this host and dead but without the durable copy-back barrier, or a worker whose platform stop
proof is pending. Where it ran is decided by the takeover rule's own `owner_host`, so the page
never calls a process live or dead that the controller would not probe. Reads only (the OS
process table and three rows); never takes a lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from paperclip.ids import parse_uuid
from paperclip.models import HeartbeatRun, WorkspaceOperation
from paperclip.receipts import raw_owner, read_owner
from recovery.adapters.identity import current_controller_identity, evaluate_receipt_takeover
from recovery.models import IssueRecoveryAction, WorkerStopReceipt
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, run_issue_id
from recovery.takeover import owner_host

VerdictKind = Literal[
    "not_an_owner_hold",
    "confirmed",
    "run_missing",
    "owner_changed",
    "receipt_unreadable",
    "platform_proof_pending",
    "foreign_host",
    "other_boot",
    "same_host_alive",
    "same_host_dead_no_barrier",
    "same_host_dead_with_barrier",
]


@dataclass(frozen=True, slots=True)
class OwnerVerdict:
    kind: VerdictKind
    headline: str  # what is true of the recorded owner, in one sentence
    checks: tuple[str, ...]  # what the operator must check before confirming
    confirmable: bool  # whether the confirmation can succeed as things stand


_VERIFY = (
    "Through the deployment platform (not the clock, not a missing database connection): this "
    "exact controller process and every copy-back process it started have exited."
)
_KEEP = (
    "Keep the sandbox, the saved result and the workspace directory; do not start a "
    "replacement run."
)


def owner_hold_verdict(action: IssueRecoveryAction) -> OwnerVerdict:
    """The verdict on the owner recorded by an owner-unverified hold."""
    evidence: Any = action.evidence if isinstance(action.evidence, dict) else {}
    if action.cause != OWNER_UNVERIFIED_CAUSE:
        return OwnerVerdict("not_an_owner_hold", "This action is not an owner hold.", (), False)
    stop = evidence.get("workspaceOwnerStop")
    if isinstance(stop, dict):
        return OwnerVerdict(
            "confirmed",
            f"The board confirmed the owner stopped at {stop.get('confirmedAt')}; the worker "
            "finalizes the saved result.",
            ("Follow the run's finalization state until it is committed.",),
            False,
        )
    recorded = evidence.get("owner")
    run_id = evidence.get("runId")
    run = (
        HeartbeatRun.objects.filter(pk=run_id, company_id=action.company_id).first()
        if isinstance(run_id, str) and _is_uuid(run_id)
        else None
    )
    if run is None:
        return OwnerVerdict("run_missing", "The run this hold names no longer exists.", (), False)
    if raw_owner(run.runner_profile_json) != recorded:
        return OwnerVerdict(
            "owner_changed",
            "The run's current owner receipt is not the one recorded on this hold: the hold "
            "is out of date (a confirmation would be refused as stale).",
            ("Compare the recorded owner with the run's current receipt below.",),
            False,
        )
    receipt = read_owner(recorded)
    if receipt is None:
        return OwnerVerdict(
            "receipt_unreadable",
            "The recorded owner receipt is unreadable (a field is missing or malformed), so "
            "no process can be identified automatically.",
            (_VERIFY, _KEEP),
            True,
        )
    where = f"{receipt.hostname} · PID {receipt.pid}"
    if receipt.worker is not None:
        proved = WorkerStopReceipt.objects.filter(run_id=run.pk, owner_token=receipt.token)
        if not proved.exists():
            return OwnerVerdict(
                "platform_proof_pending",
                f"The owner ({where}) ran as platform worker {receipt.worker.get('id', '?')}; "
                "the platform has not reported it stopped yet (no signed stop receipt).",
                (
                    "Whether the worker platform shows this worker stopped; its signed stop "
                    "receipt lets the next attempt take over by itself.",
                    _VERIFY,
                    _KEEP,
                ),
                True,
            )
    here = current_controller_identity()
    match owner_host(receipt, here):
        case "other_host":
            return OwnerVerdict(
                "foreign_host",
                f"The owner ran on another host ({receipt.hostname}, this server is "
                f"{here.hostname}): its process {receipt.pid} cannot be checked from here.",
                (f"On {receipt.hostname}: {_VERIFY}", _KEEP),
                True,
            )
        case "other_boot":
            return OwnerVerdict(
                "other_boot",
                f"The owner ran on a host named {receipt.hostname} like this server, but under "
                f"another kernel boot ({receipt.kernel_boot_id}, this server is "
                f"{here.kernel_boot_id or 'unknown'}): the host rebooted since, or it is "
                f"another machine of that name, so process {receipt.pid} here proves nothing.",
                (f"On the machine that ran it: {_VERIFY}", _KEEP),
                True,
            )
    decision = evaluate_receipt_takeover(receipt)
    if not decision.allowed:
        return OwnerVerdict(
            "same_host_alive",
            f"The owner ran on this host and its process {receipt.pid} is still alive "
            f"({decision.reason}): a confirmation is refused while it runs.",
            (
                f"What process {receipt.pid} is; stop it (and its copy-back children) first.",
                _KEEP,
            ),
            False,
        )
    issue_id = run_issue_id(run)
    barrier = (
        issue_id is not None
        and WorkspaceOperation.objects.filter(
            company_id=run.company_id,
            heartbeat_run_id=run.pk,
            issue_id=issue_id,
            phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE,
            status=WorkspaceOperation.Status.SUCCEEDED,
        ).exists()
    )
    if barrier:
        return OwnerVerdict(
            "same_host_dead_with_barrier",
            f"The owner ran on this host, its process {receipt.pid} is gone "
            f"({decision.reason}) and a succeeded copy-back barrier exists: the next "
            "finalization attempt takes over by itself.",
            ("Nothing to confirm: finalize now, or wait for the reconciler.",),
            True,
        )
    return OwnerVerdict(
        "same_host_dead_no_barrier",
        f"The owner ran on this host and its process {receipt.pid} is gone "
        f"({decision.reason}), but no succeeded copy-back barrier was recorded: copy-back "
        "children it started may still be running.",
        (
            "That no copy-back process (tar, rsync, cp) of this run is still running on this host.",
            _VERIFY,
            _KEEP,
        ),
        True,
    )


def _is_uuid(value: str) -> bool:
    return parse_uuid(value) is not None
