"""The company-scoped content-addressed store (docs/snapshots.md#the-store).

A blob is named `sha256:<64 lowercase hex>` of its bytes and belongs to one company: the same
bytes uploaded by two companies are two blobs, and one company never learns whether another
holds a name. The `CasBlob` row is the index (size, `created_at`, `referenced_at`, the
collector's clock); the bytes live in the backend chosen by `PAPERCLIP_CAS_BACKEND`:

- `filesystem` (default): `<PAPERCLIP_CAS_DIR>/<company_id>/<hex[:2]>/<hex>` (the directory
  defaults to `<PAPERCLIP_DATA_DIR>/cas`), written through a temporary sibling and a rename;
- `postgres`: `CasBlobChunk` rows of at most 1 MiB, in the transaction that writes the row.

Uploads hash the bytes as they stream into a spooled temporary file (never the whole blob in
memory), refuse them as soon as they pass the size limit, and only then open a transaction.

Safety against the collector (`paperclip.snapshots.collect`): an upload first upserts the row
(`INSERT ... ON CONFLICT DO UPDATE`, which takes the row lock and waits for a collector that
is deleting it, then inserts afresh), then places the bytes, then commits; the collector
deletes rows with `FOR UPDATE SKIP LOCKED`, re-checking their age, and removes their bytes
before its own commit, still holding the rows. So a committed row always has its bytes, and
the collector never removes the bytes of a row an upload re-created. Should bytes be lost all
the same (a crash between the collector's unlinks and its commit), the filesystem backend's
find-missing answers such a blob missing and the next upload of it writes the bytes again.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Final, Protocol
from uuid import UUID

from django.conf import settings
from django.db import transaction

from paperclip.access import Actor
from paperclip.db.locking import busy_on_lock_timeout, require_transaction, set_local_lock_timeout
from paperclip.db.prepared import prepared_cursor
from paperclip.errors import DomainError, InvalidRequest, NotFoundError, PayloadTooLargeError
from paperclip.ids import parse_uuid
from paperclip.models import CasBlobChunk, Company

logger = logging.getLogger(__name__)

BLOB_NAME: Final = re.compile(r"sha256:[0-9a-f]{64}")
CHUNK_BYTES: Final = 1024 * 1024  # one CasBlobChunk row (postgres backend)
READ_BYTES: Final = 64 * 1024  # what is read from a request or a file at a time
SPOOL_BYTES: Final = 1024 * 1024  # a spooled upload moves to a temporary file past this
MAX_FIND_MISSING: Final = 10_000
MAX_BATCH_BLOBS: Final = 10_000
MAX_FRAME_HEADER: Final = 128  # `sha256:<64 hex> <size>\n` is at most 88 bytes
# Directory blobs are read whole; one this large is not a directory anyone meant.
MAX_DIRECTORY_BYTES: Final = 64 * 1024 * 1024


# --- errors -----------------------------------------------------------------------------------


class BlobDigestMismatch(DomainError):  # 400
    code = "blob_digest_mismatch"
    message = "The bytes do not hash to the blob's name; nothing was stored."
    status_code = 400


class BlobTooLarge(PayloadTooLargeError):  # 413, details.max_bytes
    code = "blob_too_large"
    message = "The blob is larger than the store accepts (PAPERCLIP_CAS_MAX_BLOB_BYTES)."


class BatchTooLarge(PayloadTooLargeError):  # 413, details.max_bytes
    code = "request_too_large"
    message = "The batch is larger than the store accepts (PAPERCLIP_CAS_MAX_BATCH_BYTES)."


def blob_name_problem(name: object) -> str | None:
    """Why `name` is not a blob name, or None."""
    if not isinstance(name, str) or not BLOB_NAME.fullmatch(name):
        return "Must be a blob name: sha256:<64 lowercase hex digits>."
    return None


def _checked_name(name: object, field: str = "name") -> str:
    if (problem := blob_name_problem(name)) is not None:
        raise InvalidRequest(fields={field: [problem]})
    assert isinstance(name, str)  # noqa: S101 - blob_name_problem checked it
    return name


# --- which company ----------------------------------------------------------------------------


def cas_company(*, actor: Actor, company_id: str | None) -> UUID:
    """The company whose store the caller uses: an agent's own (a `company_id` naming any other
    is a 404); a board caller must name one it belongs to (`company_id` query parameter):
    missing or malformed is 400 `invalid_request`, another company or none at all 404."""
    if actor.is_agent:
        assert actor.agent is not None  # noqa: S101 - an agent actor carries its agent
        own: UUID = actor.agent.company_id
        if company_id is not None and parse_uuid(company_id) != own:
            raise NotFoundError()
        return own
    if company_id is None:
        raise InvalidRequest(fields={"company_id": ["Required for a board caller."]})
    parsed = parse_uuid(company_id)
    if parsed is None:
        raise InvalidRequest(fields={"company_id": ["Must be a valid UUID."]})
    if not actor.can_access(parsed) or not Company.objects.filter(pk=parsed).exists():
        raise NotFoundError()
    return parsed


# --- backends ---------------------------------------------------------------------------------


class _Backend(Protocol):
    def place(self, *, blob_id: int, company_id: UUID, digest: str, source: _Region) -> None:
        """Store the bytes of `source` for the row `blob_id` (inside its transaction)."""

    def present(self, *, company_id: UUID, digest: str, size: int) -> bool:
        """The bytes of an existing row are there."""

    def unplace(self, *, company_id: UUID, digest: str) -> None:
        """Remove bytes `place` wrote in a transaction that is rolling back."""

    def chunks(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        """The bytes, in pieces; raises FileNotFoundError when they are gone."""


def blob_path(company_id: UUID | str, digest: str) -> Path:
    """Where the filesystem backend keeps a blob."""
    return Path(_blob_file(company_id, digest))


def _blob_file(company_id: UUID | str, digest: str) -> str:
    """`blob_path` as a string, built without pathlib (once per file a materialization
    writes: the Path operations cost more than opening the file)."""
    hexdigest = digest.removeprefix("sha256:")
    return f"{os.fspath(settings.PAPERCLIP_CAS_DIR)}/{company_id}/{hexdigest[:2]}/{hexdigest}"


class _Filesystem:
    def place(self, *, blob_id: int, company_id: UUID, digest: str, source: _Region) -> None:
        path = _blob_file(company_id, digest)
        directory, _, name = path.rpartition("/")
        temporary = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
        try:
            out = os.open(temporary, _CREATE_FLAGS, 0o666)
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)
            out = os.open(temporary, _CREATE_FLAGS, 0o666)
        try:
            try:
                _copy(source, out)
                os.fsync(out)
            finally:
                os.close(out)
            os.replace(temporary, path)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(temporary)
            raise

    def present(self, *, company_id: UUID, digest: str, size: int) -> bool:
        try:
            return blob_path(company_id, digest).stat().st_size == size
        except FileNotFoundError:
            return False

    def unplace(self, *, company_id: UUID, digest: str) -> None:
        blob_path(company_id, digest).unlink(missing_ok=True)

    def chunks(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        handle = blob_path(company_id, digest).open("rb")  # FileNotFoundError: gone
        return _file_chunks(handle)


_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _copy(source: _Region, out: int) -> None:
    """Write `source`'s bytes to the descriptor `out`: in the kernel (`copy_file_range`, no
    Python buffers) when the source is a real file, else piece by piece."""
    if source.fd is not None:
        try:
            while source.left > 0:
                done = os.copy_file_range(source.fd, out, source.left, offset_src=source.offset)
                if done <= 0:
                    break
                source.offset += done
                source.left -= done
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
    while data := source.read(READ_BYTES):
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
    if source.left:  # the spooled file ended early: never place a short blob
        raise OSError(errno.EIO, f"{source.left} bytes of a spooled blob missing")


def _file_chunks(handle: IO[bytes]) -> Iterator[bytes]:
    try:
        while data := handle.read(READ_BYTES):
            yield data
    finally:
        handle.close()


class _Postgres:
    def place(self, *, blob_id: int, company_id: UUID, digest: str, source: _Region) -> None:
        CasBlobChunk.objects.filter(blob_id=blob_id).delete()  # (a re-placed row's old pieces)
        seq = 0
        # Bound server-side: Django's client-side binding would copy each piece into the
        # query text (twice its size, as hex), and psycopg keeps recent query texts.
        with prepared_cursor() as cursor:
            while data := source.read(CHUNK_BYTES):
                cursor.execute(
                    "INSERT INTO cas_blob_chunks (blob_id, seq, data) VALUES (%s, %s, %s)",
                    [blob_id, seq, data],
                )
                seq += 1

    def present(self, *, company_id: UUID, digest: str, size: int) -> bool:
        return True  # the pieces commit with the row

    def unplace(self, *, company_id: UUID, digest: str) -> None:
        pass  # the rollback takes the pieces with it

    def chunks(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        count = -(-size // CHUNK_BYTES)
        first = _chunk(blob_id, 0) if count else b""
        if first is None:
            raise FileNotFoundError(digest)
        return _postgres_chunks(blob_id, first, count)


def _chunk(blob_id: int, seq: int) -> bytes | None:
    row = CasBlobChunk.objects.filter(blob_id=blob_id, seq=seq).values_list("data", flat=True)
    data = row.first()
    return None if data is None else bytes(data)


def _postgres_chunks(blob_id: int, first: bytes, count: int) -> Iterator[bytes]:
    # One piece per query, so a streamed 64 MiB blob never sits in memory; a blob collected
    # mid-stream ends short of its Content-Length, which the client sees as a failed download.
    if count:
        yield first
    for seq in range(1, count):
        data = _chunk(blob_id, seq)
        if data is None:
            return
        yield data


def _backend() -> _Backend:
    if settings.PAPERCLIP_CAS_BACKEND == "postgres":
        return _Postgres()
    return _Filesystem()


# --- streaming in -----------------------------------------------------------------------------


class _Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


@dataclass(slots=True)
class _Spooled:
    """A verified blob's bytes: `size` bytes of `file` from `offset` (a batch shares one file)."""

    digest: str
    size: int
    file: IO[bytes]
    offset: int = 0
    fd: int | None = None  # `file`'s descriptor when it is a real file (kernel-side copies)

    def reader(self) -> _Region:
        return _Region(self.file, self.offset, self.size, self.fd)


class _Region:
    """`size` bytes of `file` from `offset`, read in pieces (`read(n)`, b"" at the end);
    `fd` is the file's descriptor when it is a real file."""

    def __init__(self, file: IO[bytes], offset: int, size: int, fd: int | None = None) -> None:
        self.file, self.offset, self.left, self.fd = file, offset, size, fd

    def read(self, size: int = -1, /) -> bytes:
        want = self.left if size < 0 else min(size, self.left)
        if want <= 0:
            return b""
        self.file.seek(self.offset)
        data = self.file.read(want)
        self.offset += len(data)
        self.left -= len(data)
        return data


def _spool(
    stream: _Readable | None,
    *,
    digest: str,
    length: int | None,
    max_bytes: int,
    into: IO[bytes] | None = None,
) -> _Spooled:
    """Read `stream` (exactly `length` bytes when given, else to its end) into a spooled
    temporary file (or append it to `into`, a batch's file), hashing as it goes; BlobTooLarge
    as soon as it passes `max_bytes`, BlobDigestMismatch when the bytes are not `digest`'s."""
    if length is not None and length > max_bytes:
        raise BlobTooLarge(max_bytes=max_bytes, digest=digest)
    own = into is None
    spool: IO[bytes] = (
        tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115
        if into is None
        else into
    )
    offset = spool.tell()
    try:
        hasher = hashlib.sha256()
        size = 0
        while True:
            want = READ_BYTES if length is None else min(READ_BYTES, length - size)
            if want <= 0:
                break
            data = stream.read(want) if stream is not None else b""
            if not data:
                break
            size += len(data)
            if size > max_bytes:
                raise BlobTooLarge(max_bytes=max_bytes, digest=digest)
            hasher.update(data)
            spool.write(data)
        if length is not None and size != length:
            raise InvalidRequest(
                fields={"body": [f"The body ended after {size} of {length} bytes."]}
            )
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            raise BlobDigestMismatch(digest=digest, actual=actual, size=size)
    except BaseException:
        if own:
            spool.close()
        raise
    return _Spooled(digest=digest, size=size, file=spool, offset=offset)


# --- writing ----------------------------------------------------------------------------------

# Rows are upserted in digest order (the `sorted` of the callers): two uploads, or an upload
# and a registration's `cas_pin` (same order), never wait for each other in a cycle. The
# collector skips locked rows, so it never waits for either.
_UPSERT: Final = """
    INSERT INTO cas_blobs (company_id, digest, size, created_at, referenced_at)
    SELECT %s, t.digest, t.size, now(), now()
    FROM unnest(%s::text[], %s::bigint[]) AS t(digest, size)
    ORDER BY t.digest
    ON CONFLICT (company_id, digest) DO UPDATE SET referenced_at = now()
    RETURNING id, digest, (xmax = 0) AS inserted
"""


def _store(company_id: UUID, spooled: Sequence[_Spooled]) -> dict[str, bool]:
    """Upsert the rows (locking them), then place the bytes of new rows and of existing rows
    whose bytes are gone; returns digest → created. Runs in the caller's transaction; on any
    error removes what it placed before the transaction rolls back (still holding the rows,
    so no concurrent upload of the same blob can have written there meanwhile)."""
    require_transaction()
    by_digest = {s.digest: s for s in spooled}
    digests = sorted(by_digest)
    backend = _backend()
    set_local_lock_timeout()
    with prepared_cursor() as cursor:
        cursor.execute(_UPSERT, [company_id, digests, [by_digest[d].size for d in digests]])
        rows: list[tuple[int, str, bool]] = cursor.fetchall()
    placed: list[str] = []
    try:
        for blob_id, digest, inserted in sorted(rows, key=lambda r: r[1]):
            blob = by_digest[digest]
            if inserted or not backend.present(
                company_id=company_id, digest=digest, size=blob.size
            ):
                backend.place(
                    blob_id=blob_id, company_id=company_id, digest=digest, source=blob.reader()
                )
                if inserted:
                    placed.append(digest)
    except BaseException:
        for digest in placed:
            try:
                backend.unplace(company_id=company_id, digest=digest)
            except OSError:  # pragma: no cover - best effort; the blob is only stray bytes
                logger.warning("could not remove %s of a failed upload", digest, exc_info=True)
        raise
    return {digest: inserted for _, digest, inserted in rows}


@dataclass(frozen=True, slots=True)
class CasPut:
    digest: str
    size: int
    created: bool  # False: the company already had it (its `referenced_at` moved)


def cas_put(
    *, company_id: UUID, digest: str, stream: _Readable | None, length: int | None
) -> CasPut:
    """Store the blob `digest` from `stream` (`length` bytes when known, e.g. the request's
    Content-Length; else to its end) in the company's store, or note that it is already there.

    Hashes while streaming into a spooled temporary file; then, in one transaction, upserts
    the row (locking it; lock waits bounded, else `resource_busy`), places the bytes and
    commits. Raises InvalidRequest (bad name, body shorter than `length`), BlobTooLarge (413,
    `details.max_bytes`, as soon as the limit is passed), BlobDigestMismatch; nothing is kept
    on any error. Blob uploads are content, not domain state: no audit row."""
    _checked_name(digest)
    spooled = _spool(
        stream, digest=digest, length=length, max_bytes=settings.PAPERCLIP_CAS_MAX_BLOB_BYTES
    )
    try:
        with busy_on_lock_timeout(), transaction.atomic(durable=True):
            created = _store(company_id, [spooled])[digest]
    finally:
        spooled.file.close()
    return CasPut(digest=digest, size=spooled.size, created=created)


@dataclass(frozen=True, slots=True)
class CasBatch:
    stored: list[str]  # new to the company, in frame order
    existing: list[str]  # already there, in frame order


class _Body:
    """The batch body as a buffered reader that never reads past `length` bytes."""

    def __init__(self, stream: _Readable | None, length: int) -> None:
        self.stream = stream
        self.unread = length  # not yet taken from `stream`
        self.buffer = b""
        self.at = 0  # what of `buffer` was taken (no copy of the rest per read)

    @property
    def remaining(self) -> int:
        return self.unread + len(self.buffer) - self.at

    def _fill(self) -> bool:
        if self.stream is None or self.unread <= 0:
            return False
        data = self.stream.read(min(READ_BYTES, self.unread))
        if not data:
            self.unread = 0  # the client sent less than its Content-Length
            return False
        self.unread -= len(data)
        self.buffer = self.buffer[self.at :] + data if self.at < len(self.buffer) else data
        self.at = 0
        return True

    def read(self, size: int = -1, /) -> bytes:
        if self.at >= len(self.buffer):
            self._fill()
        if self.at == 0 and (size < 0 or size >= len(self.buffer)):
            data, self.buffer = self.buffer, b""
            return data
        end = len(self.buffer) if size < 0 else self.at + size
        data = self.buffer[self.at : end]
        self.at += len(data)
        return data

    def line(self, limit: int) -> bytes | None:
        """The next line without its newline; None at the end of the body; ValueError when
        no newline comes within `limit` bytes or before the end."""
        while (end := self.buffer.find(b"\n", self.at, self.at + limit)) < 0:
            if len(self.buffer) - self.at >= limit or not self._fill():
                if self.at >= len(self.buffer):
                    return None
                raise ValueError("unterminated")
        line = self.buffer[self.at : end]
        self.at = end + 1
        return line


def _frame_header(body: _Body) -> tuple[str, int] | None:
    """The next frame's `<name> <size>`, or None at the end of the body."""
    try:
        line = body.line(MAX_FRAME_HEADER)
    except ValueError:
        raise _bad_frame("A frame header is too long or the body ends inside it.") from None
    if line is None:
        return None
    name, sep, size_text = line.decode("ascii", "replace").partition(" ")
    if not sep or blob_name_problem(name) is not None:
        raise _bad_frame("A frame header is not `<sha256:hex> <size>`.")
    if not size_text.isascii() or not size_text.isdigit() or len(size_text) > 19:
        raise _bad_frame("A frame size is not a decimal number of bytes.")
    if size_text != "0" and size_text.startswith("0"):
        raise _bad_frame("A frame size has leading zeros.")
    return name, int(size_text)


def _batch_file() -> IO[bytes]:
    """An unnamed temporary file for a batch's frames: in the filesystem store's directory
    (the same filesystem as the blobs), else the system's temporary directory."""
    if settings.PAPERCLIP_CAS_BACKEND != "postgres":
        directory = Path(settings.PAPERCLIP_CAS_DIR)
        directory.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryFile(dir=directory)
    return tempfile.TemporaryFile()


def _bad_frame(message: str) -> InvalidRequest:
    return InvalidRequest(fields={"body": [message]})


def cas_put_batch(*, company_id: UUID, stream: _Readable | None, length: int) -> CasBatch:
    """Store many blobs sent as frames (docs/snapshots.md#batch-upload): each an ASCII header
    line `<name> <size>\\n` followed by exactly `size` bytes, frame after frame to the end of
    the body (`length` bytes: the request's Content-Length). At most
    PAPERCLIP_CAS_MAX_BATCH_BYTES of body (413 `request_too_large`, before anything is read)
    and MAX_BATCH_BLOBS frames; each blob is verified as `cas_put` does (one over
    PAPERCLIP_CAS_MAX_BLOB_BYTES: 413 `blob_too_large`; a mismatch: 400
    `blob_digest_mismatch` with `details.digest`; malformed framing: 400 `invalid_request`
    with `details.fields.body`). All or nothing: every frame is read and verified before one
    transaction stores them all. A name sent twice is stored once. No audit row."""
    max_batch = settings.PAPERCLIP_CAS_MAX_BATCH_BYTES
    if length > max_batch:
        raise BatchTooLarge(max_bytes=max_batch)
    max_blob = settings.PAPERCLIP_CAS_MAX_BLOB_BYTES
    body = _Body(stream, length)
    spooled: list[_Spooled] = []
    order: list[str] = []
    # All frames go to one temporary file on disk (never the batch in memory: a web process
    # serves several batches at once), next to the store so its bytes are copied into place
    # by the kernel.
    with _batch_file() as into:
        while (header := _frame_header(body)) is not None:
            name, size = header
            if len(order) >= MAX_BATCH_BLOBS:
                raise _bad_frame(f"More than {MAX_BATCH_BLOBS} frames.")
            if size > max_blob:
                raise BlobTooLarge(max_bytes=max_blob, digest=name)
            if size > body.remaining:
                raise _bad_frame(f"The body ends inside the frame of {name}.")
            try:
                spooled.append(
                    _spool(body, digest=name, length=size, max_bytes=max_blob, into=into)
                )
            except InvalidRequest as exc:
                raise _bad_frame(f"The body ends inside the frame of {name}.") from exc
            order.append(name)
        created: dict[str, bool] = {}
        if spooled:
            into.flush()
            for blob in spooled:
                blob.fd = into.fileno()
            with busy_on_lock_timeout(), transaction.atomic(durable=True):
                created = _store(company_id, spooled)
    stored: list[str] = []
    existing: list[str] = []
    seen: set[str] = set()
    for name in order:
        if name not in seen:
            seen.add(name)
            (stored if created[name] else existing).append(name)
    return CasBatch(stored=stored, existing=existing)


# --- reading ----------------------------------------------------------------------------------


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
        _checked_name(name, f"digests[{index}]")
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
            )
            SELECT digest, size FROM cas_blobs
            WHERE company_id = %s AND digest = ANY(%s::text[])
            """,
            [company_id, wanted, half_grace, company_id, wanted],
        )
        rows: list[tuple[str, int]] = cursor.fetchall()
    backend = _backend()
    present = {
        digest
        for digest, size in rows
        if backend.present(company_id=company_id, digest=digest, size=size)
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
    by `cas_rows` (a name not in it is looked up). InvalidRequest for a bad name. Reads only;
    writes nothing."""
    _checked_name(digest)
    row = known.get(digest) if known is not None else None
    if row is None:
        row = _blob_row(company_id, digest)
    if row is None:
        return None
    blob_id, size = row
    try:
        chunks = _backend().chunks(blob_id=blob_id, company_id=company_id, digest=digest, size=size)
    except FileNotFoundError:
        return None  # collected between the two reads
    return CasBlobReader(digest=digest, size=size, chunks=chunks)


def cas_blob_file(
    *, company_id: UUID, digest: str, known: Mapping[str, tuple[int, int]]
) -> BinaryIO | None:
    """The filesystem backend's file of a blob among `known` (rows read by `cas_rows`),
    opened for reading (unbuffered, so that a reader can copy it in the kernel); None for the
    postgres backend, a name not in `known` or bytes that are gone (`cas_open` then answers).
    The caller closes it and must never write to it."""
    if settings.PAPERCLIP_CAS_BACKEND == "postgres" or digest not in known:
        return None
    try:
        fd = os.open(_blob_file(company_id, _checked_name(digest)), os.O_RDONLY | os.O_CLOEXEC)
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
    ones left out), for tree walks: rows in one query per MAX_FIND_MISSING names, repeats
    from a per-process cache of small blobs. Raises BlobTooLarge for a blob over `max_bytes`."""
    found: dict[str, bytes] = {}
    wanted: list[str] = []
    for digest in set(digests):
        _checked_name(digest)
        cached = _directories.get((company_id, digest))
        if cached is not None:
            found[digest] = cached
        else:
            wanted.append(digest)
    if not wanted:
        return found
    rows = cas_rows(company_id=company_id, digests=wanted)
    backend = _backend()
    for digest, (blob_id, size) in rows.items():
        if size > max_bytes:
            raise BlobTooLarge(max_bytes=max_bytes, digest=digest)
        try:
            data = b"".join(
                backend.chunks(blob_id=blob_id, company_id=company_id, digest=digest, size=size)
            )
        except FileNotFoundError:
            continue
        _directories.put((company_id, digest), data)
        found[digest] = data
    return found


def directory_loader(company_id: UUID) -> Callable[[list[str]], dict[str, bytes]]:
    """`cas_load_many` for a tree walk's `load_many`: the company's directory blobs by name,
    each at most MAX_DIRECTORY_BYTES."""

    def load_many(names: list[str]) -> dict[str, bytes]:
        return cas_load_many(company_id=company_id, digests=names, max_bytes=MAX_DIRECTORY_BYTES)

    return load_many


_PIN: Final = """
    WITH touched AS (
        UPDATE cas_blobs SET referenced_at = now()
        WHERE id IN (
            SELECT id FROM cas_blobs
            WHERE company_id = %(company)s AND digest = ANY(%(batch)s::text[])
              AND referenced_at < now() - make_interval(secs => %(half_grace)s::double precision)
            ORDER BY digest FOR NO KEY UPDATE
        )
        RETURNING digest
    ),
    held AS (
        SELECT digest,
               referenced_at < now() - make_interval(secs => %(half_grace)s::double precision)
                   AS old
        FROM cas_blobs
        WHERE company_id = %(company)s AND digest = ANY(%(batch)s::text[])
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


def cas_store_blobs(*, company_id: UUID, blobs: Mapping[str, bytes]) -> None:
    """Store small blobs the server made itself (directory blobs of a merge or an adoption)."""
    for name, data in blobs.items():
        cas_put(company_id=company_id, digest=name, stream=io.BytesIO(data), length=len(data))


def cas_load(*, company_id: UUID, digest: str, max_bytes: int) -> bytes | None:
    """The whole blob (meant for small ones, such as directory blobs in tree walks), or None
    when the company does not have it. Raises BlobTooLarge (`details.max_bytes`) for a stored
    blob bigger than `max_bytes`, InvalidRequest for a bad name."""
    _checked_name(digest)
    row = _blob_row(company_id, digest)
    if row is None:
        return None
    blob_id, size = row
    if size > max_bytes:
        raise BlobTooLarge(max_bytes=max_bytes, digest=digest)
    try:
        chunks = _backend().chunks(blob_id=blob_id, company_id=company_id, digest=digest, size=size)
        return b"".join(chunks)
    except FileNotFoundError:
        return None


def _blob_row(company_id: UUID, digest: str) -> tuple[int, int] | None:
    from paperclip.models import CasBlob

    row: Any = (
        CasBlob.objects.filter(company_id=company_id, digest=digest)
        .values_list("id", "size")
        .first()
    )
    return None if row is None else (int(row[0]), int(row[1]))


def cas_limits() -> dict[str, int]:
    """What a client needs to plan uploads (`GET /api/cas`)."""
    return {
        "max_blob_bytes": settings.PAPERCLIP_CAS_MAX_BLOB_BYTES,
        "max_batch_bytes": settings.PAPERCLIP_CAS_MAX_BATCH_BYTES,
        "max_batch_blobs": MAX_BATCH_BLOBS,
        "max_find_missing": MAX_FIND_MISSING,
    }
