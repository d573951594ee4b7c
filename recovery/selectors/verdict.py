"""Why a held finalization waits for the board, in words (the admin's verdict panel).

Calls the takeover rule of finalization ownership itself (`recovery/takeover.py`,
docs/recovery.md#owner-unverified-hold) on the evidence the controller reads, from the point of
view of the process rendering the page: the recorded owner as `recorded_owner` sees it, the
platform's signed stop receipt, the OS process table and the durable copy-back barrier; then
says the ruling in words: on another host, or under this host name but another kernel boot, or
on this host and still alive, or dead but without the barrier, or a worker whose platform stop
proof is pending; or that it has stopped (the board confirms it, or, for a platform worker,
the attempt the reconciler queues takes over by itself). Reads only (the OS process
table and a few rows); never takes a lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from paperclip.ids import parse_uuid
from paperclip.models import HeartbeatRun
from paperclip.receipts import OwnerReceipt, raw_owner, read_owner
from recovery.adapters.identity import (
    ControllerIdentity,
    TakeoverDecision,
    current_controller_identity,
    evaluate_receipt_takeover,
)
from recovery.models import IssueRecoveryAction, WorkerStopReceipt
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, run_issue_id
from recovery.services.ownership.prior_owner import copyback_barrier_exists, recorded_owner
from recovery.takeover import Ruling, Verdict, owner_host, takeover_ruling

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
    "platform_proved",
    "joined_here",
    "own_action_live",
]
# The takeover rule's verdict each kind stands for (tests/console/test_verdict.py checks that
# the page and the rule agree on every combination of evidence).
RULE_VERDICT: dict[VerdictKind, Verdict] = {
    "receipt_unreadable": "verify_stop",
    "platform_proof_pending": "verify_stop",
    "foreign_host": "verify_stop",
    "other_boot": "verify_stop",
    "same_host_alive": "verify_stop",
    "same_host_dead_no_barrier": "verify_stop",
    "same_host_dead_with_barrier": "take_over",
    "platform_proved": "take_over",
    "joined_here": "take_over",
    "own_action_live": "own_action_live",
}


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
            "no longer holds the run (a confirmation would be refused as stale). The next "
            "finalization attempt meets the current receipt: it commits the saved result, "
            "which resolves this hold, or holds the run for that owner, which replaces it.",
            (
                "Nothing to confirm here: follow the run's finalization state (finalize now, "
                "or wait for the reconciler).",
                "Compare the recorded owner with the run's current receipt below.",
            ),
            False,
        )
    receipt = read_owner(recorded)
    here = current_controller_identity()
    issue_id = run_issue_id(run)
    proved = (
        receipt is not None
        and receipt.worker is not None
        and (WorkerStopReceipt.objects.filter(run_id=run.pk, owner_token=receipt.token).exists())
    )
    decisions: list[TakeoverDecision] = []

    def process() -> TakeoverDecision:
        if receipt is None:  # never probed so: the rule asks only about a readable receipt
            return TakeoverDecision(False, "controller_identity_missing")
        decisions.append(evaluate_receipt_takeover(receipt))
        return decisions[0]

    ruling = takeover_ruling(
        recorded_owner(receipt, here),
        stop_proof=lambda: proved,
        process=process,
        copyback_barrier=lambda: (
            issue_id is not None
            and copyback_barrier_exists(company_id=run.company_id, run_id=run.pk, issue_id=issue_id)
        ),
    )
    return verdict_of_ruling(ruling, receipt, here, decisions[0] if decisions else None)


def verdict_of_ruling(
    ruling: Ruling,
    receipt: OwnerReceipt | None,
    here: ControllerIdentity,
    decision: TakeoverDecision | None,
) -> OwnerVerdict:
    """The takeover rule's ruling on a hold's recorded owner, in words for the board."""
    if receipt is None or ruling.why == "receipt_unreadable":
        return OwnerVerdict(
            "receipt_unreadable",
            "The recorded owner receipt is unreadable (a field is missing or malformed), so "
            "no process can be identified automatically.",
            (_VERIFY, _KEEP),
            True,
        )
    where = f"{receipt.hostname} · PID {receipt.pid}"
    reason = decision.reason if decision is not None else "not probed"
    if ruling.verdict == "own_action_live":
        return OwnerVerdict(
            "own_action_live",
            f"The owner ({where}) is this very process and its finalization still runs here.",
            ("Wait for it to end; nothing to confirm.",),
            False,
        )
    if ruling.verdict == "take_over":
        return _taken_over(ruling, receipt, where, reason)
    if receipt.worker is not None:
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
    if ruling.why == "not_this_host":
        return _elsewhere(receipt, here)
    if ruling.why == "process_alive":
        return OwnerVerdict(
            "same_host_alive",
            f"The owner ran on this host and its process {receipt.pid} is still alive "
            f"({reason}): a confirmation is refused while it runs.",
            (
                f"What process {receipt.pid} is; stop it (and its copy-back children) first.",
                _KEEP,
            ),
            False,
        )
    return OwnerVerdict(
        "same_host_dead_no_barrier",
        f"The owner ran on this host and its process {receipt.pid} is gone "
        f"({reason}), but no succeeded copy-back barrier was recorded: copy-back "
        "children it started may still be running.",
        (
            "That no copy-back process (tar, rsync, cp) of this run is still running on this host.",
            _VERIFY,
            _KEEP,
        ),
        True,
    )


def _taken_over(ruling: Ruling, receipt: OwnerReceipt, where: str, reason: str) -> OwnerVerdict:
    """The rule would let a finalization attempt take the owner over by itself. While the hold
    is live, only a platform-proof takeover gets that attempt (the reconciler defers a job for
    a run whose owner was a platform worker); otherwise `finalize` is refused as held and the
    reconciler skips the run, so the board confirms."""
    if ruling.basis == "platform_stop_proof":
        worker = receipt.worker.get("id", "?") if receipt.worker is not None else "?"
        return OwnerVerdict(
            "platform_proved",
            f"The owner ({where}) ran as platform worker {worker}, and the platform reported "
            "it stopped (a signed stop receipt): the attempt the reconciler queues on its next "
            "pass takes over by itself.",
            (
                "Nothing to confirm: wait for the reconciler (finalize is refused while this "
                "hold is live); to resume sooner, confirm the owner stopped.",
            ),
            True,
        )
    confirm = (
        "Confirm the owner stopped to resume finalization: while this hold is live nothing "
        "queues an attempt (finalize is refused as held, the reconciler skips the run)."
    )
    if ruling.basis == "same_boot_joined":
        return OwnerVerdict(
            "joined_here",
            f"The owner ({where}) is this very process and its finalization already ended "
            "here (its receipt was left behind): it has stopped.",
            (confirm,),
            True,
        )
    return OwnerVerdict(
        "same_host_dead_with_barrier",
        f"The owner ran on this host, its process {receipt.pid} is gone "
        f"({reason}) and a succeeded copy-back barrier exists: it has stopped, and no "
        "copy-back of it is left running.",
        (confirm,),
        True,
    )


def _elsewhere(receipt: OwnerReceipt, here: ControllerIdentity) -> OwnerVerdict:
    """The owner ran under another host name, or this name but another kernel boot."""
    if owner_host(receipt, here) == "other_host":
        return OwnerVerdict(
            "foreign_host",
            f"The owner ran on another host ({receipt.hostname}, this server is "
            f"{here.hostname}): its process {receipt.pid} cannot be checked from here.",
            (f"On {receipt.hostname}: {_VERIFY}", _KEEP),
            True,
        )
    return OwnerVerdict(
        "other_boot",
        f"The owner ran on a host named {receipt.hostname} like this server, but under "
        f"another kernel boot ({receipt.kernel_boot_id}, this server is "
        f"{here.kernel_boot_id or 'unknown'}): the host rebooted since, or it is "
        f"another machine of that name, so process {receipt.pid} here proves nothing.",
        (f"On the machine that ran it: {_VERIFY}", _KEEP),
        True,
    )


def _is_uuid(value: str) -> bool:
    return parse_uuid(value) is not None
