"""The takeover rule of finalization ownership (docs/recovery.md#owner-unverified-hold): may
this controller take over a run whose receipt names another owner, and on what basis?

- the recorded owner is this very process and its action still runs here: no (it is still
  fenced by its receipt);
- the worker platform proved, with a signed stop receipt, that the recorded worker stopped:
  yes, on that proof;
- the receipt is unreadable, or names another host without such a proof: no, the board must
  verify the stop. "This host" means this host name *and* this kernel boot (`owner_host`):
  under the same name but another boot, the recorded PID may have been reused since a reboot,
  or belong to another machine of that name, so it is never probed here;
- the recorded owner is this process and its action was joined here (it finished, its
  receipt was left behind): yes;
- otherwise (this host): only if its process is dead or its PID was recycled, and the durable
  copy-back barrier (this run's succeeded finalize operation) proves its copy children
  finished.

Pure: it reads nothing itself. The three facts that cost a call (the platform's stop proof,
the OS process table, the barrier row) come as probes, called only when the rule reaches them,
at most once each; the tests hand it plain values (tests/recovery/test_takeover.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from paperclip.receipts import OwnerReceipt
from recovery.adapters.identity import ControllerIdentity, TakeoverDecision

Verdict = Literal["own_action_live", "verify_stop", "take_over"]
# Why the board must verify the stop (with verify_stop): the receipt is unreadable, it names
# another host or boot (with no platform proof), its same-host process is still alive, or it is
# gone but no durable copy-back barrier proves its copy children finished.
StopReason = Literal["receipt_unreadable", "not_this_host", "process_alive", "no_copyback_barrier"]
HostMatch = Literal["this_host", "other_host", "other_boot"]


def owner_host(owner: OwnerReceipt, here: ControllerIdentity) -> HostMatch:
    """Where the recorded owner ran, seen from `here`: only `this_host` lets its PID be probed
    locally (docs/recovery.md#controller-identity).

    - another host name: `other_host`;
    - the same name and the same kernel boot id: `this_host`;
    - the same name but another kernel boot id, or one `here` can't read: `other_boot`. The
      PID may have been reused after a reboot, or name a process of another machine of that
      name; nothing local can prove the recorded process stopped;
    - the same name and a receipt without a kernel boot id (written before they were recorded,
      or where none could be read): `this_host`, judged by name, PID and start time as such
      receipts always were, so an upgrade does not hold every run in flight.
    """
    if owner.hostname != here.hostname:
        return "other_host"
    if owner.kernel_boot_id is None:
        return "this_host"
    if owner.kernel_boot_id != here.kernel_boot_id:
        return "other_boot"
    return "this_host"


@dataclass(frozen=True, slots=True)
class RecordedOwner:
    """What the receipt says of the owner, against this controller (no probe needed)."""

    readable: bool  # the receipt parses into an owner
    same_host: bool  # it names this controller's host and boot (`owner_host` is `this_host`)
    same_process: bool  # it names this very process (same host, boot id and PID)
    live_here: bool  # its action is still running in this process
    joined_here: bool  # its action was joined in this process and has finished


@dataclass(frozen=True, slots=True)
class Ruling:
    verdict: Verdict
    basis: str | None = None  # with take_over: why (audited with the claim)
    why: StopReason | None = None  # with verify_stop: what is missing


def takeover_ruling(
    owner: RecordedOwner,
    *,
    stop_proof: Callable[[], bool],
    process: Callable[[], TakeoverDecision],
    copyback_barrier: Callable[[], bool],
) -> Ruling:
    """The ruling on `owner`: `stop_proof()` says whether the platform proved the recorded
    worker stopped, `process()` whether its same-host process may be taken over, and
    `copyback_barrier()` whether the run's copy-back is durably finished."""
    if owner.same_process and owner.live_here:
        return Ruling("own_action_live")
    if owner.readable and stop_proof():
        return Ruling("take_over", "platform_stop_proof")
    if not owner.readable:
        return Ruling("verify_stop", why="receipt_unreadable")
    if not owner.same_host:
        return Ruling("verify_stop", why="not_this_host")
    if owner.same_process and owner.joined_here:
        return Ruling("take_over", "same_boot_joined")
    decision = process()
    if not decision.allowed:
        return Ruling("verify_stop", why="process_alive")
    if not copyback_barrier():
        return Ruling("verify_stop", why="no_copyback_barrier")
    return Ruling("take_over", f"{decision.reason}+copyback_barrier")
