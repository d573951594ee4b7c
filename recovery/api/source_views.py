"""Board API: inspect the workspace source a recovery action's failed run recorded."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_serializer,
    inline_serializer,
)
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from leases.environment.api.views import EnvironmentLeaseOutputSerializer
from paperclip.access import scoped_get
from paperclip.api.auth import IsBoard, actor_for
from paperclip.errors import NotFoundError
from paperclip.ids import parse_uuid
from paperclip.models import Environment, ExecutionWorkspace, HeartbeatRun, Issue
from recovery.models import IssueRecoveryAction
from recovery.selectors.source import RecoverySource, recovery_source_inspect

MAXIMUM_SOURCES = 50

ERROR_BODY = inline_serializer(
    name="RecoverySourceError",
    fields={
        "error": inline_serializer(
            name="RecoverySourceErrorBody",
            fields={
                "code": serializers.CharField(),
                "message": serializers.CharField(),
                "details": inline_serializer(
                    name="RecoverySourceErrorDetails",
                    fields={
                        "disposition": serializers.ChoiceField(
                            choices=(
                                "service_required",
                                "use_alternative_strategy",
                                "recheck_evidence",
                            ),
                            required=False,
                        ),
                        "reason": serializers.CharField(required=False),
                        "observed_lease_policy": serializers.CharField(required=False),
                        "fields": serializers.DictField(required=False),
                    },
                ),
                "remediation": serializers.CharField(required=False),
            },
        )
    },
)


def _owner_receipt(run: HeartbeatRun) -> dict[str, Any] | None:
    """The run's finalization owner receipt in the Run shape, when it is readable."""
    profile = run.runner_profile_json if isinstance(run.runner_profile_json, dict) else {}
    owner = profile.get("nativeWorkspaceFinalizationOwner")
    if not isinstance(owner, dict):
        return None
    token, hostname, pid, started = (
        owner.get(k) for k in ("token", "hostname", "pid", "processStartedAt")
    )
    if not (isinstance(token, str) and isinstance(hostname, str) and isinstance(started, str)):
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return None
    try:
        datetime.fromisoformat(started)
    except ValueError:
        return None
    return {"token": token, "hostname": hostname, "pid": pid, "process_started_at": started}


@extend_schema_serializer(component_name="RecoverySourceRun")
class _RunSerializer(serializers.Serializer[HeartbeatRun]):
    id = serializers.UUIDField()
    company_id = serializers.UUIDField()
    agent_id = serializers.UUIDField()
    issue_id = serializers.UUIDField(allow_null=True)
    status = serializers.CharField()
    runtime_mode = serializers.CharField()
    native_phase = serializers.CharField(allow_null=True)
    execution_workspace_id = serializers.UUIDField(allow_null=True)
    created_at = serializers.DateTimeField()
    finalization_owner = serializers.SerializerMethodField()

    def get_finalization_owner(self, run: HeartbeatRun) -> dict[str, Any] | None:
        return _owner_receipt(run)


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
        run = _RunSerializer()
        action = _ActionSerializer()
        sources = _SourceSerializer(many=True)

    class QuerySerializer(serializers.Serializer[Any]):
        run_id = serializers.UUIDField()

    @extend_schema(
        operation_id="recovery_source_inspect",
        summary="Inspect the workspace source recorded by a recovery action's failed run.",
        parameters=[OpenApiParameter("run_id", str, OpenApiParameter.QUERY, required=True)],
        responses={
            200: OutputSerializer,
            400: OpenApiResponse(ERROR_BODY, description="invalid_request (run_id)"),
            403: OpenApiResponse(ERROR_BODY, description="Board only."),
            404: OpenApiResponse(ERROR_BODY, description="No such issue in your companies."),
            409: OpenApiResponse(
                ERROR_BODY, description="agent_stop_unconfirmed | workspace_writer_active"
            ),
            422: OpenApiResponse(
                ERROR_BODY,
                description=(
                    "source_binding_invalid | historical_source_missing | "
                    "allocation_ownership_ambiguous | source_unavailable | "
                    "source_inspection_limit"
                ),
            ),
        },
    )
    def get(self, request: Request, issue_id: str, action_id: str) -> Response:
        actor = actor_for(request)
        issue = scoped_get(Issue.objects.all(), actor, issue_id)
        action_pk = parse_uuid(action_id)
        if action_pk is None:
            raise NotFoundError()
        query = self.QuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        inspection = recovery_source_inspect(
            company_id=issue.company_id,
            issue_id=issue.pk,
            run_id=query.validated_data["run_id"],
            action_id=action_pk,
            maximum_sources=MAXIMUM_SOURCES,
        )
        return Response(
            self.OutputSerializer(
                {"run": inspection.run, "action": inspection.action, "sources": inspection.sources}
            ).data
        )
