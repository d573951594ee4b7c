"""Changelist pieces whose cost does not grow with the table (docs/performance.md).

Django's stock changelist counts every matching row twice (the page count and the unfiltered
total), lists a free-text filter's choices with `SELECT DISTINCT` over the whole table, and
builds `date_hierarchy` links from the distinct years of every row: each a full scan of the
audit log at a million rows. The replacements here read a bounded number of index entries.
"""

from __future__ import annotations

from datetime import timedelta
from functools import cached_property
from typing import Any, ClassVar, Final

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import DurationField, Model, QuerySet, Value
from django.db.models.functions import Now
from django.http import HttpRequest

# A changelist counts at most this many rows: beyond it the page says "more than 1000" and
# offers the first LIST_COUNT_CAP / list_per_page pages (filter or search to reach the rest).
LIST_COUNT_CAP: Final = 1000
# Choices a free-text filter offers at most (each costs one index probe).
DISTINCT_VALUES_LIMIT: Final = 200


class CappedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Counts up to LIST_COUNT_CAP + 1 rows (`SELECT count(*) FROM (... LIMIT 1001)`, in no
    particular order, so the planner may stop at the first 1001 it finds), so the count costs
    about what a page costs, not what the table holds. `capped` says whether the real count is
    larger than `count`."""

    cap: ClassVar[int] = LIST_COUNT_CAP

    @cached_property
    def _found(self) -> int:
        rows: Any = self.object_list
        if isinstance(rows, QuerySet):
            return rows.order_by()[: self.cap + 1].count()
        return len(rows[: self.cap + 1])

    @cached_property
    def count(self) -> int:
        return min(self._found, self.cap)

    @cached_property
    def capped(self) -> bool:
        return self._found > self.cap


class FlatCostListMixin:
    """For every changelist over a table that grows: the capped count, and no second count of
    the unfiltered table ("N results (M total)" would need one)."""

    paginator: ClassVar[Any] = CappedCountPaginator
    show_full_result_count: ClassVar[bool] = False


def distinct_values(model: type[Model], column: str) -> list[Any]:
    """The distinct non-NULL values of `column`, read with a loose index scan (one probe of the
    column's index per value, up to DISTINCT_VALUES_LIMIT), plus None if any row is NULL.

    Needs a btree index leading with `column`; without one each probe is a scan.
    """
    quote = connection.ops.quote_name
    table, col = quote(model._meta.db_table), quote(column)
    sql = (
        f"WITH RECURSIVE v(value) AS ((SELECT {col} FROM {table} WHERE {col} IS NOT NULL"  # noqa: S608 (quoted model names)
        f" ORDER BY {col} LIMIT 1) UNION ALL SELECT (SELECT {col} FROM {table}"
        f" WHERE {col} > v.value ORDER BY {col} LIMIT 1) FROM v WHERE v.value IS NOT NULL)"
        f" SELECT value FROM v WHERE value IS NOT NULL LIMIT {DISTINCT_VALUES_LIMIT}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql)
        values = [row[0] for row in cursor.fetchall()]
        cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE {col} IS NULL)")  # noqa: S608
        if cursor.fetchone()[0]:
            values.append(None)
    return values


class IndexedValuesListFilter(admin.AllValuesFieldListFilter):
    """The stock "all values" filter with its choices read by `distinct_values` (an indexed
    column only). The choices are the column's values across every company: they are the
    code's vocabulary (actions, entity types, causes), not company data; the rows listed stay
    scoped."""

    def __init__(
        self,
        field: Any,
        request: HttpRequest,
        params: dict[str, Any],
        model: type[Model],
        model_admin: Any,
        field_path: str,
    ) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        self.lookup_choices: Any = distinct_values(model, field.column)


# (parameter value, label, how far back) for `recent_filter`.
_RECENT: Final[tuple[tuple[str, str, timedelta], ...]] = (
    ("1h", "Last hour", timedelta(hours=1)),
    ("24h", "Last 24 hours", timedelta(hours=24)),
    ("7d", "Last 7 days", timedelta(days=7)),
    ("30d", "Last 30 days", timedelta(days=30)),
)


def recent_filter(field_name: str, title: str) -> type[admin.SimpleListFilter]:
    """A "when" filter on `field_name` (rows newer than now() minus an hour, a day, a week or
    30 days): the stand-in for `date_hierarchy`, whose links need the distinct dates of every
    row. Rendering it reads nothing; filtering uses the column's index."""

    class RecentFilter(admin.SimpleListFilter):
        parameter_name = f"{field_name}_within"

        def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
            return [(value, label) for value, label, _ in _RECENT]

        def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
            for value, _, delta in _RECENT:
                if self.value() == value:
                    since = Now() - Value(delta, output_field=DurationField())
                    return queryset.filter(**{f"{field_name}__gte": since})
            return queryset

    RecentFilter.title = title
    return RecentFilter
