"""HTTP API of runtime leases (docs/api.md#runtime-lease-endpoints).

Authorization, in order: authentication (401), the workspace must be in a company the actor
may see (404 otherwise, never revealing another company's workspace), then the owner ids:
an issue or run outside the workspace's company is a 404, a run of another agent of the same
company is a 403. Board actors bypass the lease; only they may force-release (an agent
sending `force` gets 403). Fenced operations are for agents only (a board has no owner key).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import UUID

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiExample,
    OpenApiParameter,
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import serializers, status
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from leases import services
from leases.selectors import STALE_REASONS, RuntimeLease
from leases.services.shared import iso
from paperclip.access import Actor, scoped_get
from paperclip.api.auth import IsAgent, IsAgentOrBoard, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    StrictInputSerializer,
    UUIDBodyField,
    error_responses,
    shared_serializer,
    validated_body,
)
from paperclip.errors import NotFoundError, PermissionDenied
from paperclip.models import ExecutionWorkspace, HeartbeatRun, Issue, WorkspaceOperation

WORKSPACE_ID = OpenApiParameter(
    "workspace_id", OpenApiTypes.UUID, OpenApiParameter.PATH, description="Execution workspace."
)

COMMON_ERRORS = (INVALID_REQUEST, *AUTH_ERRORS, NOT_FOUND, RESOURCE_BUSY)


@extend_schema_serializer(component_name="RuntimeLease")
class LeaseSerializer(serializers.Serializer[RuntimeLease]):
    id = serializers.UUIDField()
    company_id = serializers.UUIDField()
    execution_workspace_id = serializers.UUIDField()
    owner_key = serializers.CharField()
    owner_issue_id = serializers.UUIDField(allow_null=True)
    owner_run_id = serializers.UUIDField(allow_null=True)
    owner_agent_id = serializers.UUIDField(allow_null=True)
    last_action = serializers.ChoiceField(choices=services.LEASED_ACTIONS)
    generation = serializers.IntegerField(help_text="Fencing token; never repeats per workspace.")
    fence = serializers.IntegerField(
        help_text=(
            "Strictly increases with every grant of the workspace, also across a database "
            "failover that lost the last grants; pass it to systems that must order writers."
        )
    )
    claimed_at = serializers.DateTimeField()
    renewed_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()
    metadata = serializers.JSONField(
        allow_null=True, help_text="After a reclaim: reclaimedFromOwnerKey, reclaimReason, …"
    )

    def to_representation(self, instance: RuntimeLease) -> dict[str, Any]:
        """The declared fields rendered straight from the lease's attributes: the same JSON as
        DRF's field-by-field rendering (a test holds the two equal), at a fraction of its cost
        on the most frequent response, a renew's (bench/renew_load.py)."""
        return {name: render(getattr(instance, name)) for name, render in _lease_renderers()}


def _uuid_text(value: UUID | None) -> str | None:
    return None if value is None else str(value)


def _datetime_text(value: datetime) -> str:
    return iso(value)


def _as_is(value: Any) -> Any:
    return value


@functools.cache
def _lease_renderers() -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """(field name, converter) for each LeaseSerializer field, by field type; a type without a
    converter here fails at once, rather than rendering differently from DRF."""
    renderers: list[tuple[str, Callable[[Any], Any]]] = []
    for name, field in LeaseSerializer().fields.items():
        if isinstance(field, serializers.UUIDField):
            renderers.append((name, _uuid_text))
        elif isinstance(field, serializers.DateTimeField) and not field.allow_null:
            renderers.append((name, _datetime_text))
        elif isinstance(field, serializers.IntegerField) and not field.allow_null:
            renderers.append((name, int))
        elif isinstance(
            field, serializers.ChoiceField | serializers.CharField | serializers.JSONField
        ):
            renderers.append((name, _as_is))  # str already (choices are their own values), JSON
        else:  # pragma: no cover - guarded by the test comparing with DRF's rendering
            raise TypeError(f"LeaseSerializer.{name}: no fast renderer for {type(field).__name__}")
    return tuple(renderers)


class OwnerInputSerializer(StrictInputSerializer):
    issue_id = UUIDBodyField(required=False, allow_null=True)
    run_id = UUIDBodyField(required=False, allow_null=True)


def _workspace_company(actor: Actor, workspace_id: UUID) -> UUID:
    """The workspace's company if the actor may see it; 404 otherwise.

    An agent acts only inside its own company, so its lookups stay in that company.
    """
    if actor.is_agent and actor.agent is not None:
        return actor.agent.company_id  # the service 404s a workspace outside it
    company_id = (
        ExecutionWorkspace.objects.filter(pk=workspace_id)
        .values_list("company_id", flat=True)
        .first()
    )
    if company_id is None or not actor.can_access(company_id):
        raise NotFoundError("Execution workspace not found.")
    return company_id


def _owner(actor: Actor, company_id: UUID, data: dict[str, Any]) -> services.RuntimeLeaseOwner:
    if actor.is_agent and actor.agent_id is not None:
        return services.RuntimeLeaseOwner.for_agent(
            actor.agent_id, run_id=data.get("run_id"), issue_id=data.get("issue_id")
        )
    # A board member bypasses the lease, but the ids it names must still be objects of the
    # workspace's company (another company's, or no one's, look the same: 404).
    for field, model in (("issue_id", Issue), ("run_id", HeartbeatRun)):
        value = data.get(field)
        if value is not None and not model.objects.filter(pk=value, company_id=company_id).exists():
            raise NotFoundError(f"{field.removesuffix('_id').capitalize()} not found.")
    return services.RuntimeLeaseOwner.for_board(actor.actor_id)


class RuntimeLeaseClaimApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgentOrBoard,)

    @extend_schema_serializer(component_name="RuntimeLeaseClaim")
    class InputSerializer(OwnerInputSerializer):
        action = serializers.ChoiceField(choices=services.LEASED_ACTIONS)
        ttl_seconds = serializers.IntegerField(
            required=False,
            allow_null=True,
            min_value=services.TTL_MIN_SECONDS,
            max_value=services.TTL_MAX_SECONDS,
            help_text="Default: PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS (1800).",
        )

    @extend_schema_serializer(component_name="RuntimeLeaseClaimResponse")
    class OutputSerializer(serializers.Serializer[services.RuntimeLeaseClaim]):
        @extend_schema_serializer(component_name="RuntimeLeaseReclaimedFrom")
        class ReclaimedFromSerializer(serializers.Serializer[services.ReclaimedFrom]):
            owner_key = serializers.CharField()
            reason = serializers.ChoiceField(choices=STALE_REASONS)

        outcome = serializers.ChoiceField(choices=["created", "renewed", "reclaimed", "bypassed"])
        owner_key = serializers.CharField(allow_null=True)
        lease = LeaseSerializer(allow_null=True)
        reclaimed_from = ReclaimedFromSerializer(allow_null=True)

    @extend_schema(
        parameters=[WORKSPACE_ID],
        operation_id="runtime_lease_claim",
        summary="Claim, renew or reclaim the workspace's exclusive runtime lease",
        description=(
            "Owner key: `issue:<id>` if issue_id is given, else `run:<id>`, else "
            "`agent:<calling agent>`. The same owner renews (generation unchanged); a stale "
            "holder is reclaimed with a new generation; board callers are bypassed."
        ),
        request=InputSerializer,
        responses={
            200: OutputSerializer,
            **error_responses(
                *COMMON_ERRORS,
                (409, "workspace_runtime_lease_conflict"),
                (409, "workspace_runtime_lease_contended"),
                (409, "workspace_runtime_lease_owner_ineligible"),
            ),
        },
        examples=[
            OpenApiExample(
                "Claim for an issue",
                {"action": "start", "issue_id": "6f1c2d3e-0000-4000-8000-000000000001"},
                request_only=True,
            ),
        ],
    )
    def post(self, request: Request, workspace_id: UUID) -> Response:
        actor = actor_for(request)
        company_id = _workspace_company(actor, workspace_id)
        values = validated_body(self.InputSerializer, request.data)
        result = services.runtime_lease_claim(
            company_id=company_id,
            execution_workspace_id=workspace_id,
            action=values["action"],
            owner=_owner(actor, company_id, values),
            ttl_seconds=values.get("ttl_seconds"),
        )
        return Response(shared_serializer(self.OutputSerializer).to_representation(result))


class RuntimeLeaseDetailApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgentOrBoard,)

    @extend_schema_serializer(component_name="RuntimeLeaseDetailResponse")
    class OutputSerializer(serializers.Serializer[services.RuntimeLeaseView]):
        lease = LeaseSerializer(allow_null=True)
        stale_reason = serializers.ChoiceField(choices=STALE_REASONS, allow_null=True)

    @extend_schema(
        parameters=[WORKSPACE_ID],
        operation_id="runtime_lease_get",
        summary="The workspace's runtime lease and its live stale reason",
        responses={200: OutputSerializer, **error_responses(*AUTH_ERRORS, NOT_FOUND)},
    )
    def get(self, request: Request, workspace_id: UUID) -> Response:
        actor = actor_for(request)
        company_id = _workspace_company(actor, workspace_id)
        if not ExecutionWorkspace.objects.filter(pk=workspace_id, company_id=company_id).exists():
            raise NotFoundError("Execution workspace not found.")
        view = services.runtime_lease_get(execution_workspace_id=workspace_id)
        return Response(shared_serializer(self.OutputSerializer).to_representation(view))


class RuntimeLeaseReleaseApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgentOrBoard,)

    @extend_schema_serializer(component_name="RuntimeLeaseRelease")
    class InputSerializer(OwnerInputSerializer):
        force = serializers.BooleanField(
            required=False, default=False, help_text="Board only: delete whatever lease exists."
        )
        reason = serializers.CharField(
            required=False, max_length=2000, help_text="Required with force (audited)."
        )

        def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
            if attrs.get("force") and not (attrs.get("reason") or "").strip():
                raise serializers.ValidationError({"reason": ["Required with force."]})
            return attrs

    @extend_schema_serializer(component_name="RuntimeLeaseReleaseResponse")
    class OutputSerializer(serializers.Serializer[services.RuntimeLeaseRelease]):
        released = serializers.BooleanField()
        owner_key = serializers.CharField(allow_null=True)

    @extend_schema(
        parameters=[WORKSPACE_ID],
        operation_id="runtime_lease_release",
        summary="Release the lease you hold (agent) or force-release any lease (board)",
        request=InputSerializer,
        responses={200: OutputSerializer, **error_responses(*COMMON_ERRORS)},
    )
    def post(self, request: Request, workspace_id: UUID) -> Response:
        actor = actor_for(request)
        company_id = _workspace_company(actor, workspace_id)
        body = request.data if isinstance(request.data, dict) else {}
        force = body.get("force")
        if actor.is_agent and force is not None and force is not False:
            # Checked before validation: an agent asking to force is refused, whatever else.
            raise PermissionDenied("Only board members may force-release a runtime lease.")
        values = validated_body(self.InputSerializer, request.data)
        if values["force"]:
            result = services.runtime_lease_force_release(
                company_id=company_id,
                execution_workspace_id=workspace_id,
                actor_type="user",
                actor_id=actor.actor_id,
                reason=values["reason"],
            )
        else:
            result = services.runtime_lease_release(
                company_id=company_id,
                execution_workspace_id=workspace_id,
                owner=_owner(actor, company_id, values),
            )
        return Response(shared_serializer(self.OutputSerializer).to_representation(result))


class WorkspaceOperationCreateApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgent,)

    @extend_schema_serializer(component_name="FencedWorkspaceOperation")
    class InputSerializer(OwnerInputSerializer):
        generation = serializers.IntegerField(min_value=1, max_value=2**63 - 1)
        fence = serializers.IntegerField(
            required=False, allow_null=True, min_value=1, max_value=2**63 - 1
        )
        phase = serializers.CharField(max_length=200)
        command = serializers.CharField(
            required=False, allow_null=True, allow_blank=True, max_length=20_000
        )
        status = serializers.ChoiceField(choices=WorkspaceOperation.Status.values)
        exit_code = serializers.IntegerField(
            required=False, allow_null=True, min_value=-(2**31), max_value=2**31 - 1
        )

    @extend_schema_serializer(component_name="FencedWorkspaceOperationResponse")
    class OutputSerializer(serializers.Serializer[services.WorkspaceOperationRecord]):
        id = serializers.UUIDField()
        company_id = serializers.UUIDField()
        execution_workspace_id = serializers.UUIDField()
        heartbeat_run_id = serializers.UUIDField(allow_null=True)
        issue_id = serializers.UUIDField(allow_null=True)
        actor_agent_id = serializers.UUIDField(allow_null=True)
        phase = serializers.CharField()
        command = serializers.CharField(allow_null=True)
        status = serializers.CharField()
        exit_code = serializers.IntegerField(allow_null=True)
        lease_generation = serializers.IntegerField()
        started_at = serializers.DateTimeField()
        finished_at = serializers.DateTimeField(allow_null=True)

    @extend_schema(
        parameters=[WORKSPACE_ID],
        operation_id="workspace_operation_create",
        summary="Record a workspace operation fenced by the runtime lease generation",
        description=(
            "Accepted only while the caller's owner key holds the lease at `generation` (an "
            "expired lease nobody reclaimed still counts) and that owner is still eligible. "
            "Otherwise 409 `workspace_runtime_lease_superseded` with `current_generation` "
            "(null: no lease), or 409 `workspace_runtime_lease_owner_ineligible` (its issue "
            "ended or is hidden, or its run is terminal)."
        ),
        request=InputSerializer,
        responses={
            201: OutputSerializer,
            **error_responses(
                *COMMON_ERRORS,
                (409, "workspace_runtime_lease_superseded"),
                (409, "workspace_runtime_lease_owner_ineligible"),
                (409, "workspace_runtime_lease_contended"),
            ),
        },
    )
    def post(self, request: Request, workspace_id: UUID) -> Response:
        actor = actor_for(request)
        company_id = _workspace_company(actor, workspace_id)
        values = validated_body(self.InputSerializer, request.data)
        record = services.workspace_operation_create_fenced(
            company_id=company_id,
            execution_workspace_id=workspace_id,
            owner=_owner(actor, company_id, values),
            generation=values["generation"],
            fence=values.get("fence"),
            phase=values["phase"],
            status=values["status"],
            command=values.get("command"),
            exit_code=values.get("exit_code"),
        )
        return Response(
            shared_serializer(self.OutputSerializer).to_representation(record),
            status=status.HTTP_201_CREATED,
        )


class RunSnapshotRegisterApi(APIView):
    """The run's agent registers the tree of its workdir, fenced by the runtime lease."""

    permission_classes: tuple[type[BasePermission], ...] = (IsAgent,)

    @extend_schema_serializer(component_name="RunSnapshotInput")
    class InputSerializer(StrictInputSerializer):
        tree = serializers.CharField(max_length=71)
        base = serializers.CharField(max_length=71, allow_null=True)
        generation = serializers.IntegerField(min_value=1, max_value=2**63 - 1)
        fence = serializers.IntegerField(
            required=False, allow_null=True, min_value=1, max_value=2**63 - 1
        )

    @extend_schema_serializer(component_name="RunSnapshot")
    class OutputSerializer(serializers.Serializer[Any]):
        tree = serializers.CharField()
        base = serializers.CharField(allow_null=True)
        files = serializers.IntegerField()
        bytes = serializers.IntegerField()

    @extend_schema(
        operation_id="run_snapshot_register",
        summary="Register a snapshot of the run's workdir (a tree in the store)",
        description=(
            "Accepted only while the run (or its issue) holds the workspace's runtime lease at "
            "`generation`, and only when every blob the tree and its `base` reach is stored "
            "(409 `snapshot_blobs_missing` with `details.missing`). A malformed tree (symlinks "
            "that loop or climb out included), or a file whose `size` is not its stored blob's "
            "(or its chunks' sum), is 400 `snapshot_tree_invalid` with `details.path` and "
            "`details.reason`; a `base` that is not a directory tree of the company's store is "
            "400 `invalid_request` naming `base`. A repeat is 200."
        ),
        request=InputSerializer,
        responses={
            201: OutputSerializer,
            200: OutputSerializer,
            **error_responses(
                *COMMON_ERRORS,
                (400, "snapshot_tree_invalid"),
                (409, "snapshot_blobs_missing"),
                (409, "workspace_runtime_lease_superseded"),
                (409, "workspace_runtime_lease_owner_ineligible"),
            ),
        },
    )
    def post(self, request: Request, run_id: UUID) -> Response:
        actor = actor_for(request)
        run = scoped_get(HeartbeatRun.objects.all(), actor, run_id)
        if run.agent_id != actor.agent_id:
            raise PermissionDenied("Only the run's own agent may register its snapshots.")
        values = validated_body(self.InputSerializer, request.data)
        registered = services.run_snapshot_register(
            company_id=run.company_id,
            run_id=run.pk,
            agent_id=run.agent_id,
            tree=values["tree"],
            base=values["base"],
            generation=values["generation"],
            fence=values.get("fence"),
        )
        snapshot = registered.snapshot
        return Response(
            {
                "tree": snapshot.tree,
                "base": snapshot.base,
                "files": snapshot.files,
                "bytes": snapshot.bytes,
            },
            status=status.HTTP_201_CREATED if registered.created else status.HTTP_200_OK,
        )
