"""The `finalization` block of the Run JSON (docs/api.md#run-json): the run's finalization
state as recovery computes it, added to the core's Run JSON when the app is ready."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from paperclip.models import HeartbeatRun
from recovery.selectors.finalization import finalization_state


@extend_schema_serializer(component_name="RunFinalization")
class FinalizationStateSerializer(serializers.Serializer[Any]):
    state = serializers.ChoiceField(
        choices=[
            "none",
            "waiting",
            "queued",
            "running",
            "retry_scheduled",
            "held",
            "failed",
            "committed",
        ]
    )
    reason = serializers.CharField(allow_null=True, help_text="The NotAcquired reason while held.")
    attempts = serializers.IntegerField()
    next_attempt_at = serializers.DateTimeField(allow_null=True)
    last_error = serializers.CharField(allow_null=True)

    def to_representation(self, instance: Any) -> Any:
        if isinstance(instance, HeartbeatRun):  # the block: the whole run, read as its state
            instance = finalization_state(instance).as_json()
        return super().to_representation(instance)


def run_finalization_block() -> FinalizationStateSerializer:
    return FinalizationStateSerializer(source="*", read_only=True)
