"""The s3 backend: blob bytes as objects of an S3-compatible bucket (AWS S3, GCS's
interoperability API, MinIO, Ceph, Garage, `rclone serve s3`), the index in PostgreSQL as
with the other backends (docs/snapshots.md#object-storage).

Object key `<PAPERCLIP_CAS_S3_PREFIX><company_id>/<hex[:2]>/<hex>`. Uploads stream from the
request's spool (a multipart upload above MULTIPART_BYTES, in parts of PART_BYTES, each
streamed from the spool file: no part is held in memory); reads stream the object in pieces.
Transient errors are retried by botocore ("standard" mode: exponential back-off with jitter,
PAPERCLIP_CAS_S3_MAX_ATTEMPTS attempts) within the connect and read timeouts; what still
fails, and every other answer than "no such object", is `BlobStoreUnavailable` (503 with
Retry-After). Verifying what a read returns against the blob's name is not this module's: the
store's reads do it for every backend (`paperclip.snapshots.store.reads`).
"""

from __future__ import annotations

import functools
import io
import logging
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager, suppress
from typing import Any, Final
from uuid import UUID

import boto3
import botocore.exceptions
from botocore.config import Config
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from paperclip.snapshots.store.names import READ_BYTES, BlobStoreUnavailable
from paperclip.snapshots.store.spool import Region

logger = logging.getLogger(__name__)

READ_THREADS: Final = 8  # small blobs read at once (a tree walk's directories)
MULTIPART_BYTES: Final = 16 * 1024 * 1024  # a larger blob goes up in parts
PART_BYTES: Final = 8 * 1024 * 1024
PUT_THREADS: Final = 8  # a batch's PUTs in flight at once
DELETE_BATCH: Final = 1000  # DeleteObjects takes at most 1,000 keys

_MISSING_CODES: Final = frozenset({"404", "NoSuchKey", "NotFound"})

# The errors of a store that cannot be reached or answered in a way we cannot use; all become
# BlobStoreUnavailable (botocore has already retried the transient ones).
_UNAVAILABLE: Final = (
    botocore.exceptions.BotoCoreError,  # connection, timeouts, a cut response stream
    botocore.exceptions.ClientError,  # an error answer (not "no such object": handled first)
    ConnectionError,
    TimeoutError,
)


def _missing(exc: BaseException) -> bool:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(error.get("Code")) in _MISSING_CODES or status == 404


def _not_implemented(exc: botocore.exceptions.ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code"))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("NotImplemented", "MethodNotAllowed") or status in (501, 405)


@contextmanager
def _store_errors(what: str, key: str) -> Iterator[None]:
    """Any failure of the store as BlobStoreUnavailable (logged with its cause)."""
    try:
        yield
    except FileNotFoundError:
        raise  # "no such object", raised by the caller: not the store's failure
    except _UNAVAILABLE as exc:
        logger.warning("s3 %s of %s failed: %s", what, key, exc)
        raise BlobStoreUnavailable(reason=f"{what}: {type(exc).__name__}") from exc
    except Exception as exc:  # urllib3's errors under a streamed body, and the like
        if isinstance(exc, BlobStoreUnavailable) or not _is_transport_error(exc):
            raise
        logger.warning("s3 %s of %s failed: %s", what, key, exc)
        raise BlobStoreUnavailable(reason=f"{what}: {type(exc).__name__}") from exc


def _is_transport_error(exc: BaseException) -> bool:
    import urllib3.exceptions

    return isinstance(exc, urllib3.exceptions.HTTPError | OSError)


@functools.cache
def _client(
    endpoint_url: str | None,
    connect_timeout: float,
    read_timeout: float,
    max_attempts: int,
    credentials: tuple[str | None, ...],
) -> Any:
    """One client per configuration (and per credentials in the environment), shared by the
    threads of a process (boto3's clients are thread-safe; its sessions are not)."""
    config = Config(
        signature_version="s3v4",
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries={"mode": "standard", "max_attempts": max_attempts},
        max_pool_connections=32,
        # Since botocore 1.36 every upload carries a CRC32 checksum in an aws-chunked body
        # by default, which several S3-compatible stores refuse; only when an API needs it.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path" if endpoint_url else "auto"},
    )
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=endpoint_url, config=config)


def s3_client() -> Any:
    """The boto3 S3 client of the current settings."""
    credentials = tuple(
        os.environ.get(name)
        for name in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
            "AWS_PROFILE",
        )
    )
    return _client(
        settings.PAPERCLIP_CAS_S3_ENDPOINT_URL or None,
        float(settings.PAPERCLIP_CAS_S3_CONNECT_TIMEOUT),
        float(settings.PAPERCLIP_CAS_S3_READ_TIMEOUT),
        int(settings.PAPERCLIP_CAS_S3_MAX_ATTEMPTS),
        credentials,
    )


class _RegionFile(io.RawIOBase):
    """`size` bytes of a spooled blob from `start` (relative to the region) as a seekable
    file: what botocore streams a body from, and seeks back in to retry a request."""

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


class S3Backend:
    """`BlobBackend` over a bucket (module docstring)."""

    cheap_stat = False

    def __init__(self) -> None:
        self.bucket = str(settings.PAPERCLIP_CAS_S3_BUCKET or "")
        if not self.bucket:
            raise ImproperlyConfigured("PAPERCLIP_CAS_BACKEND=s3 needs PAPERCLIP_CAS_S3_BUCKET")
        self.prefix = str(settings.PAPERCLIP_CAS_S3_PREFIX)
        self.client = s3_client()

    def key(self, company_id: UUID | str, digest: str) -> str:
        hexdigest = digest.removeprefix("sha256:")
        return f"{self.prefix}{company_id}/{hexdigest[:2]}/{hexdigest}"

    def put(self, *, blob_id: int, company_id: UUID, digest: str, source: Region) -> None:
        key = self.key(company_id, digest)
        size = source.left
        with _store_errors("upload", key):
            if size <= MULTIPART_BYTES:
                self.client.put_object(
                    Bucket=self.bucket, Key=key, Body=_RegionFile(source, 0, size)
                )
            else:
                self._put_parts(key, source, size)
        source.offset += size
        source.left = 0

    def put_many(self, *, company_id: UUID, blobs: list[tuple[int, str, Region]]) -> None:
        """`put` of each blob, PUT_THREADS at a time (a batch of small blobs is bound by the
        store's round trips, not by bandwidth); the first failure is raised once every
        request has ended. The regions must be of a real file (`Region.fd`: read with
        `pread`, so the threads never share a file position)."""
        if any(source.fd is None for _, _, source in blobs):
            for blob_id, digest, source in blobs:
                self.put(blob_id=blob_id, company_id=company_id, digest=digest, source=source)
            return
        with ThreadPoolExecutor(PUT_THREADS, thread_name_prefix="s3-put") as pool:
            futures = [
                pool.submit(
                    self.put, blob_id=blob_id, company_id=company_id, digest=digest, source=source
                )
                for blob_id, digest, source in blobs
            ]
            wait(futures)
        for future in futures:
            future.result()

    def _put_parts(self, key: str, source: Region, size: int) -> None:
        """A multipart upload, part after part, each streamed from the spool (never a part
        in memory: boto3's transfer manager would read each into a buffer); aborted when a
        part fails, so no half-written object is ever visible under the key."""
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, size, PART_BYTES), start=1):
                length = min(PART_BYTES, size - start)
                answer = self.client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload,
                    PartNumber=number,
                    Body=_RegionFile(source, start, length),
                )
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with suppress(*_UNAVAILABLE):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise

    def stat(self, *, company_id: UUID, digest: str, size: int) -> bool:
        key = self.key(company_id, digest)
        with _store_errors("stat", key):
            try:
                answer = self.client.head_object(Bucket=self.bucket, Key=key)
            except botocore.exceptions.ClientError as exc:
                if _missing(exc):
                    return False
                raise
        return int(answer.get("ContentLength", -1)) == size

    def delete(self, *, company_id: UUID, digest: str) -> None:
        key = self.key(company_id, digest)
        with _store_errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=key)  # no such object: fine

    def delete_many(self, *, company_id: UUID, digests: list[str]) -> None:
        """Remove the objects of `digests` (DeleteObjects, DELETE_BATCH keys a request);
        BlobStoreUnavailable when one cannot be removed."""
        keys = [self.key(company_id, digest) for digest in digests]
        if len(keys) == 1:
            self.delete(company_id=company_id, digest=digests[0])
            return
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            with _store_errors("delete", batch[0]):
                try:
                    answer = self.client.delete_objects(
                        Bucket=self.bucket,
                        Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True},
                    )
                except botocore.exceptions.ClientError as exc:
                    if not _not_implemented(exc):
                        raise
                    # A store without the batch delete (GCS's XML API): one key at a time.
                    for key in batch:
                        self.client.delete_object(Bucket=self.bucket, Key=key)
                    continue
            errors = [e for e in answer.get("Errors", []) if e.get("Code") not in _MISSING_CODES]
            if errors:
                logger.warning("s3 delete of %d objects failed: %s", len(errors), errors[:3])
                raise BlobStoreUnavailable(reason=f"delete: {errors[0].get('Code')}")

    def get(self, *, blob_id: int, company_id: UUID, digest: str, size: int) -> Iterator[bytes]:
        key = self.key(company_id, digest)
        with _store_errors("read", key):
            try:
                answer = self.client.get_object(Bucket=self.bucket, Key=key)
            except botocore.exceptions.ClientError as exc:
                if _missing(exc):
                    raise FileNotFoundError(key) from exc
                raise
        return _object_chunks(answer["Body"], key)

    def get_many(
        self, *, company_id: UUID, rows: Mapping[str, tuple[int, int]]
    ) -> dict[str, bytes]:
        """Small blobs whole (a tree walk's level of directories): a round trip each, so
        READ_THREADS in flight; a missing object is left out (the caller checks the rest
        against their names); a store that cannot be reached raises BlobStoreUnavailable."""

        def read(item: tuple[str, tuple[int, int]]) -> tuple[str, bytes | None]:
            digest, (blob_id, size) = item
            try:
                chunks = self.get(blob_id=blob_id, company_id=company_id, digest=digest, size=size)
                return digest, b"".join(chunks)
            except FileNotFoundError:
                return digest, None

        if len(rows) < 2:
            loaded = list(map(read, rows.items()))
        else:
            with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="cas-read") as pool:
                loaded = list(pool.map(read, rows.items()))
        return {digest: data for digest, data in loaded if data is not None}

    def presigned_url(self, *, company_id: UUID, digest: str, size: int) -> str | None:
        """A URL that GETs the object without credentials for
        PAPERCLIP_CAS_S3_REDIRECT_SECONDS (signed locally: no request to the store)."""
        key = self.key(company_id, digest)
        with _store_errors("sign", key):
            url: str = self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": key},
                ExpiresIn=int(settings.PAPERCLIP_CAS_S3_REDIRECT_SECONDS),
            )
        return url


def _object_chunks(body: Any, key: str) -> Iterator[bytes]:
    """The object's bytes in pieces of READ_BYTES; a read that fails part way is
    BlobStoreUnavailable (the consumer's stream is then cut short)."""
    try:
        while True:
            with _store_errors("read", key):
                data = body.read(READ_BYTES)
            if not data:
                return
            yield data
    finally:
        body.close()
