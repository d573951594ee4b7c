"""HTTP API of environment leases (docs/api.md#environment-lease-endpoints): environments
(board), the lease lifecycle and the cleanup protocol (provider agents), reads (provider or
board)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_serializer,
    inline_serializer,
)
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from leases.environment.errors import EnvironmentLeaseNotFound
from leases.environment.lifecycle import (
    environment_create,
    environment_lease_acquire,
    environment_lease_heartbeat,
    environment_lease_release,
)
from leases.environment.selectors import environment_lease_get, environment_lease_list
from leases.environment.services import (
    environment_lease_cleanup_claim,
    environment_lease_cleanup_settle,
)
from leases.models import EnvironmentLease
from paperclip.api.auth import IsBoard, IsProviderAgent, IsProviderAgentOrBoard, actor_for
from paperclip.api.core_views import AbsolutePathField
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    NonBlankTextField,
    StrictInputSerializer,
    UUIDBodyField,
    error_responses,
)
from paperclip.models import Environment


@extend_schema_serializer(component_name="EnvironmentLease")
class EnvironmentLeaseOutputSerializer(serializers.ModelSerializer[EnvironmentLease]):
    """The EnvironmentLease JSON shape (`metadata` verbatim, camelCase keys inside)."""

    class Meta:
        model = EnvironmentLease
        fields = (
            "id",
            "company_id",
            "environment_id",
            "execution_workspace_id",
            "issue_id",
            "heartbeat_run_id",
            "status",
            "lease_policy",
            "provider",
            "provider_lease_id",
            "acquired_at",
            "last_used_at",
            "expires_at",
            "released_at",
            "failure_reason",
            "cleanup_status",
            "metadata",
        )
        read_only_fields = fields

    company_id = serializers.UUIDField()
    environment_id = serializers.UUIDField(allow_null=True)
    execution_workspace_id = serializers.UUIDField(allow_null=True)
    issue_id = serializers.UUIDField(allow_null=True)
    heartbeat_run_id = serializers.UUIDField(allow_null=True)
    metadata = serializers.JSONField(allow_null=True)


def _worker_company(request: Request) -> Any:
    agent = actor_for(request).agent
    if agent is None:  # unreachable behind IsAgent
        raise EnvironmentLeaseNotFound()
    return agent.company_id


class EnvironmentLeaseCleanupClaimApi(APIView):
    permission_classes = (IsProviderAgent,)

    @extend_schema_serializer(component_name="EnvironmentLeaseCleanupClaim")
    class OutputSerializer(serializers.Serializer[Any]):
        attempt_id = serializers.CharField()
        expires_at = serializers.DateTimeField()
        stop_only = serializers.BooleanField(
            help_text="True: the allocation must only be stopped, never destroyed."
        )
        lease = EnvironmentLeaseOutputSerializer()

    @extend_schema(
        operation_id="environment_lease_cleanup_claim",
        summary="Claim a pending cleanup attempt for 15 minutes (provider worker).",
        request=None,
        responses={
            200: OutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                NOT_FOUND,
                (409, "cleanup_not_pending"),
                (409, "cleanup_in_flight"),
                (409, "cleanup_retry_not_due"),
                RESOURCE_BUSY,
                (422, "cleanup_intent_invalid"),
            ),
        },
    )
    def post(self, request: Request, lease_id: UUID) -> Response:
        actor = actor_for(request)
        claim = environment_lease_cleanup_claim(
            lease_id=lease_id,
            company_id=_worker_company(request),
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
        )
        return Response(
            self.OutputSerializer(
                {
                    "attempt_id": claim.attempt_id,
                    "expires_at": claim.expires_at,
                    "stop_only": claim.stop_only,
                    "lease": claim.lease,
                }
            ).data
        )


class EnvironmentLeaseCleanupReceiptApi(APIView):
    permission_classes = (IsProviderAgent,)

    @extend_schema_serializer(component_name="EnvironmentLeaseCleanupReceipt")
    class InputSerializer(StrictInputSerializer):
        @extend_schema_serializer(component_name="EnvironmentLeaseCleanupReceiptState")
        class ReceiptSerializer(StrictInputSerializer):
            provider_lease_id = serializers.CharField(max_length=500)
            state = serializers.ChoiceField(choices=("stopped", "destroyed", "failed"))

        attempt_id = serializers.CharField(max_length=200)
        receipt = ReceiptSerializer()

    @extend_schema(
        operation_id="environment_lease_cleanup_receipt",
        summary="Report the outcome of a claimed cleanup attempt; returns the settled lease.",
        request=InputSerializer,
        responses={
            200: EnvironmentLeaseOutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "cleanup_attempt_stale"),
                RESOURCE_BUSY,
            ),
        },
    )
    def post(self, request: Request, lease_id: UUID) -> Response:
        actor = actor_for(request)
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        lease = environment_lease_cleanup_settle(
            lease_id=lease_id,
            company_id=_worker_company(request),
            attempt_id=data["attempt_id"],
            provider_lease_id=data["receipt"]["provider_lease_id"],
            state=data["receipt"]["state"],
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
        )
        return Response(EnvironmentLeaseOutputSerializer(lease).data)


# --- environments (board) ------------------------------------------------------------------------


class EnvironmentOutputSerializer(serializers.Serializer[Environment]):
    id = serializers.UUIDField()
    company_id = serializers.UUIDField()
    name = serializers.CharField()
    driver = serializers.ChoiceField(choices=Environment.Driver.choices)
    status = serializers.ChoiceField(choices=Environment.Status.choices)
    config = serializers.JSONField()
    created_at = serializers.DateTimeField()


class EnvironmentCreateApi(APIView):
    permission_classes = (IsBoard,)

    @extend_schema_serializer(component_name="EnvironmentCreateInput")
    class InputSerializer(StrictInputSerializer):
        name = NonBlankTextField(max_length=200)
        driver = serializers.ChoiceField(choices=Environment.Driver.choices)
        config = serializers.DictField(child=serializers.JSONField(), required=False, default=dict)

    @extend_schema(
        operation_id="environment_create",
        summary="Create an environment of a company (board).",
        request=InputSerializer,
        responses={
            201: EnvironmentOutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def post(self, request: Request, company_id: UUID) -> Response:
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        created = environment_create(
            actor=actor_for(request), company_id=company_id, **body.validated_data
        )
        return Response(
            EnvironmentOutputSerializer(created.environment).data, status=status.HTTP_201_CREATED
        )


# --- the lease lifecycle (provider agents) ---------------------------------------------------


class EnvironmentLeaseAcquireApi(APIView):
    permission_classes = (IsProviderAgent,)

    @extend_schema_serializer(component_name="EnvironmentLeaseAcquireInput")
    class InputSerializer(StrictInputSerializer):
        environment_id = UUIDBodyField()
        heartbeat_run_id = UUIDBodyField()
        execution_workspace_id = UUIDBodyField(required=False, allow_null=True, default=None)
        lease_policy = serializers.ChoiceField(choices=EnvironmentLease.Policy.choices)
        provider = NonBlankTextField(max_length=200)
        provider_lease_id = NonBlankTextField(max_length=500)
        remote_cwd = AbsolutePathField(required=False, allow_null=True, default=None)
        plugin_id = NonBlankTextField(
            max_length=200,
            required=False,
            allow_null=True,
            default=None,
            help_text="The provider plugin; export-resume markers pin it (metadata.pluginId).",
        )

    @extend_schema(
        operation_id="environment_lease_acquire",
        summary="Lease a provider allocation to a run (provider agent); repeats return it.",
        request=InputSerializer,
        responses={
            201: EnvironmentLeaseOutputSerializer,
            200: EnvironmentLeaseOutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "environment_lease_single_flight"),
                (409, "environment_archived"),
                RESOURCE_BUSY,
            ),
        },
    )
    def post(self, request: Request) -> Response:
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        grant = environment_lease_acquire(actor=actor_for(request), **body.validated_data)
        return Response(
            EnvironmentLeaseOutputSerializer(grant.lease).data,
            status=status.HTTP_201_CREATED if grant.created else status.HTTP_200_OK,
        )


class EnvironmentLeaseDetailApi(APIView):
    permission_classes = (IsProviderAgentOrBoard,)

    @extend_schema(
        operation_id="environment_lease_get",
        summary="Read an environment lease (provider agent of its company, or board).",
        responses={
            200: EnvironmentLeaseOutputSerializer,
            **error_responses(*AUTH_ERRORS, NOT_FOUND),
        },
    )
    def get(self, request: Request, lease_id: UUID) -> Response:
        lease = environment_lease_get(actor=actor_for(request), lease_id=lease_id)
        return Response(EnvironmentLeaseOutputSerializer(lease).data)


class EnvironmentLeaseHeartbeatApi(APIView):
    permission_classes = (IsProviderAgent,)

    @extend_schema(
        operation_id="environment_lease_heartbeat",
        summary="Mark an active lease as in use (last_used_at now; provider agent).",
        request=None,
        responses={
            200: EnvironmentLeaseOutputSerializer,
            **error_responses(
                *AUTH_ERRORS, NOT_FOUND, (409, "environment_lease_not_active"), RESOURCE_BUSY
            ),
        },
    )
    def post(self, request: Request, lease_id: UUID) -> Response:
        lease = environment_lease_heartbeat(actor=actor_for(request), lease_id=lease_id)
        return Response(EnvironmentLeaseOutputSerializer(lease).data)


class EnvironmentLeaseReleaseApi(APIView):
    permission_classes = (IsProviderAgent,)

    @extend_schema_serializer(component_name="EnvironmentLeaseReleaseInput")
    class InputSerializer(StrictInputSerializer):
        outcome = serializers.ChoiceField(choices=("succeeded", "failed"))

    @extend_schema(
        operation_id="environment_lease_release",
        summary="Release a lease with the run's outcome; its policy and markers decide the rest.",
        request=InputSerializer,
        responses={
            200: EnvironmentLeaseOutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (409, "environment_lease_not_active"),
                RESOURCE_BUSY,
            ),
        },
    )
    def post(self, request: Request, lease_id: UUID) -> Response:
        body = self.InputSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        released = environment_lease_release(
            actor=actor_for(request), lease_id=lease_id, outcome=body.validated_data["outcome"]
        )
        return Response(EnvironmentLeaseOutputSerializer(released.lease).data)


class EnvironmentLeaseListApi(APIView):
    permission_classes = (IsBoard,)

    class QuerySerializer(StrictInputSerializer):
        status = serializers.ChoiceField(
            choices=EnvironmentLease.Status.choices, required=False, default=None
        )
        heartbeat_run_id = UUIDBodyField(required=False, default=None)

    @extend_schema(
        operation_id="environment_lease_list",
        summary="A company's environment leases, newest first (board).",
        parameters=[
            OpenApiParameter(
                "status", str, OpenApiParameter.QUERY, enum=EnvironmentLease.Status.values
            ),
            OpenApiParameter("heartbeat_run_id", UUID, OpenApiParameter.QUERY),
        ],
        responses={
            200: inline_serializer(
                name="EnvironmentLeaseList",
                fields={"results": EnvironmentLeaseOutputSerializer(many=True)},
            ),
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def get(self, request: Request, company_id: UUID) -> Response:
        query = self.QuerySerializer(data=request.query_params.dict())
        query.is_valid(raise_exception=True)
        leases = environment_lease_list(
            actor=actor_for(request), company_id=company_id, **query.validated_data
        )
        return Response({"results": EnvironmentLeaseOutputSerializer(leases, many=True).data})
