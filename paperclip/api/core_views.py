"""Core API (docs/api.md#core-endpoints): one APIView per operation.

Views translate input, call one service and render its result; services raise DomainErrors,
which `paperclip.api.errors` renders. A path serving two methods (GET and PATCH on the same
resource) is one class with one method per operation, because Django routes a path to a
single view; each method still has its own Input/Output serializers and schema.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema, extend_schema_serializer
from rest_framework import serializers, status
from rest_framework.generics import ListAPIView
from rest_framework.pagination import CursorPagination
from rest_framework.permissions import IsAuthenticated
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from paperclip import selectors, services
from paperclip.api.auth import IsAgent, IsAgentOrBoard, IsBoard, IsSuperuserBoard, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    AgentOutputSerializer,
    CompanyOutputSerializer,
    ExecutionWorkspaceOutputSerializer,
    IssueOutputSerializer,
    NonBlankTextField,
    RunOutputSerializer,
    StrictInputSerializer,
    UUIDBodyField,
    error_responses,
    validated_body,
)
from paperclip.models import Agent, Company, ExecutionWorkspace, HeartbeatRun, Issue

NAME_MAX = 200
TITLE_MAX = 1000
PATH_MAX = 4096


class AbsolutePathField(serializers.CharField):
    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", PATH_MAX)
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if (problem := services.absolute_path_error(value)) is not None:
            raise serializers.ValidationError(problem)
        return value


# --- me --------------------------------------------------------------------------------------


@extend_schema_serializer(component_name="MeUser")
class MeUserSerializer(serializers.Serializer[Any]):
    id = serializers.IntegerField()
    username = serializers.CharField()
    is_superuser = serializers.BooleanField()


class MeApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="Me")
    class OutputSerializer(serializers.Serializer[Any]):
        actor_type = serializers.ChoiceField(choices=["agent", "board"])
        agent_id = serializers.UUIDField(required=False, help_text="Agents only.")
        user = MeUserSerializer(required=False, help_text="Board members only.")
        company_ids = serializers.ListField(child=serializers.UUIDField())

    @extend_schema(
        operation_id="me",
        summary="Who am I: actor type, agent or user, and the companies I can act in",
        responses={200: OutputSerializer, **error_responses(*AUTH_ERRORS)},
    )
    def get(self, request: Request) -> Response:
        actor = actor_for(request)
        body: dict[str, Any] = {"actor_type": actor.type}
        if actor.is_agent:
            body["agent_id"] = str(actor.agent_id)
        elif actor.user is not None:
            body["user"] = {
                "id": actor.user.pk,
                "username": actor.user.get_username(),
                "is_superuser": actor.is_superuser,
            }
        ids = (
            Company.objects.order_by("pk").values_list("pk", flat=True)
            if actor.company_ids is None
            else sorted(actor.company_ids)
        )
        body["company_ids"] = [str(pk) for pk in ids]
        return Response(body)


class NewestFirst(CursorPagination):
    """100 a page, newest first, with a cursor link to the next page."""

    page_size = 100
    ordering = ("-created_at", "-id")

    def get_paginated_response(self, data: Any) -> Response:
        return Response({"results": data, "next": self.get_next_link()})

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "object",
            "required": ["results", "next"],
            "properties": {
                "results": schema,
                "next": {"type": "string", "format": "uri", "nullable": True},
            },
        }


class _AgentLookupApi(ListAPIView):  # type: ignore[type-arg]
    """An agent's own lookups (docs/api.md#agents-lookups): read-only, in its company."""

    permission_classes = (IsAuthenticated, IsAgent)
    pagination_class = NewestFirst


class MyIssuesApi(_AgentLookupApi):
    serializer_class = IssueOutputSerializer

    def get_queryset(self) -> QuerySet[Issue]:
        agent = actor_for(self.request).agent
        assert agent is not None  # noqa: S101 - IsAgent
        return Issue.objects.filter(
            company_id=agent.company_id, assignee_agent_id=agent.pk, hidden_at__isnull=True
        )

    @extend_schema(
        operation_id="my_issues",
        summary="The issues assigned to the calling agent (not hidden), newest first",
        responses={
            200: IssueOutputSerializer(many=True),
            **error_responses(*AUTH_ERRORS, NOT_FOUND),
        },
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


class MyExecutionWorkspacesApi(_AgentLookupApi):
    serializer_class = ExecutionWorkspaceOutputSerializer

    def get_queryset(self) -> QuerySet[ExecutionWorkspace]:
        agent = actor_for(self.request).agent
        assert agent is not None  # noqa: S101 - IsAgent
        return ExecutionWorkspace.objects.filter(company_id=agent.company_id)

    @extend_schema(
        operation_id="my_execution_workspaces",
        summary="The execution workspaces of the calling agent's company, newest first",
        responses={
            200: ExecutionWorkspaceOutputSerializer(many=True),
            **error_responses(*AUTH_ERRORS, NOT_FOUND),
        },
    )
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().get(request, *args, **kwargs)


# --- companies, agents, keys ------------------------------------------------------------------


class CompanyCreateApi(APIView):
    permission_classes = (IsAuthenticated, IsSuperuserBoard)

    @extend_schema_serializer(component_name="CompanyCreateInput")
    class InputSerializer(StrictInputSerializer):
        name = NonBlankTextField(max_length=NAME_MAX)

    @extend_schema(
        operation_id="company_create",
        summary="Create a company (superuser); the caller becomes a board member of it",
        request=InputSerializer,
        responses={201: CompanyOutputSerializer, **error_responses(*AUTH_ERRORS, INVALID_REQUEST)},
    )
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.company_create(actor=actor_for(request), **data.validated_data)
        return Response(
            CompanyOutputSerializer(result.company).data, status=status.HTTP_201_CREATED
        )


class AgentCreateApi(APIView):
    permission_classes = (IsAuthenticated, IsBoard)

    @extend_schema_serializer(component_name="AgentCreateInput")
    class InputSerializer(StrictInputSerializer):
        name = NonBlankTextField(max_length=NAME_MAX)
        role = serializers.ChoiceField(
            choices=Agent.Role.choices,
            required=False,
            default=Agent.Role.WORKER,
            help_text="`provider` agents drive environment leases and cleanups; default worker.",
        )

    @extend_schema(
        operation_id="agent_create",
        summary="Create an agent in a company (board)",
        request=InputSerializer,
        responses={
            201: AgentOutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def post(self, request: Request, company_id: UUID) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.agent_create(
            actor=actor_for(request), company_id=company_id, **data.validated_data
        )
        return Response(AgentOutputSerializer(result.agent).data, status=status.HTTP_201_CREATED)


class AgentKeyCreateApi(APIView):
    permission_classes = (IsAuthenticated, IsBoard)

    @extend_schema_serializer(component_name="AgentKeyCreateInput")
    class InputSerializer(StrictInputSerializer):
        name = serializers.CharField(max_length=NAME_MAX, required=False, default="")

    @extend_schema_serializer(component_name="AgentKeyIssued")
    class OutputSerializer(serializers.Serializer[Any]):
        key = serializers.CharField(
            help_text="The bearer secret `pcak_<prefix>.<secret>`, shown once."
        )
        id = serializers.UUIDField()
        prefix = serializers.CharField()
        agent_id = serializers.UUIDField()

    @extend_schema(
        operation_id="agent_key_create",
        summary="Mint an API key for an agent (board); the secret is shown only in this response",
        request=InputSerializer,
        responses={
            201: OutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def post(self, request: Request, agent_id: UUID) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        issued = services.agent_key_issue(
            actor=actor_for(request), agent_id=agent_id, **data.validated_data
        )
        body = {
            "key": issued.secret,
            "id": issued.id,
            "prefix": issued.prefix,
            "agent_id": agent_id,
        }
        return Response(self.OutputSerializer(body).data, status=status.HTTP_201_CREATED)


class AgentKeyRevokeApi(APIView):
    permission_classes = (IsAuthenticated, IsBoard)

    @extend_schema_serializer(component_name="AgentKeyRevoked")
    class OutputSerializer(serializers.Serializer[Any]):
        id = serializers.UUIDField()
        prefix = serializers.CharField()
        revoked_at = serializers.DateTimeField()

    @extend_schema(
        operation_id="agent_key_revoke",
        summary="Revoke an agent key (board); idempotent",
        request=None,
        responses={200: OutputSerializer, **error_responses(*AUTH_ERRORS, NOT_FOUND)},
    )
    def post(self, request: Request, key_id: UUID) -> Response:
        result = services.agent_key_revoke(actor=actor_for(request), key_id=key_id)
        return Response(self.OutputSerializer(result).data)


# --- issues -----------------------------------------------------------------------------------


class IssueCreateApi(APIView):
    permission_classes = (IsAuthenticated, IsBoard)

    @extend_schema_serializer(component_name="IssueCreateInput")
    class InputSerializer(StrictInputSerializer):
        title = NonBlankTextField(max_length=TITLE_MAX)
        status = serializers.ChoiceField(
            choices=Issue.Status.choices, required=False, default=Issue.Status.BACKLOG
        )
        assignee_agent_id = UUIDBodyField(required=False, allow_null=True, default=None)

    @extend_schema(
        operation_id="issue_create",
        summary="Create an issue (board); the assignee must be an agent of the company",
        request=InputSerializer,
        responses={
            201: IssueOutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def post(self, request: Request, company_id: UUID) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.issue_create(
            actor=actor_for(request), company_id=company_id, **data.validated_data
        )
        return Response(IssueOutputSerializer(result.issue).data, status=status.HTTP_201_CREATED)


class IssueDetailApi(APIView):
    """GET (board member or agent of the company) and PATCH (board) of one issue."""

    def get_permissions(self) -> list[Any]:
        if self.request.method == "PATCH":
            return [IsAuthenticated(), IsBoard()]
        return [IsAuthenticated(), IsAgentOrBoard()]

    @extend_schema_serializer(component_name="IssueUpdateInput")
    class UpdateInputSerializer(StrictInputSerializer):
        status = serializers.ChoiceField(choices=Issue.Status.choices, required=False)
        hidden = serializers.BooleanField(
            required=False, help_text="true sets hidden_at to now(); false clears it."
        )

        def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
            if not attrs:
                raise serializers.ValidationError("Give status and/or hidden.")
            return attrs

    @extend_schema(
        operation_id="issue_get",
        summary="Read an issue",
        responses={200: IssueOutputSerializer, **error_responses(*AUTH_ERRORS, NOT_FOUND)},
    )
    def get(self, request: Request, issue_id: UUID) -> Response:
        issue = selectors.issue_get(actor=actor_for(request), issue_id=issue_id)
        return Response(IssueOutputSerializer(issue).data)

    @extend_schema(
        operation_id="issue_update",
        summary="Change an issue's status or hide/unhide it (board)",
        request=UpdateInputSerializer,
        responses={
            200: IssueOutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND, RESOURCE_BUSY),
        },
    )
    def patch(self, request: Request, issue_id: UUID) -> Response:
        data = self.UpdateInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.issue_update(
            actor=actor_for(request), issue_id=issue_id, **data.validated_data
        )
        return Response(IssueOutputSerializer(result.issue).data)


# --- execution workspaces ---------------------------------------------------------------------


class ExecutionWorkspaceCreateApi(APIView):
    permission_classes = (IsAuthenticated, IsBoard)

    @extend_schema_serializer(component_name="ExecutionWorkspaceCreateInput")
    class InputSerializer(StrictInputSerializer):
        name = NonBlankTextField(max_length=NAME_MAX)
        cwd = AbsolutePathField(required=False, allow_null=True, default=None)

    @extend_schema(
        operation_id="execution_workspace_create",
        summary="Create an execution workspace (board); cwd must be an absolute path",
        request=InputSerializer,
        responses={
            201: ExecutionWorkspaceOutputSerializer,
            **error_responses(
                *AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND, (422, "workspace_cwd_not_allowed")
            ),
        },
    )
    def post(self, request: Request, company_id: UUID) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.execution_workspace_create(
            actor=actor_for(request), company_id=company_id, **data.validated_data
        )
        return Response(
            ExecutionWorkspaceOutputSerializer(result.workspace).data,
            status=status.HTTP_201_CREATED,
        )


class ExecutionWorkspaceGetApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema(
        operation_id="execution_workspace_get",
        summary="Read an execution workspace",
        responses={
            200: ExecutionWorkspaceOutputSerializer,
            **error_responses(*AUTH_ERRORS, NOT_FOUND),
        },
    )
    def get(self, request: Request, workspace_id: UUID) -> Response:
        workspace = selectors.execution_workspace_get(
            actor=actor_for(request), workspace_id=workspace_id
        )
        return Response(ExecutionWorkspaceOutputSerializer(workspace).data)


# --- heartbeat runs ---------------------------------------------------------------------------


class RunCreateApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="RunCreateInput")
    class InputSerializer(StrictInputSerializer):
        agent_id = UUIDBodyField(
            required=False, allow_null=True, default=None, help_text="Required for a board caller."
        )
        issue_id = UUIDBodyField(
            required=False, allow_null=True, default=None, help_text="Required for native runs."
        )
        runtime_mode = serializers.ChoiceField(choices=HeartbeatRun.RuntimeMode.choices)
        execution_workspace_id = UUIDBodyField(required=False, allow_null=True, default=None)
        workspace_dir = AbsolutePathField(
            required=False,
            allow_null=True,
            default=None,
            help_text="Absolute directory the runner works in (copied back at finalization).",
        )

        def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
            if attrs["runtime_mode"] == HeartbeatRun.RuntimeMode.NATIVE and not attrs["issue_id"]:
                raise serializers.ValidationError({"issue_id": ["Required for native runs."]})
            return attrs

    @extend_schema(
        operation_id="heartbeat_run_create",
        summary="Queue a heartbeat run (agent: for itself; board: agent_id required)",
        request=InputSerializer,
        responses={
            201: RunOutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND, (422, "agent_not_active")),
        },
    )
    def post(self, request: Request) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.run_create(actor=actor_for(request), **data.validated_data)
        return Response(RunOutputSerializer(result.run).data, status=status.HTTP_201_CREATED)


class RunInterruptApi(APIView):
    """The board marks a live run interrupted at once (its agent is gone)."""

    permission_classes = (IsAuthenticated, IsBoard)

    @extend_schema_serializer(component_name="RunInterruptInput")
    class InputSerializer(StrictInputSerializer):
        reason = serializers.CharField(min_length=1, max_length=2000)

    @extend_schema(
        operation_id="heartbeat_run_interrupt",
        summary="Mark a live run interrupted now (board), releasing its issue",
        request=InputSerializer,
        responses={
            200: RunOutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                RESOURCE_BUSY,
                (422, "invalid_run_transition"),
            ),
        },
    )
    def post(self, request: Request, run_id: UUID) -> Response:
        actor = actor_for(request)
        values = validated_body(self.InputSerializer, request.data)
        run = services.run_interrupt(
            company_ids=actor.company_ids,
            run_id=run_id,
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
            reason=values["reason"],
        )
        assert run is not None  # noqa: S101 - no `still` judge: it always acts or raises
        return Response(RunOutputSerializer(run).data)


class RunDetailApi(APIView):
    """GET (board member or agent of the company) and PATCH (its agent or board) of one run."""

    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="RunUpdateInput")
    class UpdateInputSerializer(StrictInputSerializer):
        status = serializers.ChoiceField(choices=HeartbeatRun.Status.choices)

    @extend_schema(
        operation_id="heartbeat_run_get",
        summary="Read a heartbeat run",
        responses={200: RunOutputSerializer, **error_responses(*AUTH_ERRORS, NOT_FOUND)},
    )
    def get(self, request: Request, run_id: UUID) -> Response:
        run = selectors.run_get(actor=actor_for(request), run_id=run_id)
        return Response(RunOutputSerializer(run).data)

    @extend_schema(
        operation_id="heartbeat_run_update",
        summary="Move a run along queued -> running -> terminal (its agent or board)",
        description=(
            "Same status: idempotent 200. From a terminal status, or queued -> succeeded: 422 "
            "invalid_run_transition. Moving to running takes the issue's execution lock "
            "(409 issue_execution_locked while another live run holds it); a terminal status "
            "releases it. A native run with an accepted result reaches succeeded only through "
            "finalization (422)."
        ),
        request=UpdateInputSerializer,
        responses={
            200: RunOutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "issue_execution_locked"),
                RESOURCE_BUSY,
                (422, "invalid_run_transition"),
            ),
        },
    )
    def patch(self, request: Request, run_id: UUID) -> Response:
        data = self.UpdateInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        result = services.run_transition(
            actor=actor_for(request), run_id=run_id, to_status=data.validated_data["status"]
        )
        return Response(RunOutputSerializer(result.run).data)
