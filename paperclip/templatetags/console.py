"""Template filters of the operator console: relative ages beside absolute times (one zone,
TIME_ZONE, named on every time) and links to objects."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import template
from django.utils import timezone
from django.utils.dateformat import format as date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince, timeuntil

register = template.Library()


def relative(value: datetime, now: datetime | None = None) -> str:
    """`3 hours ago` / `in 4 minutes` / `just now` (the largest unit only)."""
    now = now or timezone.now()
    delta = (now - value).total_seconds()
    if abs(delta) < 60:
        return "just now"
    if delta > 0:
        return f"{timesince(value, now, depth=1)} ago"
    return f"in {timeuntil(value, now, depth=1)}"


def when(value: Any) -> SafeString | str:
    """`<time title="2026-12-01 14:03:22 UTC">3 hours ago</time>`: the short form of `stamp`
    for lists with several times a row."""
    if not isinstance(value, datetime):
        return "—"
    local = timezone.localtime(value)
    return format_html(
        '<time datetime="{}" title="{}">{}</time>',
        value.isoformat(),
        date_format(local, "Y-m-d H:i:s T"),
        relative(value),
    )


@register.filter
def age(value: Any) -> str:
    if not isinstance(value, datetime):
        return "—"
    return relative(value)


@register.filter
def stamp(value: Any) -> SafeString | str:
    """`<time>2026-12-01 14:03:22 UTC</time> (3 hours ago)`."""
    if not isinstance(value, datetime):
        return "—"
    local = timezone.localtime(value)
    return format_html(
        '<time datetime="{}" title="{}">{}</time> <span class="age">({})</span>',
        value.isoformat(),
        local.isoformat(),
        date_format(local, "Y-m-d H:i:s T"),
        relative(value),
    )


@register.filter
def epoch_ms(value: Any) -> datetime | None:
    """Epoch milliseconds (as the cleanup protocol's metadata keeps them) as a UTC datetime."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return datetime.fromtimestamp(value / 1000, tz=UTC)
