"""Identifiers for the few raw statements the project keeps, taken from the models' `_meta`,
so a raw statement follows the schema instead of spelling table and column names by hand."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import Field, Model


def quoted_column(field: Field[Any, Any]) -> str:
    """The field's column name, quoted for this connection."""
    if field.column is None:  # pragma: no cover - every concrete field has a column
        raise ImproperlyConfigured(f"{field} has no column")
    return connection.ops.quote_name(field.column)


def quoted_table(model: type[Model]) -> str:
    """The model's table name, quoted for this connection."""
    return connection.ops.quote_name(model._meta.db_table)


def iso_json_sql(expression: str) -> str:
    """SQL text rendering the timestamptz `expression` as DRF renders a datetime with USE_TZ and
    UTC (`datetime.isoformat()`, `+00:00` written `Z`): six digits of fraction, none when the
    microseconds are 0. For answers rendered by PostgreSQL (the batch renew's leases). No `%`
    in the text: it goes into statements with parameters."""
    utc = f"({expression}) AT TIME ZONE 'UTC'"
    return (
        f"to_char({utc}, 'YYYY-MM-DD\"T\"HH24:MI:SS')"
        f" || CASE WHEN mod(date_part('microseconds', {utc})::bigint, 1000000) = 0 THEN ''"
        f" ELSE to_char({utc}, '.US') END || 'Z'"
    )


def json_object_sql(pairs: list[tuple[str, str]]) -> str:
    """SQL text for a JSON object's text (`json_build_object(...)::text`) of `(key, SQL
    expression)` pairs, in order. The keys are plain words (checked): they are written into
    the statement."""
    for key, _ in pairs:
        if not key.isidentifier():
            raise ValueError(f"not a plain key: {key!r}")
    arguments = ", ".join(f"'{key}', {expression}" for key, expression in pairs)
    return f"json_build_object({arguments})::text"
