"""Reading the store: find-missing, the rows, a blob's bytes, and the directory loader tree
walks use (with its per-process cache)."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Final
from uuid import UUID

from django.conf import settings

from paperclip.db.prepared import prepared_cursor
from paperclip.errors import InvalidRequest
from paperclip.snapshots.store.ahead import verified_many
from paperclip.snapshots.store.backends import blob_backend, blob_file, blob_presigned_url
from paperclip.snapshots.store.names import (
    MAX_DIRECTORY_BYTES,
    MAX_FIND_MISSING,
    BlobTooLarge,
    BlobUnreadable,
    checked_name,
)

logger = logging.getLogger(__name__)

# A blob up to this size is read and verified whole before its first byte is answered, so a
# mismatch is a 422 `blob_unreadable`; a larger one streams, verified as it goes, and its
# last piece is held back until the whole has hashed to the name: a mismatch then cuts the
# stream short of its Content-Length, so a reader never receives all of a wrong blob.
VERIFY_AHEAD_BYTES: Final = 1024 * 1024


def cas_find_missing(*, company_id: UUID, digests: Sequence[str]) -> list[str]:
    """The names among `digests` (at most MAX_FIND_MISSING, validated: 400 naming
    `digests[i]`) that the company's store does not hold, in request order (a name asked
    twice is answered twice). Another company's blobs count as missing.

    A blob answered present has its `referenced_at` moved to now() when it was older than half
    the grace, so a client that skips uploading it can count on it for that long; a blob
    collected after all surfaces as `snapshot_blobs_missing` at registration."""
    if len(digests) > MAX_FIND_MISSING:
        raise InvalidRequest(fields={"digests": [f"At most {MAX_FIND_MISSING} names."]})
    for index, name in enumerate(digests):
        checked_name(name, f"digests[{index}]")
    wanted = sorted(set(digests))
    if not wanted:
        return []
    half_grace = settings.PAPERCLIP_CAS_GRACE_SECONDS / 2
    with prepared_cursor() as cursor:
        cursor.execute(
            """
            WITH touched AS (
                UPDATE cas_blobs SET referenced_at = now()
                WHERE company_id = %s AND digest = ANY(%s::text[])
                  AND referenced_at < now() - make_interval(secs => %s::double precision)
                  AND NOT doomed
            )
            SELECT digest, size FROM cas_blobs
            WHERE company_id = %s AND digest = ANY(%s::text[]) AND NOT doomed
            """,
            [company_id, wanted, half_grace, company_id, wanted],
        )
        rows: list[tuple[str, int]] = cursor.fetchall()
    backend = blob_backend()
    # A backend whose check is a local stat proves the bytes are there (a blob lost anyway is
    # then answered missing and uploaded again); one whose check is a request to a remote
    # store (s3: a HEAD per name, 10,000 per call) trusts the rows, which the upload and
    # collection order keeps true (docs/snapshots.md#object-storage).
    present = {
        digest
        for digest, size in rows
        if not backend.cheap_stat or backend.stat(company_id=company_id, digest=digest, size=size)
    }
    return [d for d in digests if d not in present]


@dataclass(frozen=True, slots=True)
class CasBlobReader:
    digest: str
    size: int
    chunks: Iterator[bytes]  # a generator: close() it if not read to the end


def cas_rows(*, company_id: UUID, digests: Iterable[str]) -> dict[str, tuple[int, int]]:
    """The company's blob rows (id, size) among `digests`, by name, a query per
    MAX_FIND_MISSING names: for callers about to open many blobs (`cas_open(known=...)`),
    which would otherwise look each row up alone. Reads only."""
    wanted = sorted(set(digests))
    found: dict[str, tuple[int, int]] = {}
    for start in range(0, len(wanted), MAX_FIND_MISSING):
        # One array parameter, not 10,000 placeholders (the ORM's `__in`).
        with prepared_cursor() as cursor:
            cursor.execute(
                "SELECT digest, id, size FROM cas_blobs"
                " WHERE company_id = %s AND digest = ANY(%s::text[])",
                [company_id, wanted[start : start + MAX_FIND_MISSING]],
            )
            rows: list[tuple[str, int, int]] = cursor.fetchall()
        found.update((d, (i, n)) for d, i, n in rows)
    return found


def cas_open(
    *, company_id: UUID, digest: str, known: Mapping[str, tuple[int, int]] | None = None
) -> CasBlobReader | None:
    """The company's blob `digest` to stream (its size and its bytes in pieces), or None when
    the company has no such blob (another company's included). `known` is rows read before
    by `cas_rows` (a name not in it is looked up). InvalidRequest for a bad name;
    BlobUnreadable (422) when the row's bytes are gone from the backend or do not hash to the
    name (a large blob's mismatch shows only at its end: its stream raises it before its last
    piece, see VERIFY_AHEAD_BYTES); BlobStoreUnavailable (503) when the store cannot be
    reached. Reads only; writes nothing."""
    checked_name(digest)
    row = known.get(digest) if known is not None else None
    if row is None:
        row = blob_row(company_id, digest)
    if row is None:
        return None
    blob_id, size = row
    try:
        chunks = blob_backend().get(
            blob_id=blob_id, company_id=company_id, digest=digest, size=size
        )
    except FileNotFoundError:
        _unless_collected(company_id, digest)
        return None
    verified = verified_chunks(chunks, digest=digest, size=size)
    if size <= VERIFY_AHEAD_BYTES:
        data = b"".join(verified)  # BlobUnreadable here, before anything is answered
        return CasBlobReader(digest=digest, size=size, chunks=_pieces(data))
    return CasBlobReader(digest=digest, size=size, chunks=verified)


def cas_blob_redirect(*, company_id: UUID, digest: str) -> str | None:
    """A short-lived URL that fetches the company's blob `digest` straight from the store,
    when the backend can sign one, PAPERCLIP_CAS_S3_REDIRECT is on and the blob has at least
    PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES; None otherwise (also when the company has no such
    blob, or its object is missing or not the blob's size: the caller then answers from
    `cas_open`, which says so, 422, where the store would answer the client's redirected GET
    404 again and again). The reader of the URL verifies the bytes against the name (the
    agents' client does). Reads only: one HEAD request to the store."""
    if settings.PAPERCLIP_CAS_BACKEND != "s3" or not settings.PAPERCLIP_CAS_S3_REDIRECT:
        return None
    row = blob_row(company_id, checked_name(digest))
    if row is None or row[1] < settings.PAPERCLIP_CAS_S3_REDIRECT_MIN_BYTES:
        return None
    backend = blob_backend()
    if not backend.stat(company_id=company_id, digest=digest, size=row[1]):
        return None
    return blob_presigned_url(backend, company_id=company_id, digest=digest, size=row[1])


def verified_chunks(chunks: Iterator[bytes], *, digest: str, size: int) -> Iterator[bytes]:
    """`chunks` passed on while they are hashed, the last piece held back until all of them
    hash to `digest` in exactly `size` bytes: BlobUnreadable (reason `digest_mismatch`)
    otherwise, so wrong bytes are never passed on whole. Closes `chunks`."""
    hasher = hashlib.sha256()
    total = 0
    held: bytes | None = None
    try:
        for data in chunks:
            total += len(data)
            if total > size:
                break
            hasher.update(data)
            if held is not None:
                yield held
            held = data
        if total != size or "sha256:" + hasher.hexdigest() != digest:
            logger.error(
                "blob %s read back as %d bytes that do not hash to its name", digest, total
            )
            raise BlobUnreadable(
                f"The bytes of blob {digest} in the store do not hash to its name; they are "
                "never served as it.",
                digest=digest,
                reason="digest_mismatch",
            )
        if held is not None:
            yield held
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _pieces(data: bytes) -> Iterator[bytes]:
    if data:
        yield data


def _unless_collected(company_id: UUID, digest: str) -> None:
    """A row whose bytes the backend lacks: nothing when the row is gone too (collected
    between the two reads: absent), else BlobUnreadable (reason `missing`: lost behind the
    store's back)."""
    if blob_row(company_id, digest) is None:
        return
    logger.error("blob %s of company %s has a row but no bytes in the store", digest, company_id)
    raise BlobUnreadable(
        f"The store lost the bytes of blob {digest} (its row remains).",
        digest=digest,
        reason="missing",
    )


def cas_blob_file(
    *, company_id: UUID, digest: str, known: Mapping[str, tuple[int, int]]
) -> BinaryIO | None:
    """The filesystem backend's file of a blob among `known` (rows read by `cas_rows`),
    opened for reading (unbuffered, so that a reader can copy it in the kernel); None for the
    postgres backend, a name not in `known` or bytes that are gone (`cas_open` then answers).
    The caller closes it and must never write to it."""
    if settings.PAPERCLIP_CAS_BACKEND != "filesystem" or digest not in known:
        return None
    try:
        fd = os.open(blob_file(company_id, checked_name(digest)), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    return io.FileIO(fd, "rb", closefd=True)


class _DirectoryCache:
    """Small blobs read whole (directory blobs, in tree walks), kept per process: a blob's
    bytes never change under its name, so a hit is always right; only whether the company
    still holds it can change, which the callers that need it check on the rows (registration
    touches every row it reaches). Least recently used out past MAX_BYTES."""

    MAX_BYTES: Final = 16 * 1024 * 1024

    def __init__(self) -> None:
        self._items: OrderedDict[tuple[UUID, str], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[UUID, str]) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def put(self, key: tuple[UUID, str], data: bytes) -> None:
        with self._lock:
            if key in self._items or len(data) > self.MAX_BYTES // 8:
                return
            self._items[key] = data
            self._bytes += len(data)
            while self._bytes > self.MAX_BYTES:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)


_directories = _DirectoryCache()


def cas_load_many(*, company_id: UUID, digests: Iterable[str], max_bytes: int) -> dict[str, bytes]:
    """The whole bytes of each of the company's blobs among `digests` that it holds (absent
    ones left out), for tree walks: rows in one query per MAX_FIND_MISSING names, the bytes
    in one `get_many` of the backend, repeats from a per-process cache of small blobs.
    Raises BlobTooLarge for a blob over `max_bytes`."""
    found: dict[str, bytes] = {}
    wanted: list[str] = []
    for digest in set(digests):
        checked_name(digest)
        cached = _directories.get((company_id, digest))
        if cached is not None:
            found[digest] = cached
        else:
            wanted.append(digest)
    if not wanted:
        return found
    rows = cas_rows(company_id=company_id, digests=wanted)
    for digest, (_, size) in rows.items():
        if size > max_bytes:
            raise BlobTooLarge(max_bytes=max_bytes, digest=digest)
    # Small blobs read whole, checked against their names for every backend: a damaged one is
    # absent to a tree walk, never read as the directory it claims to be.
    for digest, data in verified_many(company_id=company_id, rows=rows).items():
        _directories.put((company_id, digest), data)
        found[digest] = data
    return found


def directory_loader(company_id: UUID) -> Callable[[list[str]], dict[str, bytes]]:
    """`cas_load_many` for a tree walk's `load_many`: the company's directory blobs by name,
    each at most MAX_DIRECTORY_BYTES."""

    def load_many(names: list[str]) -> dict[str, bytes]:
        return cas_load_many(company_id=company_id, digests=names, max_bytes=MAX_DIRECTORY_BYTES)

    return load_many


def cas_load(*, company_id: UUID, digest: str, max_bytes: int) -> bytes | None:
    """The whole blob (meant for small ones, such as directory blobs in tree walks), or None
    when the company does not have it. Raises BlobTooLarge (`details.max_bytes`) for a stored
    blob bigger than `max_bytes`, InvalidRequest for a bad name, BlobUnreadable when its bytes
    are gone or wrong."""
    checked_name(digest)
    row = blob_row(company_id, digest)
    if row is None:
        return None
    blob_id, size = row
    if size > max_bytes:
        raise BlobTooLarge(max_bytes=max_bytes, digest=digest)
    try:
        chunks = blob_backend().get(
            blob_id=blob_id, company_id=company_id, digest=digest, size=size
        )
    except FileNotFoundError:
        _unless_collected(company_id, digest)
        return None
    return b"".join(verified_chunks(chunks, digest=digest, size=size))


def blob_row(company_id: UUID, digest: str) -> tuple[int, int] | None:
    from paperclip.models import CasBlob

    row: Any = (
        CasBlob.objects.filter(company_id=company_id, digest=digest)
        .values_list("id", "size")
        .first()
    )
    return None if row is None else (int(row[0]), int(row[1]))


class ChunkStream(io.RawIOBase):
    """A blob's pieces as a readable stream (materialization reads files in pieces)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            piece = next(self._chunks, None)
            if piece is None:
                return 0
            self._pending = piece
        size = min(len(buffer), len(self._pending))
        buffer[:size] = self._pending[:size]
        self._pending = self._pending[size:]
        return size

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()
        super().close()
