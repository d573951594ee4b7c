"""Fixtures for recovery tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from recovery.services import ownership
from tests.recovery.factories import exited_pid


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    return exited_pid()


@pytest.fixture(autouse=True)
def _clean_process_memory() -> Iterator[None]:
    """Process-local ownership memory must not leak between tests."""
    yield
    ownership.before_claim_hook = None
    with ownership._state:
        ownership._active_owner_tokens.clear()
        ownership._active_run_owners.clear()
        ownership._joined_owner_tokens.clear()
