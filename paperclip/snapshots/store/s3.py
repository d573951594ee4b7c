"""The s3 backend: blob bytes as objects of an S3-compatible bucket (AWS S3, GCS's
interoperability API, MinIO, Ceph, Garage, `rclone serve s3`), the index in PostgreSQL as
with the other backends (docs/snapshots.md#object-storage).

The client is obstore (Rust's `object_store` crate): a request costs the calling process
about a tenth of the CPU boto3's does, and a batch's requests run concurrently outside the GIL
(docs/snapshots.md#the-client-library has the figures).

Object key `<PAPERCLIP_CAS_S3_PREFIX><company_id>/<hex[:2]>/<hex>`. Uploads read the request's
spool: a blob up to MULTIPART_BYTES in one PUT, a larger one as a multipart upload in parts of
PART_BYTES read from the spool file as they go (at most PART_CONCURRENCY parts in memory). A
read holds a small blob whole; a larger one is copied into a temporary file at the store's
pace before the caller answers anything, so a slow reader never holds a request to the store
open past its timeout and a failed copy is still a 503. Transient errors are retried with
exponential back-off (PAPERCLIP_CAS_S3_MAX_ATTEMPTS attempts); what still fails, and every
other answer than "no such object", is `BlobStoreUnavailable` (503 with Retry-After).
Verifying what a read returns against the blob's name is not this module's: the store's
reads do it for every backend (`paperclip.snapshots.store.reads`).
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any, Final
from uuid import UUID

import obstore
import obstore.exceptions
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from obstore.store import S3Store

from paperclip.snapshots.store.names import READ_BYTES, BlobStoreUnavailable
from paperclip.snapshots.store.spool import Region

if TYPE_CHECKING:
    from obstore.store import S3Config

logger = logging.getLogger(__name__)

READ_CONCURRENCY: Final = 16  # small blobs read at once (a tree walk's level, a read-ahead)
PUT_CONCURRENCY: Final = 16  # a batch's PUTs in flight at once
MULTIPART_BYTES: Final = 8 * 1024 * 1024  # a larger blob goes up in parts (never held whole)
PART_BYTES: Final = 5 * 1024 * 1024  # S3's smallest part (but the last): the least held
PART_CONCURRENCY: Final = 2  # parts of one blob in flight (each held in memory meanwhile)
WHOLE_READ_BYTES: Final = 8 * 1024 * 1024  # a larger object is read through a temporary file
DELETE_CONCURRENCY: Final = 8  # one-by-one deletes in flight (a store without DeleteObjects)
BACKOFF_FIRST: Final = timedelta(milliseconds=100)
BACKOFF_MAX: Final = timedelta(seconds=2)

# A store that cannot be reached, or answers in a way we cannot use. "No such object" is
# obstore's FileNotFoundError, handled before these.
_UNAVAILABLE: Final = (obstore.exceptions.BaseError, OSError)


def _no_bucket(exc: BaseException) -> bool:
    """Whether a "not found" is the bucket's (deleted, misnamed, not made yet): the store is
    unusable, not missing one object."""
    return isinstance(exc, FileNotFoundError) and "NoSuchBucket" in str(exc)


def _absent(outcome: object) -> bool:
    """Whether an outcome is a failure saying only that the object is not there."""
    return isinstance(outcome, FileNotFoundError) and not _no_bucket(outcome)


@contextmanager
def _store_errors(what: str, key: str, *, missing_ok: bool = True) -> Iterator[None]:
    """Any failure of the store as BlobStoreUnavailable (logged with its cause); "no such
    object" (FileNotFoundError) passes for the caller to judge where `missing_ok` (a read, a
    stat, a delete), but never "no such bucket"."""
    try:
        yield
    except FileNotFoundError as exc:
        if missing_ok and not _no_bucket(exc):
            raise
        first_line = str(exc).partition("\n")[0]
        logger.warning("s3 %s of %s failed: %s", what, key, first_line)
        reason = "NoSuchBucket" if _no_bucket(exc) else type(exc).__name__
        raise BlobStoreUnavailable(reason=f"{what}: {reason}") from exc
    except _UNAVAILABLE as exc:
        first_line = str(exc).partition("\n")[0]
        logger.warning("s3 %s of %s failed: %s", what, key, first_line)
        raise BlobStoreUnavailable(reason=f"{what}: {type(exc).__name__}") from exc


@functools.cache
def _store(
    bucket: str,
    endpoint_url: str | None,
    connect_timeout: float,
    read_timeout: float,
    max_attempts: int,
    credentials: tuple[str | None, ...],
) -> S3Store:
    """One store per configuration (and per credentials in the environment), shared by the
    threads of a process. Credentials and region come from the standard AWS_* variables, or
    else an instance, task or web-identity role, as obstore reads them."""
    config: S3Config = {}
    if endpoint_url:
        config["endpoint"] = endpoint_url  # path-style addressing: what other stores serve
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        config["region"] = region
    return S3Store(
        bucket,
        config=config,
        client_options={
            "allow_http": bool(endpoint_url and endpoint_url.startswith("http://")),
            "connect_timeout": timedelta(seconds=connect_timeout),
            "timeout": timedelta(seconds=read_timeout),
        },
        retry_config={
            "max_retries": max(0, max_attempts - 1),
            "retry_timeout": timedelta(seconds=max_attempts * (connect_timeout + read_timeout)),
            "backoff": {"init_backoff": BACKOFF_FIRST, "max_backoff": BACKOFF_MAX, "base": 2},
        },
    )


def s3_store() -> S3Store:
    """The obstore S3 store of the current settings."""
    credentials = tuple(
        os.environ.get(name)
        for name in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
        )
    )
    return _store(
        str(settings.PAPERCLIP_CAS_S3_BUCKET or ""),
        settings.PAPERCLIP_CAS_S3_ENDPOINT_URL or None,
        float(settings.PAPERCLIP_CAS_S3_CONNECT_TIMEOUT),
        float(settings.PAPERCLIP_CAS_S3_READ_TIMEOUT),
        int(settings.PAPERCLIP_CAS_S3_MAX_ATTEMPTS),
        credentials,
    )


def _run_all[T](calls: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T | BaseException]:
    """Each call's result (or the exception it raised), at most `limit` in flight, in the
    order given; from synchronous code (an event loop of its own, in a helper thread when
    this thread already runs one)."""

    async def gather() -> list[T | BaseException]:
        gate = asyncio.Semaphore(limit)

        async def one(call: Callable[[], Awaitable[T]]) -> T:
            async with gate:
                return await call()

        return await asyncio.gather(*(one(call) for call in calls), return_exceptions=True)

    return _run(gather)


def _run[T](make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(1, thread_name_prefix="s3-loop") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


class _RegionFile(io.RawIOBase):
    """`size` bytes of a spooled blob from `start` (relative to the region) as a file: what a
    multipart upload reads its parts from."""

    def __init__(self, source: Region, start: int, size: int) -> None:
        super().__init__()
        self.file, self.start, self.size = source.file, source.offset + start, size
        self.fd = source.fd  # a real file: read with pread (no shared position)
        self.at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.at, io.SEEK_END: self.size}[whence]
        self.at = max(0, min(self.size, base + offset))
        return self.at

    def read(self, size: int | None = -1) -> bytes:
        want = self.size - self.at if size is None or size < 0 else min(size, self.size - self.at)
        if want <= 0:
            return b""
        if self.fd is not None:
            data = os.pread(self.fd, want, self.start + self.at)
        else:
            self.file.seek(self.start + self.at)
            data = self.file.read(want)
        self.at += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def whole(self) -> bytes:
        self.at = 0
        return self.read()


class S3Backend:
    """`BlobBackend` over a bucket (module docstring)."""

    cheap_stat = False

    def __init__(self) -> None:
        self.bucket = str(settings.PAPERCLIP_CAS_S3_BUCKET or "")
        if not self.bucket:
            raise ImproperlyConfigured("PAPERCLIP_CAS_BACKEND=s3 needs PAPERCLIP_CAS_S3_BUCKET")
        self.prefix = str(settings.PAPERCLIP_CAS_S3_PREFIX)
        self.store = s3_store()

    def key(self, company_id: UUID | str, digest: str) -> str:
        hexdigest = digest.removeprefix("sha256:")
        return f"{self.prefix}{company_id}/{hexdigest[:2]}/{hexdigest}"

    def put(self, *, blob_id: int, company_id: UUID, digest: str, source: Region) -> None:
        key = self.key(company_id, digest)
        size = source.left
        body = _RegionFile(source, 0, size)
        with _store_errors("upload", key, missing_ok=False):
            if size <= MULTIPART_BYTES:
                obstore.put(self.store, key, body.whole(), use_multipart=False)
            else:
                # Parts are read from the spool as they go; a failed upload is aborted by
                # obstore, and an upload is never visible under its key until complete.
                obstore.put(
                    self.store,
                    key,
                    body,
                    use_multipart=True,
                    chunk_size=PART_BYTES,
                    max_concurrency=PART_CONCURRENCY,
                )
        source.offset += size
        source.left = 0

    def put_many(self, *, company_id: UUID, blobs: list[tuple[int, str, Region]]) -> None:
        """`put` of each blob, PUT_CONCURRENCY in flight (a batch of small blobs is bound by
        the store's round trips, not by bandwidth); the first failure is raised once every
        request has ended. A blob above MULTIPART_BYTES goes up on its own, after."""
        small = [item for item in blobs if item[2].left <= MULTIPART_BYTES]
        large = [item for item in blobs if item[2].left > MULTIPART_BYTES]
        store = self.store

        async def put(key: str, source: Region) -> None:
            # Read here, not before: at most PUT_CONCURRENCY blobs' bytes held at once.
            data = _RegionFile(source, 0, source.left).whole()
            await obstore.put_async(store, key, data, use_multipart=False)

        calls = [
            functools.partial(put, self.key(company_id, digest), source)
            for _, digest, source in small
        ]
        outcomes = _run_all(calls, PUT_CONCURRENCY) if calls else []
        for (_, digest, source), outcome in zip(small, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                with _store_errors("upload", self.key(company_id, digest), missing_ok=False):
                    raise outcome
            source.offset += source.left
            source.left = 0
        for blob_id, digest, source in large:
            self.put(blob_id=blob_id, company_id=company_id, digest=digest, source=source)

    def stat(self, *, company_id: UUID, digest: str, size: int) -> bool:
        key = self.key(company_id, digest)
        with _store_errors("stat", key):
            try:
                meta = obstore.head(self.store, key)
            except FileNotFoundError as exc:
                if _no_bucket(exc):
                    raise
                return False
        return int(meta["size"]) == size

    def delete(self, *, company_id: UUID, digest: str) -> None:
        key = self.key(company_id, digest)
        with _store_errors("delete", key):
            try:
                obstore.delete(self.store, key)
            except FileNotFoundError as exc:
                if _no_bucket(exc):
                    raise
                # No such object: already what a delete wants.

    def delete_many(self, *, company_id: UUID, digests: list[str]) -> None:
        """Remove the objects of `digests` (S3's DeleteObjects, 1,000 keys a request);
        BlobStoreUnavailable when one cannot be removed."""
        keys = [self.key(company_id, digest) for digest in digests]
        if len(keys) == 1:
            self.delete(company_id=company_id, digest=digests[0])
            return
        try:
            obstore.delete(self.store, keys)
        except FileNotFoundError as exc:
            if _no_bucket(exc):
                with _store_errors("batch delete", f"{keys[0]} and {len(keys) - 1} more"):
                    raise
        except _UNAVAILABLE as exc:
            if not _batch_delete_refused(exc):
                # A store that cannot be reached: one request per key would only repeat the
                # timeouts, each, while the collection holds its rows locked.
                with _store_errors("batch delete", f"{keys[0]} and {len(keys) - 1} more"):
                    raise
            # A store without the batch delete (GCS's XML API answers it 501): each key on
            # its own, whose failures are the store's.
            logger.info("s3 batch delete refused (%s); deleting one by one", type(exc).__name__)
            self._delete_each(keys)

    def _delete_each(self, keys: list[str]) -> None:
        calls = [functools.partial(obstore.delete_async, self.store, key) for key in keys]
        for key, outcome in zip(keys, _run_all(calls, DELETE_CONCURRENCY), strict=True):
            if isinstance(outcome, BaseException) and not _absent(outcome):
                with _store_errors("delete", key):
                    raise outcome

    def get(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        key = self.key(company_id, digest)
        with _store_errors("read", key):
            answer = obstore.get(self.store, key)  # FileNotFoundError: no such object
        if _announced(answer, size, key) > size:
            # Enough to show it is longer than the blob (the caller's verification names
            # it), never the whole of an object grown behind the plane's back.
            return _head_of(answer, size + 1, key)
        if size <= WHOLE_READ_BYTES:
            with _store_errors("read", key):
                data = answer.bytes().to_bytes()
            return _slices(data)
        return _pieces_of(_copied(answer, key))

    def get_many(
        self, *, company_id: UUID, rows: Mapping[str, tuple[int, int]]
    ) -> dict[str, bytes]:
        """Small blobs whole (a tree walk's level of directories, a read-ahead's window):
        READ_CONCURRENCY requests in flight; a missing object is left out (the caller checks
        the rest against their names); a store that cannot be reached raises
        BlobStoreUnavailable."""
        digests = list(rows)
        if not digests:
            return {}
        store = self.store

        async def read(key: str, size: int) -> bytes | None:
            answer = await obstore.get_async(store, key)
            if _announced(answer, size, key) != size:
                return None  # left out, unread: the ordinary read names it
            return (await answer.bytes_async()).to_bytes()

        keys = [self.key(company_id, digest) for digest in digests]
        calls = [
            functools.partial(read, key, rows[digest][1])
            for digest, key in zip(digests, keys, strict=True)
        ]
        found: dict[str, bytes] = {}
        for digest, key, outcome in zip(
            digests, keys, _run_all(calls, READ_CONCURRENCY), strict=True
        ):
            if outcome is None or _absent(outcome):
                continue
            if isinstance(outcome, BaseException):
                with _store_errors("read", key):
                    raise outcome
            found[digest] = outcome
        return found

    def presigned_url(self, *, company_id: UUID, digest: str, size: int) -> str | None:
        """A URL that GETs the object without credentials for
        PAPERCLIP_CAS_S3_REDIRECT_SECONDS (signed locally: no request to the store)."""
        key = self.key(company_id, digest)
        seconds = int(settings.PAPERCLIP_CAS_S3_REDIRECT_SECONDS)
        with _store_errors("sign", key):
            return obstore.sign(self.store, "GET", key, timedelta(seconds=seconds))


def _batch_delete_refused(exc: BaseException) -> bool:
    """Whether the store answered that it has no batch delete (S3's DeleteObjects), as
    GCS's XML API does (501 Not Implemented; 405 from some gateways), rather than failing."""
    if isinstance(exc, obstore.exceptions.NotSupportedError):
        return True
    text = str(exc)
    return any(
        mark in text
        for mark in ("NotImplemented", "501 Not Implemented", "MethodNotAllowed", "405 Method")
    )


def _announced(answer: Any, size: int, key: str) -> int:
    """The object's size as its answer announces it (logged when it is not the blob's `size`:
    such an object is not the blob, and one grown behind the plane's back must not be read
    whole into a web process's memory or disk)."""
    found = int(answer.meta["size"])
    if found != size:
        logger.error("s3 object %s holds %d bytes where its blob has %d", key, found, size)
    return found


def _head_of(answer: Any, limit: int, key: str) -> Iterator[bytes]:
    """The first `limit` bytes of the object's answer; the rest is never read."""
    with _store_errors("read", key):
        for piece in answer.stream(min_chunk_size=READ_BYTES):
            data = bytes(memoryview(piece)[:limit])
            limit -= len(data)
            yield data
            if limit <= 0:
                return


def _slices(data: bytes) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), READ_BYTES):
        yield bytes(view[start : start + READ_BYTES])


def _copied(answer: Any, key: str) -> IO[bytes]:
    """A large object's bytes copied whole into a temporary file, at the store's pace (a
    request's timeout covers its whole answer, so a slow consumer must not hold it open), before
    the caller answers anything: a copy that fails part way is BlobStoreUnavailable while a
    503 can still be answered, not a stream cut after a 200."""
    spool = tempfile.TemporaryFile(prefix="paperclip-s3-")  # noqa: SIM115 - handed on
    try:
        with _store_errors("read", key):
            for piece in answer.stream(min_chunk_size=READ_BYTES):
                spool.write(memoryview(piece))
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return spool


def _pieces_of(spool: IO[bytes]) -> Iterator[bytes]:
    """The file's bytes in pieces of READ_BYTES; closed (and so removed) at the end."""
    with spool:
        while data := spool.read(READ_BYTES):
            yield data
