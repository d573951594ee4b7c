"""Reusable output serializers of the core models and the error body (for the schema).

Other apps import these to render core objects the same way everywhere, e.g.
`run_to_json(run)` inside their own responses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from uuid import UUID

from drf_spectacular.utils import OpenApiResponse, extend_schema_field, extend_schema_serializer
from rest_framework import serializers

from paperclip.ids import parse_uuid
from paperclip.models import Agent, Company, ExecutionWorkspace, HeartbeatRun, Issue
from paperclip.receipts import owner_receipt_json


def _json_type_error(field: serializers.Field[Any, Any, Any, Any], value: Any) -> str | None:
    """What is wrong with `value`'s JSON type for `field`, or None: the one strictness rule of
    every input body (docs/api.md#strict-bodies). A number is never text and text never a
    number, a float is never an integer, only `true` / `false` are booleans."""
    if value is None:
        return None  # `allow_null` decides
    if isinstance(field, serializers.BooleanField):
        return None if isinstance(value, bool) else "Must be true or false."
    if isinstance(field, serializers.IntegerField):
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else "Must be a whole number."
    if isinstance(field, serializers.FloatField | serializers.DecimalField):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else "Must be a number."
    if isinstance(
        field,
        serializers.CharField
        | serializers.ChoiceField
        | serializers.UUIDField
        | serializers.DateTimeField,
    ):
        return None if isinstance(value, str) else "Must be a string."
    if isinstance(field, serializers.DictField | serializers.Serializer):
        return None if isinstance(value, dict) else "Must be an object."
    if isinstance(field, serializers.ListField | serializers.ListSerializer):
        return None if isinstance(value, list) else "Must be an array."
    return None  # JSONField and friends take any JSON value


class StrictInputSerializer(serializers.Serializer[Any]):
    """The base of every request body (nested objects included): an unknown key or a value of
    the wrong JSON type is a 400 naming the field, instead of being ignored or coerced. Text is
    taken as sent (never trimmed), so what the schema allows is exactly what is accepted."""

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        for field in fields.values():
            if isinstance(field, serializers.CharField):
                field.trim_whitespace = False
        return fields

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict):
            errors: dict[str, list[str]] = {
                str(name): ["Unknown field."] for name in sorted(set(data) - set(self.fields))
            }
            for name, field in self.fields.items():
                problem = _json_type_error(field, data[name]) if name in data else None
                if problem is not None:
                    errors[name] = [problem]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)


@functools.cache
def shared_serializer[S: serializers.Serializer[Any]](serializer_class: type[S]) -> S:
    """One shared instance per serializer class, for rendering (`to_representation`) and for
    `validated_body`: neither keeps state on the instance, and building the fields (a deep copy
    of every declared field) per request was a measurable share of a renew, the most frequent
    request (bench/leases.py, bench/renew_load.py). Not for serializers that read
    `self.context`."""
    return serializer_class()


def validated_body(serializer_class: type[StrictInputSerializer], data: Any) -> dict[str, Any]:
    """`data` validated by `serializer_class`: what `serializer_class(data=data)` followed by
    `is_valid(raise_exception=True)` and `validated_data` give, the same ValidationError (400)
    included, through one shared instance per class. Building a serializer deep-copies every
    declared field, which was a tenth of a renew's CPU (bench/renew_load.py); validating
    keeps no state on the instance, so threads can share it. A body that fails is validated
    again the usual way, so that its 400 is exactly `is_valid`'s (which rewords a few errors).
    Not for serializers that read `self.context`."""
    try:
        validated: dict[str, Any] = shared_serializer(serializer_class).run_validation(data)
    except serializers.ValidationError:
        serializer_class(data=data).is_valid(raise_exception=True)
        raise  # pragma: no cover - is_valid refuses what run_validation refused
    return validated


class NonBlankTextField(serializers.CharField):
    """Human text (a name, a title, a reason): taken as sent, but not whitespace only."""

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if not value.strip():
            raise serializers.ValidationError("Must contain a non-whitespace character.")
        return value


class UUIDBodyField(serializers.UUIDField):
    """An id in a request body or query string: a JSON string in canonical UUID form
    (`paperclip.ids.parse_uuid`). DRF's own field would also take the integer 12, a braced or
    dashless spelling, or `urn:uuid:`."""

    def to_internal_value(self, data: Any) -> UUID:
        parsed = parse_uuid(data) if isinstance(data, str) else None
        if parsed is None:
            self.fail("invalid", value=data)
        return parsed


@extend_schema_serializer(component_name="ErrorResponseBody")
class ErrorDetailSerializer(serializers.Serializer[Any]):
    code = serializers.CharField(help_text="Stable snake_case code; frozen once shipped.")
    message = serializers.CharField(help_text="Human-readable text; may change.")
    details = serializers.DictField(
        child=serializers.JSONField(),
        help_text="Per-code details; `fields` lists offending fields for invalid_request.",
    )
    remediation = serializers.CharField(required=False, help_text="What to do next, if any.")


@extend_schema_serializer(component_name="ErrorResponse")
class ErrorSerializer(serializers.Serializer[Any]):
    """`{"error": {"code", "message", "details", "remediation"?}}`: every error response."""

    error = ErrorDetailSerializer()


# (HTTP status, error code) pairs for `error_responses`; every authenticated endpoint can
# answer AUTH_ERRORS.
AUTH_ERRORS: tuple[tuple[int, str], ...] = ((401, "not_authenticated"), (403, "permission_denied"))
INVALID_REQUEST: tuple[int, str] = (400, "invalid_request")
NOT_FOUND: tuple[int, str] = (404, "not_found")
RESOURCE_BUSY: tuple[int, str] = (409, "resource_busy")


def error_responses(*codes: tuple[int, str]) -> dict[int, OpenApiResponse]:
    """OpenAPI responses for error statuses, each documented with the one error body.

    `codes` are (HTTP status, error code) pairs; codes sharing a status are listed together in
    that status's description.
    """
    grouped: dict[int, list[str]] = {}
    for http_status, code in codes:
        grouped.setdefault(http_status, []).append(code)
    return {
        http_status: OpenApiResponse(ErrorSerializer, description=" | ".join(names))
        for http_status, names in grouped.items()
    }


class CompanyOutputSerializer(serializers.Serializer[Company]):
    id = serializers.UUIDField()
    name = serializers.CharField()
    created_at = serializers.DateTimeField()


class AgentOutputSerializer(serializers.Serializer[Agent]):
    id = serializers.UUIDField()
    company_id = serializers.UUIDField()
    name = serializers.CharField()
    role = serializers.ChoiceField(choices=Agent.Role.choices)
    status = serializers.ChoiceField(choices=Agent.Status.choices)
    created_at = serializers.DateTimeField()


class IssueOutputSerializer(serializers.Serializer[Issue]):
    id = serializers.UUIDField()
    company_id = serializers.UUIDField()
    title = serializers.CharField()
    status = serializers.ChoiceField(choices=Issue.Status.choices)
    hidden_at = serializers.DateTimeField(allow_null=True)
    assignee_agent_id = serializers.UUIDField(allow_null=True)
    execution_run_id = serializers.UUIDField(allow_null=True)
    checkout_run_id = serializers.UUIDField(allow_null=True)
    execution_workspace_id = serializers.UUIDField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class ExecutionWorkspaceOutputSerializer(serializers.Serializer[ExecutionWorkspace]):
    id = serializers.UUIDField()
    company_id = serializers.UUIDField()
    name = serializers.CharField()
    cwd = serializers.CharField(allow_null=True)
    status = serializers.ChoiceField(choices=ExecutionWorkspace.Status.choices)
    created_at = serializers.DateTimeField()


class FinalizationOwnerSerializer(serializers.Serializer[Any]):
    """The durable finalization owner receipt; unreadable fields are null."""

    token = serializers.CharField(allow_null=True)
    hostname = serializers.CharField(allow_null=True)
    pid = serializers.IntegerField(allow_null=True)
    process_started_at = serializers.CharField(
        allow_null=True, help_text="As recorded (ISO-8601 when well-formed)."
    )


# Blocks of the Run JSON computed by the apps above the core (recovery's `finalization`),
# registered when their app is ready: each is a read-only field over the whole run.
_RUN_BLOCKS: dict[str, Callable[[], serializers.Field[Any, Any, Any, Any]]] = {}


def run_block_register(
    name: str, field: Callable[[], serializers.Field[Any, Any, Any, Any]]
) -> None:
    """Add the Run JSON block `name`, rendered by `field()` (read-only, `source="*"`)."""
    _RUN_BLOCKS[name] = field


class RunOutputSerializer(serializers.Serializer[HeartbeatRun]):
    id = serializers.UUIDField()
    company_id = serializers.UUIDField()
    agent_id = serializers.UUIDField()
    issue_id = serializers.UUIDField(allow_null=True)
    status = serializers.ChoiceField(choices=HeartbeatRun.Status.choices)
    runtime_mode = serializers.ChoiceField(choices=HeartbeatRun.RuntimeMode.choices)
    native_phase = serializers.CharField(allow_null=True)
    execution_workspace_id = serializers.UUIDField(allow_null=True)
    completion_contract_id = serializers.UUIDField(allow_null=True)
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    finalization_owner = serializers.SerializerMethodField()

    @staticmethod
    @extend_schema_field(FinalizationOwnerSerializer(allow_null=True))
    def get_finalization_owner(run: HeartbeatRun) -> dict[str, Any] | None:
        return owner_receipt_json(run.runner_profile_json)

    def get_fields(self) -> dict[str, serializers.Field[Any, Any, Any, Any]]:
        fields = super().get_fields()
        for name, field in _RUN_BLOCKS.items():
            fields[name] = field()
        return fields


def company_to_json(company: Company) -> dict[str, Any]:
    return dict(CompanyOutputSerializer(company).data)


def agent_to_json(agent: Agent) -> dict[str, Any]:
    return dict(AgentOutputSerializer(agent).data)


def issue_to_json(issue: Issue) -> dict[str, Any]:
    return dict(IssueOutputSerializer(issue).data)


def execution_workspace_to_json(workspace: ExecutionWorkspace) -> dict[str, Any]:
    return dict(ExecutionWorkspaceOutputSerializer(workspace).data)


def run_to_json(run: HeartbeatRun) -> dict[str, Any]:
    """The Run JSON (docs/api.md#run-json, with `finalization_owner`), for any app's responses."""
    return dict(RunOutputSerializer(run).data)
