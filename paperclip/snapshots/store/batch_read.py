"""`POST /api/cas/batch-read`: many small blobs answered in one body of frames, the batch
upload's framing (`<name> <size>\n<bytes>`) in the other direction.

A checkout of a workspace that the workdir has never held asks for every blob of the head:
one request per blob held it to a few hundred files a second whatever the backend. A batch
read answers up to MAX_BATCH_READ_BLOBS names in request order, each read whole and checked
against its name before the first byte of the answer is written (the same verified read as
`GET /api/cas/blobs/{name}`), all or nothing: a name the company does not hold is 404 (with
the names), bytes that are gone or wrong are 422 `blob_unreadable` naming the blob, as a
single read would say. The answer is held in memory: at most MAX_BATCH_READ_BYTES of blob
bytes, so a web process never holds more than that for one request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final
from uuid import UUID

from paperclip.errors import InvalidRequest, NotFoundError
from paperclip.snapshots.store.ahead import verified_many
from paperclip.snapshots.store.names import BatchTooLarge, checked_name
from paperclip.snapshots.store.reads import cas_load, cas_rows

MAX_BATCH_READ_BLOBS: Final = 1_000
MAX_BATCH_READ_BYTES: Final = 8 * 1024 * 1024


class BatchReadTooLarge(BatchTooLarge):  # 413, details.max_bytes
    message = (
        "The blobs asked for add up to more than one batch read answers "
        "(details.max_bytes); ask for fewer, or read the big ones alone."
    )


class BlobsNotFound(NotFoundError):  # 404, details.digests
    message = "The company's store does not hold these blobs (details.digests)."


@dataclass(frozen=True, slots=True)
class CasBatchRead:
    frames: list[tuple[str, bytes]]  # (name, bytes) in request order, each name once


def checked_names(digests: Sequence[object]) -> list[str]:
    """The request's names (at most MAX_BATCH_READ_BLOBS, validated: 400 naming `digests[i]`),
    each once, in order."""
    if not digests:
        raise InvalidRequest(fields={"digests": ["At least one name."]})
    if len(digests) > MAX_BATCH_READ_BLOBS:
        raise InvalidRequest(fields={"digests": [f"At most {MAX_BATCH_READ_BLOBS} names."]})
    return list(dict.fromkeys(checked_name(n, f"digests[{i}]") for i, n in enumerate(digests)))


def cas_read_batch(*, company_id: UUID, digests: Sequence[str]) -> CasBatchRead:
    """The company's blobs `digests` (checked names, each once), whole and verified, in order.

    NotFoundError (`details.digests`: the names the company does not hold, another company's
    included) when any is unknown; BatchReadTooLarge when their sizes add up to more than
    MAX_BATCH_READ_BYTES (checked on the rows, before any byte is read); BlobUnreadable (422)
    for the first blob whose bytes are gone or wrong; BlobStoreUnavailable (503) when the store
    cannot be reached. Reads only; writes nothing."""
    rows = cas_rows(company_id=company_id, digests=digests)
    unknown = [d for d in digests if d not in rows]
    if unknown:
        raise BlobsNotFound(digests=unknown)
    total = sum(size for _, size in rows.values())
    if total > MAX_BATCH_READ_BYTES:
        raise BatchReadTooLarge(max_bytes=MAX_BATCH_READ_BYTES)
    found = verified_many(company_id=company_id, rows=rows)
    frames: list[tuple[str, bytes]] = []
    for digest in digests:
        data = found.get(digest)
        if data is None:
            # Not read back as itself: the single read says why (gone, damaged, or collected
            # since the rows were read), with the same error a GET of the blob would give.
            data = cas_load(company_id=company_id, digest=digest, max_bytes=MAX_BATCH_READ_BYTES)
            if data is None:
                raise BlobsNotFound(digests=[digest])
        frames.append((digest, data))
    return CasBatchRead(frames=frames)


def frame_stream(batch: CasBatchRead) -> list[bytes]:
    """The answer's body in pieces: each frame's header line, then its bytes."""
    pieces: list[bytes] = []
    for digest, data in batch.frames:
        pieces.append(f"{digest} {len(data)}\n".encode("ascii"))
        pieces.append(data)
    return pieces
