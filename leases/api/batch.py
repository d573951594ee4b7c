"""`POST /api/leases/renew`: renew many leases of the calling agent in one request
(docs/leases.md#batch-renew, docs/api.md#batch-renew).

The view knows no kind of lease by name: each app registers its kind in `paperclip.renewals`
(the runtime lease here, below; the controller lease in checkpoints/api/batch.py). The body is
validated whole before anything is renewed: a malformed item makes the request a 400 with
nothing renewed. Then each kind renews its items in one statement and every item gets its own
answer, in request order.
"""

from __future__ import annotations

import json
from typing import Any, Final

from django.http import HttpResponse
from drf_spectacular.utils import (
    OpenApiExample,
    PolymorphicProxySerializer,
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import serializers
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.utils.encoders import JSONEncoder
from rest_framework.views import APIView

from leases import services
from leases.api.views import LeaseSerializer
from leases.services.batch_renew import MAX_ITEMS, RuntimeRenewItem, runtime_leases_renew
from paperclip.api.auth import IsAgent, actor_for
from paperclip.api.plain import item_values
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    ErrorDetailSerializer,
    StrictInputSerializer,
    UUIDBodyField,
    error_responses,
)
from paperclip.errors import DomainError, InvalidRequest, PermissionDenied
from paperclip.renewals import FieldErrors, RenewAnswer, RenewKind, renew_batch, renew_kinds

# ---- the runtime kind ----------------------------------------------------------------------


@extend_schema_serializer(component_name="RuntimeLeaseRenewItem")
class RuntimeRenewItemSerializer(StrictInputSerializer):
    kind = serializers.ChoiceField(choices=["runtime"])
    execution_workspace_id = UUIDBodyField()
    issue_id = UUIDBodyField(required=False, allow_null=True)
    run_id = UUIDBodyField(required=False, allow_null=True)
    generation = serializers.IntegerField(
        min_value=1, max_value=2**63 - 1, help_text="The generation the claim granted."
    )
    fence = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=2**63 - 1,
        help_text="The grant's fence; when given, the lease must still be at exactly it.",
    )
    ttl_seconds = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=services.TTL_MIN_SECONDS,
        max_value=services.TTL_MAX_SECONDS,
        help_text="Default: PAPERCLIP_RUNTIME_LEASE_TTL_SECONDS (1800).",
    )


def _runtime_parse(item: dict[str, Any]) -> tuple[Any, FieldErrors]:
    values, errors = item_values(RuntimeRenewItemSerializer, item)
    if values is None:
        return None, errors
    return RuntimeRenewItem(
        execution_workspace_id=values["execution_workspace_id"],
        generation=values["generation"],
        issue_id=values.get("issue_id"),
        run_id=values.get("run_id"),
        fence=values.get("fence"),
        ttl_seconds=values.get("ttl_seconds"),
    ), {}


def _runtime_renew(*, company_id: Any, agent_id: Any, items: list[Any]) -> list[RenewAnswer]:
    return list(runtime_leases_renew(company_id=company_id, agent_id=agent_id, items=items))


RUNTIME_KIND: Final = RenewKind(
    name="runtime",
    parse=_runtime_parse,
    renew=_runtime_renew,
    key=lambda item: item.execution_workspace_id,
    item_serializer=RuntimeRenewItemSerializer,
    lease_serializer=LeaseSerializer,
)


# ---- the endpoint ----------------------------------------------------------------------------


def _item_serializers() -> list[type[serializers.Serializer[Any]]]:
    return [kind.item_serializer for kind in renew_kinds().values()]


def _lease_serializers() -> list[type[serializers.Serializer[Any]]]:
    return [kind.lease_serializer for kind in renew_kinds().values()]


@extend_schema_serializer(component_name="LeasesRenew")
class LeasesRenewInputSerializer(serializers.Serializer[Any]):
    """For the OpenAPI document; the view parses the body itself (`parse_body`)."""

    leases = PolymorphicProxySerializer(
        component_name="LeaseRenewItem",
        serializers=_item_serializers,
        resource_type_field_name="kind",
        many=True,
    )


@extend_schema_serializer(component_name="LeaseRenewResult")
class LeaseRenewResultSerializer(serializers.Serializer[Any]):
    ok = serializers.BooleanField()
    lease = PolymorphicProxySerializer(
        component_name="RenewedLease",
        serializers=_lease_serializers,
        resource_type_field_name=None,
        required=False,
        help_text="When ok: the lease as its single renew endpoint answers it.",
    )
    error = ErrorDetailSerializer(
        required=False, help_text="When not ok: the error its single endpoint would answer."
    )


@extend_schema_serializer(component_name="LeasesRenewResponse")
class LeasesRenewOutputSerializer(serializers.Serializer[Any]):
    results = LeaseRenewResultSerializer(many=True, help_text="One per item, in request order.")


def _invalid(fields: dict[str, Any]) -> InvalidRequest:
    return InvalidRequest(fields=fields)


def parse_body(data: Any) -> list[tuple[str, Any]]:
    """The body's items as `(kind, values)`, or InvalidRequest naming every bad field
    (`fields.leases.<index>.<field>`) before anything is renewed."""
    if type(data) is not dict:
        raise _invalid({"non_field_errors": ["Must be an object."]})
    unknown = sorted(set(data) - {"leases"})
    if unknown:
        raise _invalid({name: ["Unknown field."] for name in unknown})
    items = data.get("leases")
    if type(items) is not list:
        message = "This field is required." if items is None else "Must be an array."
        raise _invalid({"leases": [message]})
    if not 1 <= len(items) <= MAX_ITEMS:
        raise _invalid({"leases": [f"Must hold 1 to {MAX_ITEMS} items."]})
    kinds = renew_kinds()
    parsed: list[tuple[str, Any]] = []
    errors: dict[str, Any] = {}
    seen: dict[tuple[str, Any], int] = {}
    for index, item in enumerate(items):
        name = item.get("kind") if type(item) is dict else None
        kind = kinds.get(name) if type(name) is str else None
        if kind is None:
            choices = ", ".join(kinds)
            problem = "Must be an object." if type(item) is not dict else f"One of: {choices}."
            errors[str(index)] = {"kind": [problem]}
            continue
        values, item_errors = kind.parse(item)
        if item_errors:
            errors[str(index)] = item_errors
            continue
        key = (kind.name, kind.key(values))
        if key in seen:
            same = f"Names the same lease as item {seen[key]}."
            errors[str(index)] = {"non_field_errors": [same]}
            continue
        seen[key] = index
        parsed.append((kind.name, values))
    if errors:
        raise _invalid({"leases": errors})
    return parsed


def _answer_text(answer: RenewAnswer) -> str:
    """One result's JSON text: the lease's JSON as the kind rendered it, or the error."""
    if not isinstance(answer, DomainError):
        return '{"ok":true,"lease":' + answer + "}"
    error: dict[str, Any] = {"code": answer.code, "message": answer.text, "details": answer.details}
    if answer.remediation_text:
        error["remediation"] = answer.remediation_text
    return json.dumps(
        {"ok": False, "error": error},
        cls=JSONEncoder,
        ensure_ascii=True,
        allow_nan=False,
        separators=(",", ":"),
    )


def results_response(answers: list[RenewAnswer]) -> HttpResponse:
    """`{"results": [...]}` assembled from the answers' texts: the leases' JSON is spliced
    in as the kinds rendered it, never parsed and written again."""
    content = '{"results":[' + ",".join(map(_answer_text, answers)) + "]}"
    return HttpResponse(content.encode(), content_type="application/json")


class LeasesRenewApi(APIView):
    permission_classes: tuple[type[BasePermission], ...] = (IsAgent,)

    @extend_schema(
        operation_id="leases_renew",
        summary="Renew many runtime and controller leases of the calling agent at once",
        description=(
            f"1 to {MAX_ITEMS} items. Each renews exactly as its single endpoint would for the "
            "same caller (the runtime-lease claim's renew, fenced by `generation` and "
            "`fence`; the controller-lease renew with `lease_owner`) and is answered on its "
            "own, in request order: a refused item fails alone. Only renews: an item whose "
            "lease would be created or reclaimed fails with "
            "`workspace_runtime_lease_superseded` / `controller_lease_held`. A malformed body "
            "is a 400 and renews nothing. No audit row."
        ),
        request=LeasesRenewInputSerializer,
        responses={
            200: LeasesRenewOutputSerializer,
            **error_responses(INVALID_REQUEST, *AUTH_ERRORS),
        },
        examples=[
            OpenApiExample(
                "Both leases of a run",
                request_only=True,
                value={
                    "leases": [
                        {
                            "kind": "runtime",
                            "execution_workspace_id": "6f1c2a9e-3b0d-4e55-9a51-0c7f2b1d8e43",
                            "run_id": "1d9a7c52-8e3f-4b61-a2d0-5f6e7b8c9d01",
                            "generation": 7,
                        },
                        {
                            "kind": "controller",
                            "run_id": "1d9a7c52-8e3f-4b61-a2d0-5f6e7b8c9d01",
                            "boot_id": "b-41d3",
                            "lease_owner": "b-41d3:3:0f5e8a1c-...",
                            "ttl_seconds": 60,
                        },
                    ]
                },
            )
        ],
    )
    def post(self, request: Request) -> HttpResponse:
        actor = actor_for(request)
        agent = actor.agent
        if agent is None:  # pragma: no cover - IsAgent ran first
            raise PermissionDenied()
        parsed = parse_body(request.data)
        answers = renew_batch(company_id=agent.company_id, agent_id=agent.pk, parsed=parsed)
        return results_response(answers)
