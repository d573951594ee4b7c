"""What needs the board's attention, counted: the dashboard's tiles (and, through the same
function, the metrics gauges).

The tiles are one table (`SOURCES`) of what each app contributes from its own builders
(paperclip/attention.py says how a source reads); the order here is the dashboard's order.
`attention_summary` reads a fixed number of queries whatever the number of rows (a test pins
it) and writes nothing. Database time (`now()`) is the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import checkpoints.attention
import leases.attention
import leases.environment.attention
import paperclip.attention
import recovery.selectors.attention
from paperclip.attention import AttentionScope, AttentionTile, CompanyIds, TileSource
from paperclip.db.clock import db_now

SOURCES: tuple[TileSource, ...] = (
    *recovery.selectors.attention.TILES,
    *leases.attention.TILES,
    *leases.environment.attention.TILES,
    *checkpoints.attention.TILES,
    *paperclip.attention.TILES,
)


@dataclass(frozen=True, slots=True)
class Attention:
    as_of: datetime  # database time of the read
    tiles: tuple[AttentionTile, ...]
    worker_last_heartbeat_at: datetime | None
    worker_fresh: bool

    @property
    def total(self) -> int:
        return sum(tile.count for tile in self.tiles)


def attention_summary(*, company_ids: CompanyIds, include_jobs: bool) -> Attention:
    """Counts and oldest ages of every kind of stuck work in `company_ids` (None: all).

    `include_jobs` adds the sources that are not company-scoped (failed worker jobs name any
    company's runs): for superusers only. Reads only, in a fixed number of queries.
    """
    scope = AttentionScope(company_ids=company_ids, now=db_now())
    tiles = tuple(
        tile
        for source in SOURCES
        if include_jobs or not source.superusers_only
        for tile in source.read(scope)
    )
    worker = next(tile for tile in tiles if tile.kind == "worker_heartbeat_stale")
    return Attention(
        as_of=scope.now,
        tiles=tiles,
        worker_last_heartbeat_at=worker.oldest_at,
        worker_fresh=worker.count == 0,
    )
