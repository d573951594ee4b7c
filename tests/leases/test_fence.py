"""The fence of a fenced write as a plain function (leases/services/operations.py
`require_fence`): no database. A write passes only for the key that holds the lease at exactly
its generation, and only while that holder's own issue or run is not stale."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from leases.errors import RuntimeLeaseOwnerIneligible, RuntimeLeaseSuperseded
from leases.selectors import RuntimeLease
from leases.services.operations import require_fence

WORKSPACE = uuid.uuid4()
NOW = datetime(2026, 12, 2, tzinfo=UTC)


def lease(owner_key: str = "agent:a", generation: int = 3) -> RuntimeLease:
    return RuntimeLease(
        id=uuid.uuid4(),
        company_id=uuid.uuid4(),
        execution_workspace_id=WORKSPACE,
        owner_key=owner_key,
        owner_issue_id=None,
        owner_run_id=None,
        owner_agent_id=None,
        last_action="start",
        generation=generation,
        claimed_at=NOW,
        renewed_at=NOW,
        expires_at=NOW,
        metadata=None,
    )


def fence(**kwargs: Any) -> None:
    require_fence(execution_workspace_id=WORKSPACE, **kwargs)


def test_the_holder_at_its_generation_passes() -> None:
    fence(owner_key="agent:a", generation=3, current=lease(), ineligible=None)


@pytest.mark.parametrize(
    ("owner_key", "generation", "current", "expected"),
    [
        ("agent:a", 2, lease(), (3, "agent:a")),  # an older generation of the same key
        ("agent:a", 4, lease(), (3, "agent:a")),  # a generation not handed out yet
        ("agent:b", 3, lease(), (3, "agent:a")),  # another key at the same generation
        (None, 3, lease(), (3, "agent:a")),  # no key at all
        ("agent:a", 3, None, (None, None)),  # no lease
    ],
)
def test_anything_else_is_superseded_naming_the_current_holder(
    owner_key: str | None, generation: int, current: RuntimeLease | None, expected: Any
) -> None:
    with pytest.raises(RuntimeLeaseSuperseded) as refused:
        fence(owner_key=owner_key, generation=generation, current=current, ineligible=None)
    details = refused.value.details
    assert (details["current_generation"], details["owner_key"]) == expected
    assert details["requested_generation"] == generation


def test_a_holder_whose_own_owner_ended_is_ineligible_and_supersession_is_checked_first() -> None:
    with pytest.raises(RuntimeLeaseOwnerIneligible) as refused:
        fence(owner_key="agent:a", generation=3, current=lease(), ineligible="owner_run_terminal")
    assert refused.value.details["reason"] == "owner_run_terminal"
    with pytest.raises(RuntimeLeaseSuperseded):
        fence(owner_key="agent:b", generation=3, current=lease(), ineligible="owner_run_terminal")
