"""The process-local owner memory of finalization ownership
(docs/recovery.md#process-local-owner-memory)."""

from __future__ import annotations

import threading

from recovery.services.ownership.outcomes import WaitReason

# Process-local memory (docs/recovery.md#process-local-owner-memory), guarded by one mutex:
# tokens whose action is running in this process, the run key each token owns (with the
# database alias: a token joins only within the same database), and tokens whose action finished but
# whose receipt removal could not be confirmed: positive evidence that lets this same boot take them
# over.
memory_lock = threading.Lock()
active_owner_tokens: set[str] = set()
active_run_owners: dict[str, tuple[str, str]] = {}
joined_owner_tokens: set[str] = set()


def holder_reason(run_key: str, using: str) -> WaitReason:
    with memory_lock:
        holder = active_run_owners.get(run_key)
    return "owner_active" if holder is not None and holder[1] == using else "busy"
