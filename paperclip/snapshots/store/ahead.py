"""Reading ahead from a store whose every read is a round trip (s3): the small blobs a
materialization is about to write, fetched a window at a time with several requests in flight
(the backend's `get_many`), each checked against its name before it is held
(docs/snapshots.md#how-it-behaves).

A blob the window did not bring (a big one, one whose bytes are gone or damaged, one asked for
out of order) is simply not held: the caller then opens it through the store's ordinary read,
which streams and verifies it and raises BlobUnreadable or BlobStoreUnavailable as always. So
reading ahead changes how soon bytes arrive, never which bytes are accepted.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Final
from uuid import UUID

from paperclip.snapshots.store.backends import blob_backend

logger = logging.getLogger(__name__)

WINDOW: Final = 64  # blobs asked for in one `get_many` (8 requests in flight on s3)
MAX_BLOB_BYTES: Final = 1024 * 1024  # bigger blobs stream through the ordinary read
MAX_HELD: Final = 4 * WINDOW  # fetched but not yet taken: the oldest dropped beyond this


def verified_many(*, company_id: UUID, rows: Mapping[str, tuple[int, int]]) -> dict[str, bytes]:
    """The whole bytes of `rows` (name -> (id, size)) that the backend holds and that hash to
    their names in exactly their sizes; the others are left out (and logged when damaged)."""
    found: dict[str, bytes] = {}
    for digest, data in blob_backend().get_many(company_id=company_id, rows=rows).items():
        if len(data) != rows[digest][1] or "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            logger.error("blob %s read back as bytes that do not hash to its name", digest)
            continue
        found[digest] = data
    return found


class ReadAhead:
    """Small blobs of `order` (the names in the order they will be asked for) taken one by one
    with `take`; None for a blob it does not hold. Only worth it where the backend's reads are
    round trips: `wanted()` says so."""

    def __init__(
        self, *, company_id: UUID, order: Iterable[str], rows: Mapping[str, tuple[int, int]]
    ) -> None:
        self.company_id = company_id
        self.rows = rows
        self.small = [
            d for d in dict.fromkeys(order) if 0 < rows.get(d, (0, 0))[1] <= MAX_BLOB_BYTES
        ]
        self.position = {digest: i for i, digest in enumerate(self.small)}
        self.held: OrderedDict[str, bytes] = OrderedDict()
        self.fetched: set[str] = set()
        self.requests = 0  # `get_many` calls made (for tests and the bench's curiosity)

    @staticmethod
    def wanted() -> bool:
        return not blob_backend().cheap_stat

    def take(self, digest: str) -> bytes | None:
        index = self.position.get(digest)
        if index is None:
            return None
        if digest not in self.fetched:
            self._fetch(index)
        return self.held.pop(digest, None)

    def _fetch(self, start: int) -> None:
        names = [d for d in self.small[start : start + WINDOW] if d not in self.fetched]
        self.fetched.update(names)
        self.requests += 1
        found = verified_many(company_id=self.company_id, rows={d: self.rows[d] for d in names})
        self.held.update(found)
        while len(self.held) > MAX_HELD:
            self.held.popitem(last=False)
