"""HTTP API of the recovery app: runner results and finalization, issue recovery actions,
board owner-stop confirmation, and the worker platform's signed stop receipts."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from drf_spectacular.utils import (
    extend_schema,
    extend_schema_serializer,
    inline_serializer,
)
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from paperclip.access import scoped_get
from paperclip.api.auth import IsAgent, IsAgentOrBoard, IsBoard, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    UUIDBodyField,
    error_responses,
)
from paperclip.errors import PermissionDenied
from paperclip.models import HeartbeatRun, Issue
from recovery.errors import (
    FinalizationNotAcquired,
    FinalizationOwnershipLost,
    FinalizationOwnershipLostError,
)
from recovery.selectors.actions import recovery_action_list_for_issue
from recovery.services import (
    NotAcquired,
    recovery_owner_stop_confirm,
    result_accept,
    run_finalize,
)
from recovery.services.owner_stop import (
    MAX_STOP_EVIDENCE_CHARS,
    MIN_STOP_EVIDENCE_CHARS,
    nonblank_length,
)
from recovery.services.worker_stops import worker_stop_record


class NativeResultOutput(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    run_id = serializers.UUIDField()
    issue_id = serializers.UUIDField()
    schema_status = serializers.CharField()
    caller_result_id = serializers.CharField(allow_null=True)
    server_fingerprint = serializers.CharField()
    canonical_sha256 = serializers.CharField()
    result_json = serializers.JSONField()
    created_at = serializers.DateTimeField()


class RunResultAcceptApi(APIView):
    """The run's agent reports its result; workspace finalization is queued."""

    permission_classes = (IsAgent,)

    @extend_schema_serializer(component_name="RunResultAcceptInput")
    class InputSerializer(serializers.Serializer[Any]):
        @extend_schema_serializer(component_name="RunResultTerminal")
        class TerminalSerializer(serializers.Serializer[Any]):
            run_terminal_state = serializers.ChoiceField(
                choices=HeartbeatRun.TERMINAL_STATUS_VALUES
            )

        result = serializers.DictField()
        terminal = TerminalSerializer()
        caller_result_id = serializers.CharField(
            required=False, allow_null=True, max_length=200, allow_blank=False
        )

    @extend_schema(
        request=InputSerializer,
        responses={
            201: NativeResultOutput,
            200: NativeResultOutput,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "native_result_conflict"),
                (409, "run_not_finalizable"),
                (422, "finalization_binding_missing"),
            ),
        },
        summary="Report a native run's result",
    )
    def post(self, request: Request, run_id: UUID) -> Response:
        actor = actor_for(request)
        run = scoped_get(HeartbeatRun.objects.all(), actor, run_id)
        if run.agent_id != actor.agent_id:
            raise PermissionDenied("Only the run's own agent may report its result.")
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        accepted = result_accept(
            company_id=run.company_id,
            run_id=run.pk,
            agent_id=run.agent_id,
            result=data.validated_data["result"],
            run_terminal_state=data.validated_data["terminal"]["run_terminal_state"],
            caller_result_id=data.validated_data.get("caller_result_id"),
        )
        return Response(
            NativeResultOutput(accepted.result).data,
            status=status.HTTP_201_CREATED if accepted.created else status.HTTP_200_OK,
        )


class RunFinalizeApi(APIView):
    """Finalize the run's workspace now (the run's own agent, or a board member)."""

    permission_classes = (IsAgentOrBoard,)

    @extend_schema_serializer(component_name="RunFinalizeOutput")
    class OutputSerializer(serializers.Serializer[Any]):
        @extend_schema_serializer(component_name="RunFinalizeResult")
        class ResultSerializer(serializers.Serializer[Any]):
            run_id = serializers.UUIDField()
            status = serializers.CharField()
            phase = serializers.CharField()
            result_id = serializers.UUIDField(allow_null=True)
            run_status = serializers.CharField()
            operation_id = serializers.UUIDField(allow_null=True)
            failure_code = serializers.CharField(allow_null=True)
            copied = serializers.DictField(allow_null=True)

        acquired = serializers.BooleanField()
        result = ResultSerializer()

    @extend_schema(
        request=None,
        responses={
            200: OutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                NOT_FOUND,
                (409, "finalization_not_acquired"),
                (409, "finalization_ownership_lost"),
                (409, "finalization_not_ready"),
                (422, "finalization_binding_missing"),
            ),
        },
        summary="Finalize a native run's workspace under finalization ownership",
    )
    def post(self, request: Request, run_id: UUID) -> Response:
        actor = actor_for(request)
        run = scoped_get(HeartbeatRun.objects.all(), actor, run_id)
        if actor.is_agent and run.agent_id != actor.agent_id:
            raise PermissionDenied("Only the run's own agent or a board member may finalize it.")
        try:
            outcome = run_finalize(company_id=run.company_id, run_id=run.pk)
        except FinalizationOwnershipLost as exc:
            # Not a DomainError on purpose (the services treat it as a control-flow signal).
            raise FinalizationOwnershipLostError(reason=exc.reason, run_id=str(run.pk)) from exc
        if isinstance(outcome, NotAcquired):
            raise FinalizationNotAcquired(reason=outcome.reason, run_id=str(run.pk))
        value = outcome.value
        copied = value.copied
        body = {
            "acquired": True,
            "result": {
                "run_id": value.run_id,
                "status": value.status,
                "phase": value.phase,
                "result_id": value.result_id,
                "run_status": value.run_status,
                "operation_id": value.operation_id,
                "failure_code": value.failure_code,
                "copied": None
                if copied is None
                else {
                    "files": copied.files,
                    "directories": copied.directories,
                    "bytes": copied.bytes,
                    "symlinks": copied.symlinks,
                    "skipped": list(copied.skipped),
                },
            },
        }
        return Response(self.OutputSerializer(body).data)


class RecoveryActionOutput(serializers.Serializer[Any]):
    id = serializers.UUIDField()
    kind = serializers.CharField()
    status = serializers.CharField()
    owner_type = serializers.CharField()
    cause = serializers.CharField()
    fingerprint = serializers.CharField()
    evidence = serializers.JSONField()  # verbatim jsonb
    next_action = serializers.CharField()
    attempt_count = serializers.IntegerField()
    max_attempts = serializers.IntegerField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class IssueRecoveryActionListApi(APIView):
    """The issue's recovery actions (board; the issue's assignee agent may read)."""

    permission_classes = (IsAgentOrBoard,)

    @extend_schema(
        responses={
            200: inline_serializer(
                name="RecoveryActionList", fields={"results": RecoveryActionOutput(many=True)}
            ),
            **error_responses(*AUTH_ERRORS, NOT_FOUND),
        },
        summary="List an issue's recovery actions",
    )
    def get(self, request: Request, issue_id: UUID) -> Response:
        actor = actor_for(request)
        issue = scoped_get(Issue.objects.all(), actor, issue_id)
        if actor.is_agent and issue.assignee_agent_id != actor.agent_id:
            raise PermissionDenied("Only the issue's assignee agent or the board may read this.")
        actions = recovery_action_list_for_issue(company_id=issue.company_id, issue_id=issue.pk)
        return Response({"results": RecoveryActionOutput(actions, many=True).data})


class OwnerStopConfirmApi(APIView):
    """A board member attests the recorded finalization owner stopped; finalization of the
    saved result is queued."""

    permission_classes = (IsBoard,)

    @extend_schema_serializer(component_name="OwnerStopConfirmInput")
    class InputSerializer(serializers.Serializer[Any]):
        action_id = UUIDBodyField()
        run_id = UUIDBodyField()
        owner_token = serializers.CharField(max_length=200)
        controller_and_copyback_stopped = serializers.BooleanField()
        stop_evidence = serializers.CharField(
            trim_whitespace=False, max_length=MAX_STOP_EVIDENCE_CHARS
        )

        def validate_controller_and_copyback_stopped(self, value: bool) -> bool:
            if value is not True:
                raise serializers.ValidationError("Confirm that the owner has stopped.")
            return value

        def validate_stop_evidence(self, value: str) -> str:
            if nonblank_length(value) < MIN_STOP_EVIDENCE_CHARS:
                raise serializers.ValidationError(
                    f"At least {MIN_STOP_EVIDENCE_CHARS} non-blank characters."
                )
            return value

    @extend_schema_serializer(component_name="OwnerStopConfirmOutput")
    class OutputSerializer(serializers.Serializer[Any]):
        run_id = serializers.UUIDField()
        result_id = serializers.UUIDField()
        status = serializers.CharField()

    @extend_schema(
        request=InputSerializer,
        responses={
            202: OutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "workspace_copyback_active"),
                (409, "workspace_controller_alive"),
                (409, "workspace_owner_recovery_stale"),
                RESOURCE_BUSY,
            ),
        },
        summary="Confirm a stopped workspace owner and resume finalization",
    )
    def post(self, request: Request, issue_id: UUID) -> Response:
        actor = actor_for(request)
        scoped_get(Issue.objects.all(), actor, issue_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        confirmation = recovery_owner_stop_confirm(
            actor=actor,
            issue_id=issue_id,
            action_id=data.validated_data["action_id"],
            run_id=data.validated_data["run_id"],
            owner_token=data.validated_data["owner_token"],
            stop_evidence=data.validated_data["stop_evidence"],
            controller_and_copyback_stopped=data.validated_data["controller_and_copyback_stopped"],
        )
        return Response(
            self.OutputSerializer(
                {
                    "run_id": confirmation.run_id,
                    "result_id": confirmation.result_id,
                    "status": confirmation.status,
                }
            ).data,
            status=status.HTTP_202_ACCEPTED,
        )


class WorkerStopRecordApi(APIView):
    """The worker platform reports a stopped worker. Authenticated by the HMAC signature
    (PAPERCLIP_PLATFORM_STOP_SECRET), not by an agent key or board token."""

    authentication_classes = ()
    permission_classes = (AllowAny,)

    @extend_schema_serializer(component_name="WorkerStopRecordInput")
    class InputSerializer(serializers.Serializer[Any]):
        run_id = UUIDBodyField()
        owner_token = serializers.CharField(max_length=200)
        worker_id = serializers.CharField(max_length=500)
        stopped_at = serializers.CharField(max_length=64)
        signature = serializers.RegexField(r"^[0-9a-fA-F]{64}$")

    @extend_schema_serializer(component_name="WorkerStopRecordOutput")
    class OutputSerializer(serializers.Serializer[Any]):
        id = serializers.UUIDField()
        run_id = serializers.UUIDField()
        owner_token = serializers.CharField()
        worker_id = serializers.CharField()
        stopped_at = serializers.CharField()
        recorded_at = serializers.DateTimeField()

    @extend_schema(
        request=InputSerializer,
        responses={
            201: OutputSerializer,
            200: OutputSerializer,
            **error_responses(
                INVALID_REQUEST,
                NOT_FOUND,
                (422, "worker_stop_signature_invalid"),
                (422, "worker_stop_platform_disabled"),
            ),
        },
        summary="Record a worker platform's signed stop receipt",
        auth=[],
    )
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        recorded = worker_stop_record(**data.validated_data)
        return Response(
            self.OutputSerializer(recorded.receipt).data,
            status=status.HTTP_201_CREATED if recorded.created else status.HTTP_200_OK,
        )
