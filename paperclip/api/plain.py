"""A request body's values, validated field by field from its serializer without DRF's per-field
machinery, when the body is plainly valid.

The batch renew validates up to 500 small objects per request, and DRF's `run_validation`
(field lookup, `validate_empty_values`, error collection per field) costs tens of
microseconds per object. `plain_values(Serializer, data)` reads the serializer's own declared
fields and constraints (required, null, default, UUID, integer range, choices, text length and
validators) and returns what `validated_body(Serializer, data)` would, or None whenever the body
is not plainly valid or a field is of a type it does not know; the caller then validates with
DRF itself, which gives the usual 400. So a field added to the serializer is never silently
dropped: an unknown field type sends every body through DRF
(tests/paperclip/test_plain_values.py holds the two equal on valid and invalid bodies).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers
from rest_framework.fields import empty

from paperclip.ids import parse_uuid

_MISSING = object()
Check = Callable[[Any], Any]  # the value, or _MISSING when not plainly valid


def _uuid(value: Any) -> Any:
    if type(value) is not str:
        return _MISSING
    parsed = parse_uuid(value)
    return _MISSING if parsed is None else parsed


def _integer(field: serializers.IntegerField) -> Check:
    low, high = field.min_value, field.max_value

    def check(value: Any) -> Any:
        if type(value) is not int:
            return _MISSING
        if (low is not None and value < low) or (high is not None and value > high):
            return _MISSING
        return value

    return check


def _choice(field: serializers.ChoiceField) -> Check:
    choices = frozenset(field.choices)

    def check(value: Any) -> Any:
        return value if type(value) is str and value in choices else _MISSING

    return check


def _text(field: serializers.CharField) -> Check:
    def check(value: Any) -> Any:
        if type(value) is not str or (not value and not field.allow_blank) or "\x00" in value:
            return _MISSING
        try:
            field.run_validators(value)  # max/min length, a RegexField's pattern, ...
        except (serializers.ValidationError, DjangoValidationError):
            return _MISSING
        return value

    return check


def _check(field: serializers.Field[Any, Any, Any, Any]) -> Check | None:
    # Order matters: RegexField and ChoiceField are not CharField subclasses of each other,
    # and UUIDField is not a CharField; a subclass with its own to_internal_value is unknown.
    kind = type(field)
    if isinstance(field, serializers.UUIDField):
        return _uuid
    if kind is serializers.IntegerField:
        return _integer(field)  # type: ignore[arg-type]
    if kind is serializers.ChoiceField:
        return _choice(field)  # type: ignore[arg-type]
    if kind in (serializers.CharField, serializers.RegexField):
        return _text(field)  # type: ignore[arg-type]
    return None


@functools.cache
def _plan(
    serializer_class: type[serializers.Serializer[Any]],
) -> tuple[frozenset[str], tuple[tuple[str, bool, bool, Any, Check], ...]] | None:
    """(names, ((name, required, allow_null, default, check), ...)), or None when a field
    is of a type `_check` does not know."""
    plan = []
    fields = serializer_class().fields
    for name, field in fields.items():
        check = _check(field)
        if check is None or field.read_only:
            return None
        plan.append((name, field.required, field.allow_null, field.default, check))
    return frozenset(fields), tuple(plan)


def plain_values(
    serializer_class: type[serializers.Serializer[Any]], data: Any
) -> dict[str, Any] | None:
    """What `validated_body(serializer_class, data)` returns, when `data` is plainly valid;
    None otherwise (validate it with DRF then, for the exact 400)."""
    plan = _plan(serializer_class)
    if plan is None or type(data) is not dict:
        return None
    names, fields = plan
    if not data.keys() <= names:
        return None
    values: dict[str, Any] = {}
    for name, required, allow_null, default, check in fields:
        value = data.get(name, _MISSING)
        if value is _MISSING:
            if required:
                return None
            if default is not empty:
                values[name] = default() if callable(default) else default
            continue
        if value is None:
            if not allow_null:
                return None
            values[name] = None
            continue
        checked = check(value)
        if checked is _MISSING:
            return None
        values[name] = checked
    return values


def item_values(
    serializer_class: type[serializers.Serializer[Any]], item: Any
) -> tuple[dict[str, Any] | None, dict[str, list[str]]]:
    """One object of a batch body: its validated values and no errors, or None and its field
    errors as `validated_body` would name them. The plain check first, DRF's validation (one
    shared instance) for anything not plainly valid."""
    values = plain_values(serializer_class, item)
    if values is not None:
        return values, {}
    try:
        validated: dict[str, Any] = _shared(serializer_class).run_validation(item)
    except serializers.ValidationError as exc:
        detail: Any = exc.detail
        if not isinstance(detail, dict):
            detail = {"non_field_errors": detail}
        return None, {str(name): [str(text) for text in texts] for name, texts in detail.items()}
    return validated, {}


@functools.cache
def _shared(serializer_class: type[serializers.Serializer[Any]]) -> serializers.Serializer[Any]:
    return serializer_class()
