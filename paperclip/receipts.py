"""The durable finalization owner receipt kept in
`heartbeat_runs.runner_profile_json -> 'nativeWorkspaceFinalizationOwner'` (UPSTREAM §1.14).

Keys keep upstream's camelCase so upstream's maintenance SQL reads the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

OWNER_KEY = "nativeWorkspaceFinalizationOwner"
STOP_PROOF_KEY = "nativeWorkspaceOwnerStopProof"


@dataclass(frozen=True, slots=True)
class OwnerReceipt:
    token: str
    hostname: str
    pid: int
    process_started_at: datetime
    controller_boot_id: str | None
    worker: dict[str, Any] | None


def parse_iso(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def read_owner(value: Any) -> OwnerReceipt | None:
    """The receipt if it is readable (token, hostname, positive integer pid, parsable start);
    None otherwise. An unreadable receipt still blocks: it needs operator verification."""
    if not isinstance(value, dict):
        return None
    token, hostname, pid = value.get("token"), value.get("hostname"), value.get("pid")
    started = parse_iso(value.get("processStartedAt"))
    if not isinstance(token, str) or not token or not isinstance(hostname, str):
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0 or started is None:
        return None
    boot_id = value.get("controllerBootId")
    worker = value.get("worker")
    return OwnerReceipt(
        token=token,
        hostname=hostname,
        pid=pid,
        process_started_at=started,
        controller_boot_id=boot_id if isinstance(boot_id, str) else None,
        worker=worker if isinstance(worker, dict) else None,
    )


def raw_owner(runner_profile: Any) -> Any:
    """The raw receipt value (possibly malformed), or None when absent."""
    if not isinstance(runner_profile, dict):
        return None
    return runner_profile.get(OWNER_KEY)


def owner_line(value: Any) -> str:
    """`host · PID pid · started processStartedAt`, for operators."""
    if not isinstance(value, dict):
        return "unreadable receipt"
    return (
        f"{value.get('hostname', '?')} · PID {value.get('pid', '?')} · "
        f"started {value.get('processStartedAt', '?')}"
    )
