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
