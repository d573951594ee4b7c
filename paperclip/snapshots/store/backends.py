"""Where a blob's bytes live: one narrow interface, `BlobBackend` (`put`, `stat`, `delete`,
`get`, `get_many` for many small blobs at once, and the optional `presigned_url`), its
filesystem and postgres implementations and the s3 one (`paperclip.snapshots.store.s3`),
chosen by `PAPERCLIP_CAS_BACKEND` (docs/snapshots.md#the-store). The row index, the upsert,
find-missing, the size checks and the verification of what a read returns stay outside the
backends, in `uploads`, `reads` and `pins`, so every backend answers the same."""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import IO, Final, Protocol
from uuid import UUID

from django.conf import settings

from paperclip.db.prepared import prepared_cursor
from paperclip.models import CasBlobChunk
from paperclip.snapshots.store.names import CHUNK_BYTES, READ_BYTES
from paperclip.snapshots.store.spool import Region


class BlobBackend(Protocol):
    # `stat` is a local check (a file's size, or nothing to check): find-missing may ask it
    # of every present name. False for a remote store (s3: one request per name).
    cheap_stat: bool

    def put(self, *, blob_id: int, company_id: UUID, digest: str, source: Region) -> None:
        """Store the bytes of `source` for the row `blob_id` (inside its transaction)."""

    def stat(self, *, company_id: UUID, digest: str, size: int) -> bool:
        """The bytes of an existing row are there."""

    def delete(self, *, company_id: UUID, digest: str) -> None:
        """Remove a blob's bytes: those `put` wrote in a transaction that is rolling back, or
        those of a row the collector deletes."""

    def delete_many(self, *, company_id: UUID, digests: list[str]) -> None:
        """Remove the bytes of rows the collector deletes (in its transaction, before the
        commit, while it holds the rows)."""

    def get(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        """The bytes, in pieces; raises FileNotFoundError when they are gone, and
        BlobStoreUnavailable (503) when the store cannot be reached (s3)."""

    def get_many(
        self, *, company_id: UUID, rows: Mapping[str, tuple[int, int]]
    ) -> dict[str, bytes]:
        """The whole bytes of small blobs (directory blobs, a tree walk's level), by name, of
        `rows` (name -> (id, size), as `cas_rows` reads them); a blob whose bytes are gone is
        left out. The caller checks the bytes against the name."""


def blob_path(company_id: UUID | str, digest: str) -> Path:
    """Where the filesystem backend keeps a blob."""
    return Path(blob_file(company_id, digest))


def blob_file(company_id: UUID | str, digest: str) -> str:
    """`blob_path` as a string, built without pathlib (once per file a materialization
    writes: the Path operations cost more than opening the file)."""
    hexdigest = digest.removeprefix("sha256:")
    return f"{os.fspath(settings.PAPERCLIP_CAS_DIR)}/{company_id}/{hexdigest[:2]}/{hexdigest}"


class FilesystemBackend:
    cheap_stat = True

    def put(self, *, blob_id: int, company_id: UUID, digest: str, source: Region) -> None:
        self.put_many(company_id=company_id, blobs=[(blob_id, digest, source)])

    def put_many(self, *, company_id: UUID, blobs: list[tuple[int, str, Region]]) -> None:
        """Each blob written to a temporary file beside its place, synced, then renamed into
        place, so a blob's file is never seen short. A batch is written SYNC_GROUP files at
        a time and each group synced together, SYNC_THREADS `fsync` calls in flight: the
        filesystem's journal then commits them together, where a sync after each file cost
        a journal commit per blob (about 2 ms on a disk: two seconds for a batch of 1,000).
        On failure no temporary file is left; files already renamed into place are the
        caller's to remove, as with `put`."""
        for start in range(0, len(blobs), SYNC_GROUP):
            _put_group(company_id, blobs[start : start + SYNC_GROUP])

    def stat(self, *, company_id: UUID, digest: str, size: int) -> bool:
        try:
            return blob_path(company_id, digest).stat().st_size == size
        except FileNotFoundError:
            return False

    def delete(self, *, company_id: UUID, digest: str) -> None:
        blob_path(company_id, digest).unlink(missing_ok=True)

    def delete_many(self, *, company_id: UUID, digests: list[str]) -> None:
        for digest in digests:
            self.delete(company_id=company_id, digest=digest)

    def get(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        handle = blob_path(company_id, digest).open("rb")  # FileNotFoundError: gone
        return _file_chunks(handle)

    def get_many(
        self, *, company_id: UUID, rows: Mapping[str, tuple[int, int]]
    ) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for digest, (_, size) in rows.items():
            try:
                fd = os.open(blob_file(company_id, digest), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                # One read: a regular file reads short only at its end, and bytes that are not
                # the blob's (short or long) fail the caller's check against the name.
                found[digest] = os.read(fd, size + 1)
            finally:
                os.close(fd)
        return found


_CREATE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
SYNC_GROUP: Final = 256  # files open at once while a batch is written and synced
SYNC_THREADS: Final = 16  # fsync calls in flight (each waits on the disk, not the GIL)


def _put_group(company_id: UUID, blobs: list[tuple[int, str, Region]]) -> None:
    """`put_many` of at most SYNC_GROUP blobs: all written, all synced, then all renamed."""
    opened: list[int] = []  # descriptors still open
    pending: list[tuple[str, str]] = []  # temporary, place: not renamed yet
    try:
        for _, digest, source in blobs:
            path = blob_file(company_id, digest)
            directory, _, name = path.rpartition("/")
            temporary = f"{directory}/.{name}.{uuid.uuid4().hex}.tmp"
            try:
                out = os.open(temporary, _CREATE_FLAGS, 0o666)
            except FileNotFoundError:
                os.makedirs(directory, exist_ok=True)
                out = os.open(temporary, _CREATE_FLAGS, 0o666)
            opened.append(out)
            pending.append((temporary, path))
            copy_region(source, out)
        _sync_all(opened)
        while opened:
            os.close(opened.pop())  # taken off first: never closed twice
        while pending:
            os.replace(*pending[-1])
            pending.pop()
    except BaseException:
        for out in opened:
            with suppress(OSError):
                os.close(out)
        for temporary, _ in pending:
            with suppress(FileNotFoundError):
                os.unlink(temporary)
        raise


_sync_pool: ThreadPoolExecutor | None = None
_sync_pool_lock = threading.Lock()


def _syncer() -> ThreadPoolExecutor:
    """The process's pool of fsync threads, made once: a pool per batch started and ended up
    to SYNC_THREADS threads each time (each thread a process id taken from the system)."""
    global _sync_pool  # one per process, made on first use
    with _sync_pool_lock:
        if _sync_pool is None:
            _sync_pool = ThreadPoolExecutor(SYNC_THREADS, thread_name_prefix="cas-fsync")
        return _sync_pool


def _forget_syncer() -> None:
    global _sync_pool  # a forked child has none of its parent's threads
    _sync_pool = None


os.register_at_fork(after_in_child=_forget_syncer)


def _sync_all(descriptors: list[int]) -> None:
    if len(descriptors) == 1:
        os.fsync(descriptors[0])
        return
    for _ in _syncer().map(os.fsync, descriptors):
        pass


def copy_region(source: Region, out: int) -> None:
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


class PostgresBackend:
    cheap_stat = True

    def put(self, *, blob_id: int, company_id: UUID, digest: str, source: Region) -> None:
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

    def stat(self, *, company_id: UUID, digest: str, size: int) -> bool:
        return True  # the pieces commit with the row

    def delete(self, *, company_id: UUID, digest: str) -> None:
        pass  # the rollback takes the pieces with it

    def delete_many(self, *, company_id: UUID, digests: list[str]) -> None:
        pass  # the collector deletes the pieces with their rows

    def get(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        count = -(-size // CHUNK_BYTES)
        first = _chunk(blob_id, 0) if count else b""
        if first is None:
            raise FileNotFoundError(digest)
        return _postgres_chunks(blob_id, first, count)

    def get_many(
        self, *, company_id: UUID, rows: Mapping[str, tuple[int, int]]
    ) -> dict[str, bytes]:
        # Every piece of every blob in one query (a level of a 50,000-file tree is hundreds of
        # directories: one query each would cost more than all the rest of a diff).
        pieces: dict[int, list[bytes]] = {}
        with prepared_cursor() as cursor:
            cursor.execute(
                "SELECT blob_id, data FROM cas_blob_chunks WHERE blob_id = ANY(%s::bigint[])"
                " ORDER BY blob_id, seq",
                [[blob_id for blob_id, _ in rows.values()]],
            )
            for blob_id, data in cursor.fetchall():
                pieces.setdefault(blob_id, []).append(bytes(data))
        return {
            digest: b"".join(pieces.get(blob_id, ()))
            for digest, (blob_id, size) in rows.items()
            if blob_id in pieces or size == 0
        }


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


def blob_backend() -> BlobBackend:
    if settings.PAPERCLIP_CAS_BACKEND == "postgres":
        return PostgresBackend()
    if settings.PAPERCLIP_CAS_BACKEND == "s3":
        # Imported here: the other backends' processes need not load the S3 client.
        from paperclip.snapshots.store.s3 import S3Backend

        return S3Backend()
    return FilesystemBackend()


def blob_presigned_url(
    backend: BlobBackend, *, company_id: UUID, digest: str, size: int
) -> str | None:
    """The backend's optional capability `presigned_url` (a URL that fetches the bytes
    directly from the store for a short while), or None when it has none."""
    presign = getattr(backend, "presigned_url", None)
    if presign is None:
        return None
    url: str | None = presign(company_id=company_id, digest=digest, size=size)
    return url
