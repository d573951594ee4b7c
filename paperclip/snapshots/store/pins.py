"""Pinning the blobs a snapshot reaches: proving they are stored with the sizes named and
touching them (`referenced_at = now()`) so the collector leaves them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final
from uuid import UUID

from django.conf import settings

from paperclip.db.locking import require_transaction
from paperclip.db.prepared import prepared_cursor
from paperclip.snapshots.store.names import MAX_FIND_MISSING

_PIN: Final = """
    WITH touched AS (
        UPDATE cas_blobs SET referenced_at = now()
        WHERE id IN (
            SELECT id FROM cas_blobs
            WHERE company_id = %(company)s AND digest = ANY(%(batch)s::text[])
              AND referenced_at < now() - make_interval(secs => %(half_grace)s::double precision)
              AND NOT doomed
            ORDER BY digest FOR NO KEY UPDATE
        )
        RETURNING digest
    ),
    held AS (
        SELECT digest,
               referenced_at < now() - make_interval(secs => %(half_grace)s::double precision)
                   AS old
        FROM cas_blobs
        WHERE company_id = %(company)s AND digest = ANY(%(batch)s::text[]) AND NOT doomed
    )
    SELECT wanted.digest, 'absent' FROM unnest(%(batch)s::text[]) AS wanted(digest)
    WHERE NOT EXISTS (SELECT 1 FROM held WHERE held.digest = wanted.digest)
    UNION ALL
    SELECT held.digest, 'unsure' FROM held
    WHERE held.old AND NOT EXISTS (SELECT 1 FROM touched WHERE touched.digest = held.digest)
    UNION ALL
    SELECT claimed.digest, 'other_size'
    FROM unnest(%(claimed)s::text[], %(sizes)s::bigint[]) AS claimed(digest, size)
    JOIN cas_blobs ON cas_blobs.company_id = %(company)s AND cas_blobs.digest = claimed.digest
    WHERE cas_blobs.size <> claimed.size
"""


# Of the "unsure" names, those another transaction made young meanwhile (read afresh).
_PIN_RECHECK: Final = """
    SELECT digest FROM cas_blobs
    WHERE company_id = %(company)s AND digest = ANY(%(names)s::text[])
      AND referenced_at >= now() - make_interval(secs => %(half_grace)s::double precision)
      AND NOT doomed
"""


@dataclass(frozen=True, slots=True)
class CasPinned:
    missing: list[str]  # names the company does not hold (sorted)
    other_size: list[str]  # names held with another size than the caller's (sorted)


def cas_pin(
    *, company_id: UUID, digests: Iterable[str], sizes: Mapping[str, int] | None = None
) -> CasPinned:
    """In the caller's transaction, make sure the company's blobs among `digests` outlive it
    long enough to be referenced: those whose `referenced_at` is older than half the grace
    are touched (row-locked in digest order, like uploads, until commit, so a collection skips
    them or then finds them young); younger ones cannot reach the grace meanwhile and are only
    read. Returns the names the company does not hold, and those among `sizes` (name → the
    size the caller expects; held or not, pinned or not) whose stored size differs, found by
    the same statements. Snapshot registration calls it with every blob the tree reaches that
    it must pin and the size each file it read names its blob with, so that none is collected
    once the snapshot exists and no file is registered with a size its blob has not; a tree
    that mostly reuses recent blobs writes only its old rows.

    A name counts as held only when its row is young or was touched here: an old row the
    statement saw but could not touch was changed by a transaction that committed meanwhile
    (the statement waited for its lock), either a collection that deleted it or another
    reference that made it young; a fresh read of those few tells which."""
    require_transaction()
    wanted = sorted(set(digests))
    claims = sorted((sizes or {}).items())
    missing: list[str] = []
    other_size: list[str] = []
    half_grace = settings.PAPERCLIP_CAS_GRACE_SECONDS / 2
    for start in range(0, max(len(wanted), len(claims)), MAX_FIND_MISSING):
        batch = wanted[start : start + MAX_FIND_MISSING]
        claimed = claims[start : start + MAX_FIND_MISSING]
        # The names are sent once and only the missing, unsure or mis-sized ones come back
        # (the held ones are nearly all of a registration's 50,000).
        with prepared_cursor() as cursor:
            cursor.execute(
                _PIN,
                {
                    "company": company_id,
                    "batch": batch,
                    "half_grace": half_grace,
                    "claimed": [name for name, _ in claimed],
                    "sizes": [size for _, size in claimed],
                },
            )
            unsure: list[str] = []
            for digest, state in cursor.fetchall():
                if state == "other_size":
                    other_size.append(digest)
                else:
                    (missing if state == "absent" else unsure).append(digest)
            if unsure:
                cursor.execute(
                    _PIN_RECHECK,
                    {"company": company_id, "names": unsure, "half_grace": half_grace},
                )
                young = {row[0] for row in cursor.fetchall()}
                missing.extend(name for name in unsure if name not in young)
    return CasPinned(missing=sorted(missing), other_size=sorted(other_size))
