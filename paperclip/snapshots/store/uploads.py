"""Uploading blobs: the row upserted first, then the bytes placed through the backend, then the
commit (the order that keeps the collector away, see the package's docstring)."""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final
from uuid import UUID

from django.conf import settings
from django.db import transaction

from paperclip.db.locking import busy_on_lock_timeout, require_transaction, set_local_lock_timeout
from paperclip.db.prepared import prepared_cursor
from paperclip.snapshots.store.backends import BlobBackend, blob_backend
from paperclip.snapshots.store.names import BlobStoreUnavailable, checked_name
from paperclip.snapshots.store.spool import Readable, Region, Spooled, spool_upload

logger = logging.getLogger(__name__)


# Rows are upserted in digest order (the `sorted` of the callers): two uploads, or an upload
# and a registration's `cas_pin` (same order), never wait for each other in a cycle. The
# collector skips locked rows, so it never waits for either.
_UPSERT: Final = """
    INSERT INTO cas_blobs (company_id, digest, size, created_at, referenced_at)
    SELECT %s, t.digest, t.size, now(), now()
    FROM unnest(%s::text[], %s::bigint[]) AS t(digest, size)
    ORDER BY t.digest
    ON CONFLICT (company_id, digest) DO UPDATE SET referenced_at = now(), doomed = false
    RETURNING id, digest, (xmax = 0) AS inserted
"""


def store_spooled(
    company_id: UUID, spooled: Sequence[Spooled], *, rewrite: bool = True
) -> dict[str, bool]:
    """Upsert the rows (locking them), then place the bytes of new rows and of existing rows:
    with `rewrite` (an agent's upload) every existing row's bytes are written anew from the
    verified upload, as the 422 `blob_unreadable` tells an agent to do to repair an object
    damaged in place (a size check alone kept a same-size corruption); without it (the
    plane's own blobs: merges, adoptions) only those whose bytes are gone or of the wrong
    size. Returns digest → created. Runs in the caller's transaction; on any error removes
    what it placed for new rows before the transaction rolls back (still holding the rows,
    so no concurrent upload of the same blob can have written there meanwhile); an existing
    row's bytes are replaced atomically by every backend, so a failed rewrite leaves them
    as they were."""
    require_transaction()
    by_digest = {s.digest: s for s in spooled}
    digests = sorted(by_digest)
    backend = blob_backend()
    set_local_lock_timeout()
    with prepared_cursor() as cursor:
        cursor.execute(_UPSERT, [company_id, digests, [by_digest[d].size for d in digests]])
        rows: list[tuple[int, str, bool]] = cursor.fetchall()
    placed: list[str] = []  # the new rows' bytes: removed again on failure
    try:
        to_place: list[tuple[int, str, Region]] = []
        for blob_id, digest, inserted in sorted(rows, key=lambda r: r[1]):
            blob = by_digest[digest]
            if (
                inserted
                or rewrite
                or not backend.stat(company_id=company_id, digest=digest, size=blob.size)
            ):
                to_place.append((blob_id, digest, blob.reader()))
                if inserted:
                    placed.append(digest)
        _place(backend, company_id, to_place)
    except BaseException:
        # One request for all of them (s3: one DeleteObjects, bounded by its timeouts even
        # when the store is what failed).
        try:
            backend.delete_many(company_id=company_id, digests=placed)
        except (OSError, BlobStoreUnavailable):  # pragma: no cover - best effort; the
            # rollback takes the rows, so the bytes are only stray ones
            logger.warning("could not remove %d blobs of a failed upload", len(placed))
        raise
    return {digest: inserted for _, digest, inserted in rows}


def _place(backend: BlobBackend, company_id: UUID, blobs: list[tuple[int, str, Region]]) -> None:
    """Write the bytes: through the backend's `put_many` when it has one (s3: several
    requests in flight, each blob's PUT a round trip to the store), else one `put` each."""
    put_many = getattr(backend, "put_many", None)
    if put_many is not None and len(blobs) > 1:
        put_many(company_id=company_id, blobs=blobs)
        return
    for blob_id, digest, source in blobs:
        backend.put(blob_id=blob_id, company_id=company_id, digest=digest, source=source)


@dataclass(frozen=True, slots=True)
class CasPut:
    digest: str
    size: int
    created: bool  # False: the company already had it (its `referenced_at` moved)


def cas_put(
    *, company_id: UUID, digest: str, stream: Readable | None, length: int | None
) -> CasPut:
    """Store the blob `digest` from `stream` (`length` bytes when known, e.g. the request's
    Content-Length; else to its end) in the company's store, or note that it is already there.

    Hashes while streaming into a spooled temporary file; then, in one transaction, upserts
    the row (locking it; lock waits bounded, else `resource_busy`), places the bytes and
    commits. Raises InvalidRequest (bad name, body shorter than `length`), BlobTooLarge (413,
    `details.max_bytes`, as soon as the limit is passed), BlobDigestMismatch; nothing is kept
    on any error. Blob uploads are content, not domain state: no audit row."""
    checked_name(digest)
    spooled = spool_upload(
        stream, digest=digest, length=length, max_bytes=settings.PAPERCLIP_CAS_MAX_BLOB_BYTES
    )
    try:
        with busy_on_lock_timeout(), transaction.atomic(durable=True):
            created = store_spooled(company_id, [spooled])[digest]
    finally:
        spooled.file.close()
    return CasPut(digest=digest, size=spooled.size, created=created)


STORE_CHUNK: Final = 1000  # blobs per transaction of `cas_store_blobs`


def cas_store_blobs(*, company_id: UUID, blobs: Mapping[str, bytes]) -> None:
    """Store small blobs the server made itself (directory blobs of a merge or an adoption),
    each verified against its name as an upload is: a transaction per STORE_CHUNK blobs, as
    a batch upload stores them (one per blob cost a merge of a 500-file change 1,000 commits).
    Raises as `cas_put`; a chunk stored before the failure stays (content, not state)."""
    names = sorted(blobs)
    max_bytes = settings.PAPERCLIP_CAS_MAX_BLOB_BYTES
    for start in range(0, len(names), STORE_CHUNK):
        into = io.BytesIO()
        spooled = [
            spool_upload(
                io.BytesIO(blobs[name]),
                digest=name,
                length=len(blobs[name]),
                max_bytes=max_bytes,
                into=into,
            )
            for name in names[start : start + STORE_CHUNK]
        ]
        with busy_on_lock_timeout(), transaction.atomic(durable=True):
            store_spooled(company_id, spooled, rewrite=False)
