"""Streaming an upload in: hashed as it is read into a spooled temporary file, refused as soon
as it passes the size limit, before any transaction opens."""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from typing import IO, Protocol

from paperclip.errors import InvalidRequest
from paperclip.snapshots.store.names import (
    READ_BYTES,
    SPOOL_BYTES,
    BlobDigestMismatch,
    BlobTooLarge,
)


class Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


@dataclass(slots=True)
class Spooled:
    """A verified blob's bytes: `size` bytes of `file` from `offset` (a batch shares one file)."""

    digest: str
    size: int
    file: IO[bytes]
    offset: int = 0
    fd: int | None = None  # `file`'s descriptor when it is a real file (kernel-side copies)

    def reader(self) -> Region:
        return Region(self.file, self.offset, self.size, self.fd)


class Region:
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


def spool_upload(
    stream: Readable | None,
    *,
    digest: str,
    length: int | None,
    max_bytes: int,
    into: IO[bytes] | None = None,
) -> Spooled:
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
    return Spooled(digest=digest, size=size, file=spool, offset=offset)
