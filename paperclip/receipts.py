"""The durable finalization owner receipt of a run: the one parser and the one rendering.

The receipt lives in `heartbeat_runs.runner_profile_json -> 'nativeWorkspaceFinalizationOwner'`
(written and removed only by finalization ownership, `recovery.services.ownership`); its keys
stay camelCase because the rows are shared with tools that read the stored JSON. Semantics:
docs/recovery.md#owner-receipt.

- `owner_receipt_fields` reads it field by field, as far as it is readable (a damaged
  receipt is still shown: it still blocks finalization, so operators must see it);
- `read_owner` is the strict reading that decisions use: every field present and valid, or
  None (an unreadable receipt needs an operator's verification, never an automatic takeover);
- `owner_receipt_json` is the Run JSON's `finalization_owner`, the same on every endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

OWNER_KEY: Final = "nativeWorkspaceFinalizationOwner"
STOP_PROOF_KEY: Final = "nativeWorkspaceOwnerStopProof"


@dataclass(frozen=True, slots=True)
class OwnerReceiptFields:
    """A receipt as far as it is readable: a missing or malformed field is None."""

    token: str | None
    hostname: str | None
    pid: int | None
    process_started_at: str | None
    controller_boot_id: str | None
    kernel_boot_id: str | None
    kernel_boot_id_malformed: bool  # present, not null, and not a non-empty string
    process_start_ticks: int | None
    process_start_ticks_malformed: bool  # present, not null, and not an integer >= 0
    worker: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class OwnerReceipt:
    """A fully readable receipt: the controller process that owns the finalization."""

    token: str
    hostname: str
    pid: int
    process_started_at: datetime
    controller_boot_id: str | None
    # The machine boot it ran under; None on a receipt written before kernel boot ids were
    # recorded, or by a process that could not read its own.
    kernel_boot_id: str | None
    # When the process started, in clock ticks since that boot: unlike `process_started_at`,
    # not moved by a step of the system clock. None on receipts written without it.
    process_start_ticks: int | None
    worker: dict[str, Any] | None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def parse_iso(value: Any) -> datetime | None:
    """An ISO-8601 time with a zone (a trailing `Z` included); None otherwise."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def raw_owner(runner_profile: Any) -> Any:
    """The raw receipt value of a run's `runner_profile_json` (maybe malformed); None if absent."""
    if not isinstance(runner_profile, dict):
        return None
    return runner_profile.get(OWNER_KEY)


def _int_or_none(value: Any) -> int | None:
    # bool is an int subclass; a JSON true is not a number.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def owner_receipt_fields(value: Any) -> OwnerReceiptFields:
    """Every field of a raw receipt that is readable; the others None."""
    raw = value if isinstance(value, dict) else {}
    worker = raw.get("worker")
    kernel_boot = raw.get("kernelBootId")
    raw_ticks = raw.get("processStartTicks")
    ticks = _int_or_none(raw_ticks)
    ticks = ticks if ticks is not None and ticks >= 0 else None
    return OwnerReceiptFields(
        token=_str_or_none(raw.get("token")),
        hostname=_str_or_none(raw.get("hostname")),
        pid=_int_or_none(raw.get("pid")),
        process_started_at=_str_or_none(raw.get("processStartedAt")),
        controller_boot_id=_str_or_none(raw.get("controllerBootId")),
        kernel_boot_id=kernel_boot if isinstance(kernel_boot, str) and kernel_boot else None,
        kernel_boot_id_malformed=kernel_boot is not None
        and not (isinstance(kernel_boot, str) and kernel_boot),
        process_start_ticks=ticks,
        process_start_ticks_malformed=raw_ticks is not None and ticks is None,
        worker=worker if isinstance(worker, dict) else None,
    )


def read_owner(value: Any) -> OwnerReceipt | None:
    """The receipt if it is readable (non-empty token, hostname, positive integer pid,
    parsable start time with a zone, a kernel boot id that is absent, null or a non-empty
    string, and start ticks that are absent, null or an integer >= 0); None otherwise."""
    fields = owner_receipt_fields(value)
    started = parse_iso(fields.process_started_at)
    if not fields.token or fields.hostname is None or started is None:
        return None
    # A damaged boot id or start must not read as an old receipt without one (judged by host
    # name, or by the wall-clock start).
    if fields.kernel_boot_id_malformed or fields.process_start_ticks_malformed:
        return None
    if fields.pid is None or fields.pid <= 0:
        return None
    return OwnerReceipt(
        token=fields.token,
        hostname=fields.hostname,
        pid=fields.pid,
        process_started_at=started,
        controller_boot_id=fields.controller_boot_id,
        kernel_boot_id=fields.kernel_boot_id,
        process_start_ticks=fields.process_start_ticks,
        worker=fields.worker,
    )


def owner_receipt_json(runner_profile: Any) -> dict[str, Any] | None:
    """The Run JSON's `finalization_owner`: `{token, hostname, pid, process_started_at}` with
    unreadable fields null, or None when the run has no receipt."""
    raw = raw_owner(runner_profile)
    if raw is None:
        return None
    fields = owner_receipt_fields(raw)
    return {
        "token": fields.token,
        "hostname": fields.hostname,
        "pid": fields.pid,
        "process_started_at": fields.process_started_at,
    }


def owner_line(value: Any) -> str:
    """`host · PID pid · started processStartedAt`, for operators."""
    if not isinstance(value, dict):
        return "unreadable receipt"
    return (
        f"{value.get('hostname', '?')} · PID {value.get('pid', '?')} · "
        f"started {value.get('processStartedAt', '?')}"
    )
