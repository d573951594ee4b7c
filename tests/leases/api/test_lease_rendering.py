"""The lease's JSON, rendered straight from its attributes on the hot path, is exactly what
DRF's field-by-field rendering of LeaseSerializer gives."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from uuid import uuid4

import pytest
from rest_framework import serializers

from leases.api.views import LeaseSerializer
from leases.selectors import RuntimeLease


def _lease(**changes: object) -> RuntimeLease:
    now = datetime(2026, 12, 1, 17, 5, 49, 994894, tzinfo=UTC)
    values: dict[str, object] = {
        "id": uuid4(),
        "company_id": uuid4(),
        "execution_workspace_id": uuid4(),
        "owner_key": "issue:x",
        "owner_issue_id": uuid4(),
        "owner_run_id": None,
        "owner_agent_id": uuid4(),
        "last_action": "start",
        "generation": 2**40,
        "claimed_at": now,
        "renewed_at": now.replace(microsecond=0),  # isoformat drops a zero fraction
        "expires_at": (now + timedelta(minutes=30)).astimezone(timezone(timedelta(hours=5))),
        "metadata": {"reclaimedFromOwnerKey": "run:y", "reclaimReason": "lease_expired"},
    }
    values.update(changes)
    return RuntimeLease(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "lease",
    [
        _lease(),
        _lease(owner_issue_id=None, owner_run_id=uuid4(), owner_agent_id=None, metadata=None),
        _lease(last_action="repair", generation=1, metadata={"nested": [1, None, "é"]}),
    ],
)
def test_the_fast_rendering_is_drfs(lease: RuntimeLease) -> None:
    serializer = LeaseSerializer()
    fast = serializer.to_representation(lease)
    generic = serializers.Serializer.to_representation(serializer, lease)
    assert fast == dict(generic)
    assert list(fast) == list(generic)  # same keys, same order
    assert fast["expires_at"].endswith("Z")
