"""Fixtures for recovery tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from recovery.services.ownership import acquire, memory
from tests.recovery.factories import exited_pid


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    return exited_pid()


@pytest.fixture(autouse=True)
def _clean_process_memory() -> Iterator[None]:
    """Process-local ownership memory must not leak between tests."""
    yield
    acquire.before_claim_hook = None
    with memory.memory_lock:
        memory.active_owner_tokens.clear()
        memory.active_run_owners.clear()
        memory.joined_owner_tokens.clear()
