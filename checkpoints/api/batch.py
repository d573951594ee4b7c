"""The controller lease's kind of the batch renew (`POST /api/leases/renew`,
docs/leases.md#batch-renew): how an item is validated and answered. The endpoint itself is
the leases app's (leases/api/batch.py); this app registers its kind in `paperclip.renewals`
from `ready()`, as neither app may import the other."""

from __future__ import annotations

from typing import Any, Final

from drf_spectacular.utils import extend_schema_serializer
from rest_framework import serializers

from checkpoints import services
from checkpoints.api.views import BOOT_ID_PATTERN, ControllerLeaseAcquireApi
from checkpoints.services.controller_lease_batch import ControllerRenewItem, controller_leases_renew
from paperclip.api.plain import item_values
from paperclip.api.serializers import StrictInputSerializer, UUIDBodyField
from paperclip.renewals import FieldErrors, RenewAnswer, RenewKind


@extend_schema_serializer(component_name="ControllerLeaseRenewItem")
class ControllerRenewItemSerializer(StrictInputSerializer):
    kind = serializers.ChoiceField(choices=["controller"])
    run_id = UUIDBodyField()
    boot_id = serializers.RegexField(BOOT_ID_PATTERN)
    lease_owner = serializers.CharField(
        max_length=400, trim_whitespace=False, help_text="The current owner, as acquired."
    )
    ttl_seconds = serializers.IntegerField(
        required=False,
        default=services.CONTROLLER_LEASE_TTL_DEFAULT,
        min_value=services.CONTROLLER_LEASE_TTL_MIN,
        max_value=services.CONTROLLER_LEASE_TTL_MAX,
    )


def _parse(item: dict[str, Any]) -> tuple[Any, FieldErrors]:
    values, errors = item_values(ControllerRenewItemSerializer, item)
    if values is None:
        return None, errors
    return ControllerRenewItem(
        run_id=values["run_id"],
        boot_id=values["boot_id"],
        lease_owner=values["lease_owner"],
        ttl_seconds=values["ttl_seconds"],
    ), {}


def _renew(*, company_id: Any, agent_id: Any, items: list[Any]) -> list[RenewAnswer]:
    return list(controller_leases_renew(company_id=company_id, agent_id=agent_id, items=items))


CONTROLLER_KIND: Final = RenewKind(
    name="controller",
    parse=_parse,
    renew=_renew,
    key=lambda item: item.run_id,
    item_serializer=ControllerRenewItemSerializer,
    lease_serializer=ControllerLeaseAcquireApi.OutputSerializer,
)
