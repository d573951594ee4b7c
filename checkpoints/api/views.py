"""HTTP API of runner checkpoints and the controller lease (docs/api.md#checkpoint-endpoints).

Only the run's own agent reads or writes a checkpoint or its lease; a board member of the
run's company sees part metadata only; another company's run is a plain 404.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.validators import ProhibitNullCharactersValidator
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from checkpoints import selectors, services
from paperclip.access import scoped_get
from paperclip.api.auth import IsAgent, IsAgentOrBoard, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    StrictInputSerializer,
    UUIDBodyField,
    error_responses,
)
from paperclip.errors import InvalidRequest, PermissionDenied
from paperclip.ids import parse_count
from paperclip.models import HeartbeatRun

# `(?!\n)`: Python's `$` also matches before a final newline ("boot\n" passed); the pattern is
# published in the OpenAPI document too, where `$` alone is the end (and the lookahead holds).
BOOT_ID_PATTERN = r"^[A-Za-z0-9._-]{1,128}$(?!\n)"


COMMON_ERRORS = (INVALID_REQUEST, *AUTH_ERRORS, NOT_FOUND)


def _run_for(request: Request, run_id: UUID, *, runner_only: bool) -> HeartbeatRun:
    """The run, visible to the actor (404 otherwise, also for another company's run); with
    `runner_only`, only its own agent may go on (403 for other agents and the board)."""
    actor = actor_for(request)
    run = scoped_get(HeartbeatRun.objects.all(), actor, run_id)
    if runner_only and (actor.agent_id is None or actor.agent_id != run.agent_id):
        raise PermissionDenied("Only the run's own agent may use its checkpoint.")
    return run


def _agent_id(request: Request) -> UUID:
    agent_id = actor_for(request).agent_id
    if agent_id is None:  # pragma: no cover - IsAgent ran first
        raise PermissionDenied()
    return agent_id


class ControllerLeaseAcquireApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgent,)

    class InputSerializer(StrictInputSerializer):
        class Meta:
            ref_name = "ControllerLeaseAcquireInput"

        boot_id = serializers.RegexField(BOOT_ID_PATTERN)
        lease_owner = serializers.CharField(
            required=False, allow_null=True, max_length=400, trim_whitespace=False
        )
        ttl_seconds = serializers.IntegerField(
            required=False,
            default=services.CONTROLLER_LEASE_TTL_DEFAULT,
            min_value=services.CONTROLLER_LEASE_TTL_MIN,
            max_value=services.CONTROLLER_LEASE_TTL_MAX,
        )

    class OutputSerializer(serializers.Serializer[Any]):
        class Meta:
            ref_name = "ControllerLeaseAcquireOutput"

        lease_owner = serializers.CharField()
        controller_boot_id = serializers.CharField()
        generation = serializers.IntegerField()
        lease_expires_at = serializers.DateTimeField()
        outcome = serializers.ChoiceField(choices=["acquired", "renewed", "taken_over"])

    @extend_schema(
        operation_id="controller_lease_acquire",
        summary="Acquire, renew or take over the run's controller lease",
        request=InputSerializer,
        responses={
            200: OutputSerializer,
            **error_responses(
                *COMMON_ERRORS,
                (409, "controller_lease_held"),
                (409, "controller_lease_run_terminal"),
                RESOURCE_BUSY,
                (422, "controller_lease_run_not_native"),
            ),
        },
    )
    def post(self, request: Request, run_id: UUID) -> Response:
        run = _run_for(request, run_id, runner_only=True)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        lease = services.controller_lease_acquire(
            run_id=run.pk,
            agent_id=_agent_id(request),
            boot_id=data.validated_data["boot_id"],
            lease_owner=data.validated_data.get("lease_owner"),
            ttl_seconds=data.validated_data["ttl_seconds"],
        )
        return Response(self.OutputSerializer(lease).data)


class ControllerLeaseExpireApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgent,)

    class InputSerializer(StrictInputSerializer):
        class Meta:
            ref_name = "ControllerLeaseExpireInput"

        boot_id = serializers.RegexField(BOOT_ID_PATTERN)
        lease_owner = serializers.CharField(max_length=400, trim_whitespace=False)

    class OutputSerializer(serializers.Serializer[Any]):
        class Meta:
            ref_name = "ControllerLeaseExpireOutput"

        expired = serializers.BooleanField()

    @extend_schema(
        operation_id="controller_lease_expire_on_failure",
        summary="Writer-failure hook: end the lease now (same boot and owner, no result only)",
        request=InputSerializer,
        responses={
            200: OutputSerializer,
            **error_responses(
                *COMMON_ERRORS, RESOURCE_BUSY, (422, "controller_lease_run_not_native")
            ),
        },
    )
    def post(self, request: Request, run_id: UUID) -> Response:
        run = _run_for(request, run_id, runner_only=True)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        expired = services.controller_lease_expire_on_failure(
            run_id=run.pk,
            agent_id=_agent_id(request),
            boot_id=data.validated_data["boot_id"],
            lease_owner=data.validated_data["lease_owner"],
        )
        return Response(self.OutputSerializer({"expired": expired}).data)


class _ContentsField(serializers.CharField):
    """Part contents: any JSON string, NUL included (it is encrypted, never stored as text);
    unpaired surrogates are still refused (they have no UTF-8 form)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_blank=True, trim_whitespace=False, **kwargs)
        self.validators = [
            v for v in self.validators if not isinstance(v, ProhibitNullCharactersValidator)
        ]


class _StrictStringDict(serializers.DictField):
    """A JSON object of strings that rejects non-string values instead of coercing them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=_ContentsField(), **kwargs)

    def to_internal_value(self, data: Any) -> dict[str, str]:
        if isinstance(data, dict):
            bad = [k for k, v in data.items() if not isinstance(v, str)]
            if bad:
                raise serializers.ValidationError(
                    f"Part contents must be strings: {', '.join(map(repr, bad[:5]))}."
                )
        return dict(super().to_internal_value(data))


class _StrictStringList(serializers.ListField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(child=serializers.CharField(trim_whitespace=False), **kwargs)

    def to_internal_value(self, data: Any) -> list[str]:
        if isinstance(data, list) and not all(isinstance(v, str) for v in data):
            raise serializers.ValidationError("Items must be strings.")
        return list(super().to_internal_value(data))


class CheckpointApi(APIView):
    """PUT writes and GET reads the same resource. One view serves both methods because a URL
    maps to one view; each method is still one operation with its own serializers."""

    permission_classes: tuple[type[BasePermission], ...] = (IsAgent,)

    class WriteInputSerializer(StrictInputSerializer):
        class Meta:
            ref_name = "CheckpointWriteInput"

        class OwnerSerializer(StrictInputSerializer):
            class Meta:
                ref_name = "CheckpointOwner"

            boot_id = serializers.RegexField(BOOT_ID_PATTERN)
            lease_owner = serializers.CharField(max_length=400, trim_whitespace=False)
            generation = serializers.IntegerField(min_value=0, max_value=services.GENERATION_MAX)
            authority_run_id = UUIDBodyField(required=False, allow_null=True)

        class PredecessorSerializer(StrictInputSerializer):
            class Meta:
                ref_name = "CheckpointPredecessor"

            run_id = UUIDBodyField()
            normalized_session_id = UUIDBodyField()

        owner = OwnerSerializer()
        reset = serializers.BooleanField()
        changed = _StrictStringDict(required=False, default=dict)
        removed = _StrictStringList(required=False, default=list)
        work_command_ids = _StrictStringList(required=False, default=list)
        predecessor = PredecessorSerializer(required=False, allow_null=True, default=None)

    class WriteOutputSerializer(serializers.Serializer[Any]):
        class Meta:
            ref_name = "CheckpointWriteOutput"

        parts = serializers.IntegerField(help_text="Parts stored for the run after the write.")

    class ReadOutputSerializer(serializers.Serializer[Any]):
        class Meta:
            ref_name = "CheckpointReadOutput"

        parts = serializers.DictField(child=serializers.CharField())

    @extend_schema(
        operation_id="checkpoint_write",
        summary="Write a checkpoint snapshot (fenced by the controller lease)",
        request=WriteInputSerializer,
        responses={
            200: WriteOutputSerializer,
            **error_responses(
                *COMMON_ERRORS,
                (409, "native_runner_checkpoint_owner_lost"),
                RESOURCE_BUSY,
                (422, "native_runner_checkpoint_binding_mismatch"),
                (422, "controller_lease_run_not_native"),
            ),
        },
    )
    def put(self, request: Request, run_id: UUID) -> Response:
        run = _run_for(request, run_id, runner_only=True)
        self._check_body_size(request)
        data = self.WriteInputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        owner, pred = v["owner"], v["predecessor"]
        result = services.checkpoint_write(
            run_id=run.pk,
            agent_id=_agent_id(request),
            owner=services.CheckpointOwner(
                boot_id=owner["boot_id"],
                lease_owner=owner["lease_owner"],
                generation=owner["generation"],
                authority_run_id=owner.get("authority_run_id"),
            ),
            reset=v["reset"],
            changed=v["changed"],
            removed=v["removed"],
            work_command_ids=v["work_command_ids"],
            predecessor=services.Predecessor(
                run_id=pred["run_id"], normalized_session_id=pred["normalized_session_id"]
            )
            if pred
            else None,
        )
        return Response(self.WriteOutputSerializer(result).data)

    @staticmethod
    def _check_body_size(request: Request) -> None:
        # DRF parses the raw stream, so Django's DATA_UPLOAD_MAX_MEMORY_SIZE does not apply
        # here: refuse oversized bodies from the header before parsing them into memory.
        limit = 2 * services.max_write_bytes() + 1024 * 1024  # JSON escaping headroom
        # A length that is not a number was refused before any view (RequestBodyMiddleware).
        length = parse_count(request.META.get("CONTENT_LENGTH") or "0", high=2**63 - 1) or 0
        if length > limit:
            raise InvalidRequest(
                "The request body is too large.",
                fields={"body": [f"At most {limit} bytes."]},
            )

    @extend_schema(
        operation_id="checkpoint_read",
        summary="Read every part of the run's checkpoint (the run's agent only)",
        parameters=[
            OpenApiParameter(
                "normalized_session_id",
                str,
                description="Restore check: the header's recoveryEvidence.normalizedSessionId "
                "must equal this, else 422 native_runner_checkpoint_binding_mismatch.",
            )
        ],
        responses={
            200: ReadOutputSerializer,
            **error_responses(
                *COMMON_ERRORS,
                (422, "native_runner_checkpoint_unreadable"),
                (422, "native_runner_checkpoint_binding_mismatch"),
                (422, "controller_lease_run_not_native"),
            ),
        },
    )
    def get(self, request: Request, run_id: UUID) -> Response:
        run = _run_for(request, run_id, runner_only=True)
        binding = selectors.runner_run_get(run_id=run.pk, agent_id=_agent_id(request)).binding
        session = request.query_params.get("normalized_session_id")
        if session is not None:
            parts = selectors.checkpoint_restore(binding=binding, normalized_session_id=session)
        else:
            parts = selectors.checkpoint_load(binding=binding)
        return Response(self.ReadOutputSerializer({"parts": parts or {}}).data)


class CheckpointHeaderApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgent,)

    class OutputSerializer(serializers.Serializer[Any]):
        class Meta:
            ref_name = "CheckpointHeaderOutput"

        header = serializers.CharField(allow_null=True)

    @extend_schema(
        operation_id="checkpoint_header_read",
        summary="Read the checkpoint's header part (null when missing or unreadable)",
        responses={
            200: OutputSerializer,
            **error_responses(*COMMON_ERRORS, (422, "controller_lease_run_not_native")),
        },
    )
    def get(self, request: Request, run_id: UUID) -> Response:
        run = _run_for(request, run_id, runner_only=True)
        binding = selectors.runner_run_get(run_id=run.pk, agent_id=_agent_id(request)).binding
        header = selectors.checkpoint_header_load(binding=binding)
        return Response(self.OutputSerializer({"header": header}).data)


class CheckpointPartsListApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgentOrBoard,)

    class OutputSerializer(serializers.Serializer[Any]):
        class Meta:
            ref_name = "CheckpointPartsListOutput"

        class PartSerializer(serializers.Serializer[Any]):
            class Meta:
                ref_name = "CheckpointPartInfo"

            part = serializers.CharField()
            size_bytes = serializers.IntegerField()
            key_id = serializers.CharField(allow_null=True)
            created_at = serializers.DateTimeField()
            updated_at = serializers.DateTimeField()

        results = PartSerializer(many=True)

    @extend_schema(
        operation_id="checkpoint_parts_list",
        summary="List the checkpoint's parts: names, sizes, key ids, times (never contents)",
        responses={
            200: OutputSerializer,
            **error_responses(*COMMON_ERRORS, (422, "controller_lease_run_not_native")),
        },
    )
    def get(self, request: Request, run_id: UUID) -> Response:
        actor = actor_for(request)
        run = _run_for(request, run_id, runner_only=actor.is_agent)
        binding = selectors.runner_run_get(run_id=run.pk, agent_id=None).binding
        parts = selectors.checkpoint_parts_list(binding=binding)
        return Response(self.OutputSerializer({"results": parts}).data, status=status.HTTP_200_OK)
