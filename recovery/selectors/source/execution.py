"""Whether a run may still be driven: an adapter executing in this process (a per-process
registry no in-process executor uses yet; see the package docstring), or a live controller
lease."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from paperclip.models import NativeRunFinalization

_executing_runs: set[str] = set()

_executing_guard = threading.Lock()


@contextmanager
def adapter_execution_control(run_id: UUID | str) -> Iterator[None]:
    """Mark `run_id` as executing in this process for the duration of the block."""
    key = str(run_id)
    with _executing_guard:
        _executing_runs.add(key)
    try:
        yield
    finally:
        with _executing_guard:
            _executing_runs.discard(key)


def adapter_executing(run_id: UUID | str) -> bool:
    with _executing_guard:
        return str(run_id) in _executing_runs


def controller_lease_live(coordinator: NativeRunFinalization | None, now: Any) -> bool:
    """The run's controller lease (held in its coordinator) is held and not lapsed on the
    database clock."""
    return (
        coordinator is not None
        and bool(coordinator.lease_owner)
        and (coordinator.lease_expires_at is None or coordinator.lease_expires_at > now)
    )
