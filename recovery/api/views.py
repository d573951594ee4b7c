"""HTTP API of the recovery app: runner results and finalization, issue recovery actions,
board owner-stop confirmation, and the worker platform's signed stop receipts."""

from __future__ import annotations

import re
from typing import Any
from uuid import UUID

from drf_spectacular.utils import (
    OpenApiParameter,
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
from paperclip.api.history_views import ConflictTreeChangeSerializer, ConflictTreeEntrySerializer
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    StrictInputSerializer,
    UUIDBodyField,
    error_responses,
    validated_body,
)
from paperclip.errors import InvalidRequest, PermissionDenied
from paperclip.models import HeartbeatRun, Issue
from paperclip.snapshots.resolutions import RESOLUTIONS
from paperclip.snapshots.trees import BLOB_NAME
from recovery.api.serializers import FinalizationStateSerializer
from recovery.errors import FinalizationFailed, FinalizationNotAcquired
from recovery.selectors.actions import recovery_action_list_for_issue
from recovery.selectors.finalization import (
    FinalizationState,
    finalization_await,
    finalization_state,
)
from recovery.selectors.holds import HOLD_REMEDIATION
from recovery.services import recovery_owner_stop_confirm, result_accept
from recovery.services.conflict_resolution import workspace_conflict_preview
from recovery.services.conflicts import HeadExpected, workspace_conflict_resolve
from recovery.services.export_repair import workspace_export_retry
from recovery.services.finalization_jobs import finalization_request
from recovery.services.owner_stop import MAX_STOP_EVIDENCE_CHARS, board_text_problem
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
    class InputSerializer(StrictInputSerializer):
        @extend_schema_serializer(component_name="RunResultTerminal")
        class TerminalSerializer(StrictInputSerializer):
            run_terminal_state = serializers.ChoiceField(
                choices=HeartbeatRun.TERMINAL_STATUS_VALUES
            )

        result = serializers.DictField()
        terminal = TerminalSerializer()
        caller_result_id = serializers.CharField(
            required=False, allow_null=True, max_length=200, allow_blank=False
        )
        workspace_tree = serializers.RegexField(
            BLOB_NAME.pattern, required=False, allow_null=True, max_length=71
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
                (409, "snapshot_not_registered"),
                (409, "workspace_copyback_not_allowed"),
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
            workspace_tree=data.validated_data.get("workspace_tree"),
        )
        return Response(
            NativeResultOutput(accepted.result).data,
            status=status.HTTP_201_CREATED if accepted.created else status.HTTP_200_OK,
        )


MAX_FINALIZE_WAIT_SECONDS = 30


def _wait_seconds(request: Request) -> int:
    raw = request.query_params.get("wait")
    if raw is None:
        return 0
    if re.fullmatch(r"[0-9]{1,2}", raw) is None or int(raw) > MAX_FINALIZE_WAIT_SECONDS:
        raise InvalidRequest(
            fields={"wait": [f"Whole seconds from 0 to {MAX_FINALIZE_WAIT_SECONDS}."]}
        )
    return int(raw)


def _not_acquired(run_id: UUID, reason: str | None) -> FinalizationNotAcquired:
    """409 `finalization_not_acquired` naming the hold's reason and that reason's remedy."""
    return FinalizationNotAcquired(
        reason=reason,
        run_id=str(run_id),
        remediation=HOLD_REMEDIATION.get(reason or "", FinalizationNotAcquired.remediation),
    )


class RunFinalizeApi(APIView):
    """Wake the run's finalization in the worker now (the run's own agent, or a board member);
    with `?wait=`, answer once the attempt ends (docs/worker.md#finalization-in-the-worker)."""

    permission_classes = (IsAgentOrBoard,)

    @extend_schema_serializer(component_name="RunFinalizeOutput")
    class OutputSerializer(serializers.Serializer[Any]):
        run_id = serializers.UUIDField()
        status = serializers.ChoiceField(
            choices=["queued", "running", "retry_scheduled", "committed"]
        )
        finalization = FinalizationStateSerializer()

    @extend_schema(
        request=None,
        parameters=[
            OpenApiParameter(
                "wait",
                int,
                description=(
                    "Seconds (0..30) to wait for the attempt's outcome; 0 or absent answers at "
                    "once."
                ),
            )
        ],
        responses={
            200: OutputSerializer,
            202: OutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "finalization_not_ready"),
                (409, "finalization_not_acquired"),
                (409, "finalization_failed"),
            ),
        },
        summary="Queue a native run's workspace finalization (optionally wait for it)",
    )
    def post(self, request: Request, run_id: UUID) -> Response:
        actor = actor_for(request)
        run = scoped_get(HeartbeatRun.objects.all(), actor, run_id)
        if actor.is_agent and run.agent_id != actor.agent_id:
            raise PermissionDenied("Only the run's own agent or a board member may finalize it.")
        wait = _wait_seconds(request)
        held = finalization_state(run)
        if held.state == "held":
            # Held for the board: no attempt would change that, so none is queued (nothing
            # written), with or without `wait`; the answer names the reason and its remedy.
            raise _not_acquired(run.pk, held.reason)
        queued = finalization_request(
            company_id=run.company_id,
            run_id=run.pk,
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
        )
        if queued.status == "committed":
            return self._answer(run.pk, "committed", finalization_state(run))
        if wait == 0:
            return self._answer(run.pk, "queued", finalization_state(run))
        current = finalization_await(
            company_id=run.company_id, run_id=run.pk, job_id=queued.job_id, timeout=wait
        )
        if current.state == "committed":
            return self._answer(run.pk, "committed", current)
        if current.state == "held":
            raise _not_acquired(run.pk, current.reason)
        if current.state == "failed":
            raise FinalizationFailed(
                run_id=str(run.pk), attempts=current.attempts, last_error=current.last_error
            )
        answer = current.state if current.state in ("running", "retry_scheduled") else "queued"
        return self._answer(run.pk, answer, current)

    def _answer(self, run_id: UUID, answer: str, current: FinalizationState) -> Response:
        body = {"run_id": run_id, "status": answer, "finalization": current.as_json()}
        code = status.HTTP_200_OK if answer == "committed" else status.HTTP_202_ACCEPTED
        return Response(self.OutputSerializer(body).data, status=code)


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


class WorkspaceConflictResolveApi(APIView):
    """A board member resolves a workspace head conflict: `publish` (the run's side of each
    conflicting path) or `keep_head` (the head's side), both merged with every other change of
    both sides, or `discard` (nothing of the run published); the run's finalization is queued.
    With `expected_head`, a head that moved since is refused (409 workspace_head_moved)."""

    permission_classes = (IsBoard,)

    @extend_schema_serializer(component_name="WorkspaceConflictResolveInput")
    class InputSerializer(StrictInputSerializer):
        action_id = UUIDBodyField()
        run_id = UUIDBodyField()
        resolution = serializers.ChoiceField(choices=RESOLUTIONS)
        expected_head = serializers.RegexField(
            BLOB_NAME.pattern, required=False, allow_null=True, max_length=71
        )
        note = serializers.CharField(trim_whitespace=False, max_length=MAX_STOP_EVIDENCE_CHARS)

    @extend_schema_serializer(component_name="WorkspaceConflictResolveOutput")
    class OutputSerializer(serializers.Serializer[Any]):
        run_id = serializers.UUIDField()
        action_id = serializers.UUIDField()
        resolution = serializers.CharField()
        status = serializers.CharField()

    @extend_schema(
        request=InputSerializer,
        responses={
            202: OutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "workspace_conflict_stale"),
                (409, "workspace_head_moved"),
                RESOURCE_BUSY,
            ),
        },
        summary="Resolve a workspace head conflict (publish, keep_head or discard)",
    )
    def post(self, request: Request, issue_id: UUID) -> Response:
        actor = actor_for(request)
        scoped_get(Issue.objects.all(), actor, issue_id)
        values = validated_body(self.InputSerializer, request.data)
        resolved = workspace_conflict_resolve(
            actor=actor,
            issue_id=issue_id,
            action_id=values["action_id"],
            run_id=values["run_id"],
            resolution=values["resolution"],
            note=values["note"],
            expected_head=(
                HeadExpected(values["expected_head"]) if "expected_head" in values else None
            ),
        )
        return Response(
            self.OutputSerializer(
                {
                    "run_id": resolved.run_id,
                    "action_id": resolved.action_id,
                    "resolution": resolved.resolution,
                    "status": resolved.status,
                }
            ).data,
            status=status.HTTP_202_ACCEPTED,
        )


class ConflictOutcomeSerializer(serializers.Serializer[Any]):
    tree = serializers.CharField(allow_null=True)
    changes = ConflictTreeChangeSerializer(many=True)
    truncated = serializers.BooleanField()
    error = serializers.CharField(required=False)


class WorkspaceConflictPreviewApi(APIView):
    """What each resolution of a workspace head conflict would publish against the head of
    now (board): the conflicting paths with each side's entry, and per resolution the tree and
    the paths it adds, removes or modifies relative to that head. Reads only."""

    permission_classes = (IsBoard,)

    @extend_schema_serializer(component_name="WorkspaceConflictPreview")
    class OutputSerializer(serializers.Serializer[Any]):
        class ConflictPathSerializer(serializers.Serializer[Any]):
            path = serializers.CharField()
            base = ConflictTreeEntrySerializer(allow_null=True)
            head = ConflictTreeEntrySerializer(allow_null=True)
            run = ConflictTreeEntrySerializer(allow_null=True)

        class ConflictOutcomesSerializer(serializers.Serializer[Any]):
            publish = ConflictOutcomeSerializer()
            keep_head = ConflictOutcomeSerializer()

        action_id = serializers.UUIDField()
        run_id = serializers.UUIDField()
        base = serializers.CharField(allow_null=True)
        head = serializers.CharField(allow_null=True)
        tree = serializers.CharField()
        conflicts = ConflictPathSerializer(many=True)
        conflict_count = serializers.IntegerField()
        outcomes = ConflictOutcomesSerializer()

    @extend_schema(
        responses={
            200: OutputSerializer,
            **error_responses(*AUTH_ERRORS, NOT_FOUND, (409, "workspace_conflict_unreadable")),
        },
        operation_id="workspace_conflict_preview",
        summary="Preview each resolution of a workspace head conflict against the head of now",
    )
    def get(self, request: Request, issue_id: UUID, action_id: UUID) -> Response:
        actor = actor_for(request)
        scoped_get(Issue.objects.all(), actor, issue_id)
        preview = workspace_conflict_preview(actor=actor, issue_id=issue_id, action_id=action_id)
        # The body is built by the service (entries keep only the keys they have); the
        # serializer above documents it.
        return Response(preview.as_json())


class OwnerStopConfirmApi(APIView):
    """A board member attests the recorded finalization owner stopped; finalization of the
    saved result is queued."""

    permission_classes = (IsBoard,)

    @extend_schema_serializer(component_name="OwnerStopConfirmInput")
    class InputSerializer(StrictInputSerializer):
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
            if (problem := board_text_problem(value)) is not None:
                raise serializers.ValidationError(problem)
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


class WorkspaceExportRetryApi(APIView):
    """A board member repaired what made the run's workspace export fail: one more export
    attempt of the saved result is queued (docs/recovery.md#workspace-export-repair)."""

    permission_classes = (IsBoard,)

    @extend_schema_serializer(component_name="WorkspaceExportRetryInput")
    class InputSerializer(StrictInputSerializer):
        action_id = UUIDBodyField()
        run_id = UUIDBodyField()
        repair_note = serializers.CharField(
            trim_whitespace=False, max_length=MAX_STOP_EVIDENCE_CHARS
        )

        def validate_repair_note(self, value: str) -> str:
            if (problem := board_text_problem(value)) is not None:
                raise serializers.ValidationError(problem)
            return value

    @extend_schema_serializer(component_name="WorkspaceExportRetryOutput")
    class OutputSerializer(serializers.Serializer[Any]):
        run_id = serializers.UUIDField()
        result_id = serializers.UUIDField()
        lease_id = serializers.UUIDField(allow_null=True)
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
                (409, "workspace_export_retry_stale"),
                (409, "workspace_export_stop_unconfirmed"),
                RESOURCE_BUSY,
            ),
        },
        summary="Retry a held workspace export after the board repaired its cause",
    )
    def post(self, request: Request, issue_id: UUID) -> Response:
        actor = actor_for(request)
        scoped_get(Issue.objects.all(), actor, issue_id)
        values = validated_body(self.InputSerializer, request.data)
        retry = workspace_export_retry(
            actor=actor,
            issue_id=issue_id,
            action_id=values["action_id"],
            run_id=values["run_id"],
            repair_note=values["repair_note"],
        )
        return Response(
            self.OutputSerializer(
                {
                    "run_id": retry.run_id,
                    "result_id": retry.result_id,
                    "lease_id": retry.lease_id,
                    "status": retry.status,
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
    class InputSerializer(StrictInputSerializer):
        run_id = UUIDBodyField()
        owner_token = serializers.CharField(max_length=200)
        worker_id = serializers.CharField(max_length=500)
        stopped_at = serializers.CharField(max_length=64)
        signature = serializers.RegexField(r"^[0-9a-fA-F]{64}$(?!\n)")  # not before a newline

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
