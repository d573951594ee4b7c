"""Checkpoints' stuck work for the console: running runs whose controller lease lapsed while
they hold checkpoints. The builder serves the dashboard tile (`TILES`) and the coordinator
list's attention filter alike."""

from __future__ import annotations

from django.db.models import QuerySet
from django.db.models.functions import Coalesce, Now

from checkpoints.selectors import expired_authorities
from paperclip.attention import (
    AttentionScope,
    AttentionTile,
    TileSource,
    aggregate,
    links,
    scoped,
)
from paperclip.models import NativeRunFinalization


def expired_authority_coordinators(
    queryset: QuerySet[NativeRunFinalization] | None = None,
) -> QuerySet[NativeRunFinalization]:
    """Running runs whose controller lease lapsed while they hold checkpoints."""
    found = expired_authorities(clock=Now())
    return found if queryset is None else queryset.filter(pk__in=found.values("pk"))


def _expired_authorities(scope: AttentionScope) -> list[AttentionTile]:
    authorities = scoped(expired_authority_coordinators(), scope.company_ids)
    count, oldest = aggregate(authorities, Coalesce("lease_expires_at", "updated_at"))
    title = "Expired runner authorities with checkpoints"
    hint = "Cleared by expire_runner_authorities (every 60 s in the worker)."
    return [AttentionTile("authority_expired", title, count, oldest, hint=hint)]


TILES: tuple[TileSource, ...] = (
    TileSource(
        ("authority_expired",),
        _expired_authorities,
        links(
            {
                "authority_expired": (
                    "admin:paperclip_nativerunfinalization_changelist",
                    {"attention": "authority_expired"},
                )
            }
        ),
    ),
)
