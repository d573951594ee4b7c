"""The Run JSON's `orphaned_since` and `liveness` (docs/leases.md#orphaned-runs), registered by
the leases app as blocks of the core's Run JSON."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from leases.orphans import run_liveness, run_orphaned_since
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


class RunLivenessSerializer(serializers.Serializer):  # type: ignore[type-arg]
    last_renewed_at = serializers.DateTimeField(
        allow_null=True, help_text="The last renewal of a lease that keeps the run alive."
    )
    orphaned_at = serializers.DateTimeField(
        allow_null=True,
        help_text="When the run became, or will become if nothing renews, orphaned: its "
        "leases' last expiry. A run start meeting it as the issue's holder from then on "
        "interrupts it and goes on.",
    )


@extend_schema_field(RunLivenessSerializer(allow_null=True))
class LivenessField(serializers.Field):  # type: ignore[type-arg]
    """What keeps a running run alive (docs/leases.md#orphaned-runs): read by an agent that
    meets the run as its issue's holder, to say who holds the issue and until when."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(source="*", read_only=True, **kwargs)

    def to_representation(self, value: HeartbeatRun) -> dict[str, str | None] | None:
        if value.status != HeartbeatRun.Status.RUNNING:
            return None
        liveness = run_liveness(value.pk)
        return {
            "last_renewed_at": iso(liveness.last_renewed_at) if liveness.last_renewed_at else None,
            "orphaned_at": iso(liveness.orphaned_at) if liveness.orphaned_at else None,
        }


def run_liveness_block() -> LivenessField:
    return LivenessField()
