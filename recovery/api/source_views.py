"""Board API: inspect the workspace source a recovery action's failed run recorded."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from leases.environment.api.views import EnvironmentLeaseOutputSerializer
from paperclip.access import scoped_get
from paperclip.api.auth import IsBoard, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RunOutputSerializer,
    UUIDBodyField,
    error_responses,
)
from paperclip.models import Environment, ExecutionWorkspace, Issue
from recovery.models import IssueRecoveryAction
from recovery.selectors.source.inspection import MAXIMUM_SOURCES, recovery_source_inspect
from recovery.selectors.source.lease_checks import RecoverySource


@extend_schema_serializer(component_name="RecoverySourceAction")
class _ActionSerializer(serializers.ModelSerializer[IssueRecoveryAction]):
    class Meta:
        model = IssueRecoveryAction
        fields = (
            "id",
            "kind",
            "status",
            "owner_type",
            "cause",
            "fingerprint",
            "evidence",
            "next_action",
            "attempt_count",
            "max_attempts",
            "created_at",
            "updated_at",
        )
        read_only_fields = fields


@extend_schema_serializer(component_name="RecoverySourceEnvironment")
class _EnvironmentSerializer(serializers.ModelSerializer[Environment]):
    class Meta:
        model = Environment
        fields = ("id", "name", "driver", "status")
        read_only_fields = fields


@extend_schema_serializer(component_name="RecoverySourceWorkspace")
class _WorkspaceSerializer(serializers.ModelSerializer[ExecutionWorkspace]):
    class Meta:
        model = ExecutionWorkspace
        fields = ("id", "name", "status", "cwd", "metadata")
        read_only_fields = fields


@extend_schema_serializer(component_name="RecoverySource")
class _SourceSerializer(serializers.Serializer[RecoverySource]):
    lease = EnvironmentLeaseOutputSerializer()
    environment = _EnvironmentSerializer()
    reference = serializers.SerializerMethodField()
    preservation_only = serializers.BooleanField()
    remote_reference = serializers.SerializerMethodField()
    remote_workspace = _WorkspaceSerializer(allow_null=True)
    remote_cwd = serializers.CharField()

    def get_reference(self, source: RecoverySource) -> dict[str, Any] | None:
        """The run's native sync reference (stored camelCase form)."""
        return source.reference.as_json() if source.reference is not None else None

    def get_remote_reference(self, source: RecoverySource) -> dict[str, Any] | None:
        """The run's remote workspace reference (stored camelCase form)."""
        ref = source.remote_reference
        return ref.as_json() if ref is not None else None


class RecoverySourceInspectApi(APIView):
    permission_classes = (IsBoard,)

    @extend_schema_serializer(component_name="RecoverySourceInspection")
    class OutputSerializer(serializers.Serializer[Any]):
        run = RunOutputSerializer()
        action = _ActionSerializer()
        sources = _SourceSerializer(many=True)

    class QuerySerializer(serializers.Serializer[Any]):
        run_id = UUIDBodyField()

    @extend_schema(
        operation_id="recovery_source_inspect",
        summary="Inspect the workspace source recorded by a recovery action's failed run.",
        parameters=[OpenApiParameter("run_id", str, OpenApiParameter.QUERY, required=True)],
        # A failure's details carry `disposition` and, per code, `reason` and
        # `observed_lease_policy` (docs/recovery.md#recovery-source-inspection).
        responses={
            200: OutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "agent_stop_unconfirmed"),
                (409, "workspace_writer_active"),
                (422, "source_binding_invalid"),
                (422, "historical_source_missing"),
                (422, "allocation_ownership_ambiguous"),
                (422, "source_unavailable"),
                (422, "source_inspection_limit"),
            ),
        },
    )
    def get(self, request: Request, issue_id: UUID, action_id: UUID) -> Response:
        actor = actor_for(request)
        issue = scoped_get(Issue.objects.all(), actor, issue_id)
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        inspection = recovery_source_inspect(
            company_id=issue.company_id,
            issue_id=issue.pk,
            run_id=query.validated_data["run_id"],
            action_id=action_id,
            maximum_sources=MAXIMUM_SOURCES,
        )
        return Response(
            self.OutputSerializer(
                {"run": inspection.run, "action": inspection.action, "sources": inspection.sources}
            ).data
        )
