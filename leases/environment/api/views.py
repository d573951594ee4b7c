"""HTTP API of the provider cleanup protocol (agents of the environment provider)."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from drf_spectacular.utils import (
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from leases.environment.errors import EnvironmentLeaseNotFound
from leases.environment.services import (
    environment_lease_cleanup_claim,
    environment_lease_cleanup_settle,
)
from leases.models import EnvironmentLease
from paperclip.api.auth import IsAgent, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    StrictInputSerializer,
    error_responses,
)


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
    permission_classes = (IsAgent,)

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
    permission_classes = (IsAgent,)

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
