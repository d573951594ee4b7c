"""The Run JSON's `orphaned_since` (docs/leases.md#orphaned-runs), registered by the leases app
as a block of the core's Run JSON."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from leases.orphans import run_orphaned_since
from leases.services.shared import iso
from paperclip.models import HeartbeatRun


@extend_schema_field(
    {
        "type": "string",
        "format": "date-time",
        "nullable": True,
        "description": (
            "When the running run's last lease lapsed with nothing renewing it (an agent that "
            "died); null while a lease keeps it alive, for a run with an accepted result, and "
            "for a run that is not running."
        ),
    }
)
class OrphanedSinceField(serializers.Field):  # type: ignore[type-arg]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(source="*", read_only=True, **kwargs)

    def to_representation(self, value: HeartbeatRun) -> str | None:
        if value.status != HeartbeatRun.Status.RUNNING:
            return None
        since = run_orphaned_since(value.pk)
        return None if since is None else iso(since)


def run_orphaned_since_block() -> OrphanedSinceField:
    return OrphanedSinceField()
