"""Who this controller process is, and whether a recorded controller may be taken over.

A receipt names a process by (hostname, kernel boot id, pid, OS start time). The pid alone is
not enough: pids are recycled, so a live pid that started at another moment is another process.
Only receipts of this host and this boot can be judged here (the rule is
`recovery.takeover.owner_host`); callers never evaluate another host's or another boot's pid.

The start is compared in clock ticks since the kernel booted where the receipt records them.
A wall-clock start time is the boot time plus those ticks, and the kernel's boot time moves
whenever the system clock is stepped (NTP, a restored VM): after a step of a second or more,
the same live process reads as another one. The wall-clock comparison remains only for
receipts written without ticks (docs/recovery.md#controller-identity).
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil

from paperclip.host import kernel_boot_id
from paperclip.receipts import OwnerReceipt

# Differences below one second are the same process: some platforms report start times with
# whole-second precision (docs/recovery.md#controller-identity).
PID_RECYCLE_TOLERANCE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class ControllerIdentity:
    boot_id: str  # random per process: names this very process, not the machine's boot
    pid: int
    process_started_at: datetime
    hostname: str
    kernel_boot_id: str | None  # the machine's boot (paperclip.host); None when unreadable
    # The start in clock ticks since the kernel booted; None where unreadable (not Linux).
    process_start_ticks: int | None


@dataclass(frozen=True, slots=True)
class TakeoverDecision:
    allowed: bool
    reason: str


_lock = threading.Lock()
_identity: ControllerIdentity | None = None


def process_started_at(pid: int) -> datetime | None:
    """The OS-observed start time of `pid`, or None when no such process is visible. Raises
    psutil.AccessDenied when the process exists but its start time can't be read."""
    try:
        created = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    return datetime.fromtimestamp(created, tz=UTC)


def process_start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since the kernel booted (the 22nd field of
    /proc/<pid>/stat), which no step of the system clock moves; None when that can't be read
    (no such process, not Linux, a /proc that hides it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses itself:
    # the fields after the last ")" start with field 3, so field 22 is the 20th of them.
    try:
        return int(stat[stat.rindex(b")") + 1 :].split()[19])
    except (ValueError, IndexError):
        return None


def current_hostname() -> str:
    return socket.gethostname()


def current_controller_identity() -> ControllerIdentity:
    """This process's identity; the boot id is random per process (re-minted after fork)."""
    global _identity
    pid = os.getpid()
    with _lock:
        if _identity is None or _identity.pid != pid:
            started = process_started_at(pid) or datetime.now(tz=UTC)
            _identity = ControllerIdentity(
                boot_id=str(uuid.uuid4()),
                pid=pid,
                process_started_at=started,
                hostname=current_hostname(),
                kernel_boot_id=kernel_boot_id(),
                process_start_ticks=process_start_ticks(pid),
            )
        return _identity


def _is_dead(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return True
    try:
        # A zombie has exited; only its exit status waits to be reaped.
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False  # exists, owned by someone else: alive


def evaluate_controller_takeover(
    *, pid: int | None, started_at: datetime | None, start_ticks: int | None = None
) -> TakeoverDecision:
    """May a controller of this host and boot recorded as (pid, started_at, start_ticks) be
    taken over?

    Allowed only when the process is dead (or a zombie) or the pid now belongs to another
    process: one whose start in ticks since boot differs from the recorded `start_ticks`, or,
    when those are not recorded or not readable here, whose wall-clock start is at least a
    second apart from `started_at`. Elapsed time never counts.
    """
    if pid is None or pid <= 0 or started_at is None:
        return TakeoverDecision(False, "controller_identity_missing")
    if _is_dead(pid):
        return TakeoverDecision(True, "controller_process_dead")
    observed_ticks = process_start_ticks(pid) if start_ticks is not None else None
    if observed_ticks is not None:
        if observed_ticks != start_ticks:
            return TakeoverDecision(True, "controller_pid_recycled")
        return TakeoverDecision(False, "controller_still_alive")
    try:
        observed = process_started_at(pid)
    except psutil.AccessDenied:
        # Alive, and we can't tell whether it is the recorded process: fail closed.
        return TakeoverDecision(False, "controller_start_time_unreadable")
    if observed is None:
        return TakeoverDecision(True, "controller_process_dead")
    if abs((observed - started_at).total_seconds()) >= PID_RECYCLE_TOLERANCE_SECONDS:
        return TakeoverDecision(True, "controller_pid_recycled")
    return TakeoverDecision(False, "controller_still_alive")


def evaluate_receipt_takeover(receipt: OwnerReceipt) -> TakeoverDecision:
    """`evaluate_controller_takeover` for the process a readable receipt of this host records."""
    return evaluate_controller_takeover(
        pid=receipt.pid,
        started_at=receipt.process_started_at,
        start_ticks=receipt.process_start_ticks,
    )
