"""`paperclip.api.plain`: the plain check of a batch body's object gives exactly what DRF's
validation gives when the object is plainly valid, and refuses (None) whatever DRF refuses."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from rest_framework import serializers

from checkpoints.api.batch import ControllerRenewItemSerializer
from leases.api.batch import RuntimeRenewItemSerializer
from paperclip.api.plain import item_values, plain_values
from paperclip.api.serializers import StrictInputSerializer

ID = str(uuid.uuid4())
RUNTIME: dict[str, Any] = {"kind": "runtime", "execution_workspace_id": ID, "generation": 3}
CONTROLLER: dict[str, Any] = {
    "kind": "controller",
    "run_id": ID,
    "boot_id": "boot-a",
    "lease_owner": "boot-a:1:x",
}
CHANGES: list[dict[str, Any]] = [
    {},
    {"issue_id": ID},
    {"issue_id": None, "run_id": ID},
    {"fence": 2**50},
    {"fence": None},
    {"ttl_seconds": None},
    {"ttl_seconds": 60},
    {"ttl_seconds": 3600},
    {"ttl_seconds": 5},
    {"ttl_seconds": 10**9},
    {"ttl_seconds": True},
    {"ttl_seconds": 60.0},
    {"generation": 0},
    {"generation": 2**63},
    {"generation": "3"},
    {"generation": None},
    {"execution_workspace_id": ID.upper()},
    {"execution_workspace_id": ID.replace("-", "")},
    {"run_id": 12},
    {"kind": "other"},
    {"kind": None},
    {"boot_id": "has space"},
    {"boot_id": ""},
    {"boot_id": "b" * 129},
    {"lease_owner": ""},
    {"lease_owner": " spaced "},
    {"lease_owner": "x" * 401},
    {"lease_owner": "nul\x00"},
    {"lease_owner": None},
    {"lease_owner": 5},
    {"unknown": 1},
]


def drf(serializer_class: type[StrictInputSerializer], data: Any) -> dict[str, Any] | None:
    serializer = serializer_class(data=data)
    return dict(serializer.validated_data) if serializer.is_valid() else None


@pytest.mark.parametrize(
    "serializer_class", [RuntimeRenewItemSerializer, ControllerRenewItemSerializer]
)
@pytest.mark.parametrize("base", [RUNTIME, CONTROLLER])
@pytest.mark.parametrize("change", CHANGES)
def test_plain_values_are_drfs_or_defer_to_it(
    serializer_class: type[StrictInputSerializer], base: dict[str, Any], change: dict[str, Any]
) -> None:
    data = {**base, **change}
    expected = drf(serializer_class, data)
    plain = plain_values(serializer_class, data)
    if plain is not None:
        assert plain == expected
    values, errors = item_values(serializer_class, data)
    assert values == expected
    assert bool(errors) == (expected is None)


def test_a_field_of_an_unknown_type_sends_every_body_to_drf() -> None:
    class WithList(StrictInputSerializer):
        kind = serializers.ChoiceField(choices=["x"])
        tags = serializers.ListField(child=serializers.CharField(), required=False)

    assert plain_values(WithList, {"kind": "x"}) is None
    assert item_values(WithList, {"kind": "x", "tags": ["a"]}) == ({"kind": "x", "tags": ["a"]}, {})


def test_not_an_object_is_refused() -> None:
    assert plain_values(RuntimeRenewItemSerializer, [RUNTIME]) is None
    values, errors = item_values(RuntimeRenewItemSerializer, [RUNTIME])
    assert values is None
    assert errors
