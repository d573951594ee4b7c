"""`POST /api/cas/batch`: many blobs in one framed body (`<name> <size>\n<bytes>`); one bad
frame keeps nothing."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from uuid import UUID

from django.conf import settings
from django.db import transaction

from paperclip.db.locking import busy_on_lock_timeout
from paperclip.errors import InvalidRequest
from paperclip.snapshots.store.names import (
    MAX_FRAME_HEADER,
    READ_BYTES,
    BatchTooLarge,
    BlobTooLarge,
    blob_name_problem,
    max_batch_blobs,
)
from paperclip.snapshots.store.spool import Readable, Spooled, spool_upload
from paperclip.snapshots.store.uploads import store_spooled


@dataclass(frozen=True, slots=True)
class CasBatch:
    stored: list[str]  # new to the company, in frame order
    existing: list[str]  # already there, in frame order


class _Body:
    """The batch body as a buffered reader that never reads past `length` bytes."""

    def __init__(self, stream: Readable | None, length: int) -> None:
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
    if settings.PAPERCLIP_CAS_BACKEND == "filesystem":
        directory = Path(settings.PAPERCLIP_CAS_DIR)
        directory.mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryFile(dir=directory)
    return tempfile.TemporaryFile()


def _bad_frame(message: str) -> InvalidRequest:
    return InvalidRequest(fields={"body": [message]})


def cas_put_batch(*, company_id: UUID, stream: Readable | None, length: int) -> CasBatch:
    """Store many blobs sent as frames (docs/snapshots.md#batch-upload): each an ASCII header
    line `<name> <size>\\n` followed by exactly `size` bytes, frame after frame to the end of
    the body (`length` bytes: the request's Content-Length). At most
    PAPERCLIP_CAS_MAX_BATCH_BYTES of body (413 `request_too_large`, before anything is read)
    and `max_batch_blobs()` frames; each blob is verified as `cas_put` does (one over
    PAPERCLIP_CAS_MAX_BLOB_BYTES: 413 `blob_too_large`; a mismatch: 400
    `blob_digest_mismatch` with `details.digest`; malformed framing: 400 `invalid_request`
    with `details.fields.body`). All or nothing: every frame is read and verified before one
    transaction stores them all. A name sent twice is stored once. No audit row."""
    max_batch = settings.PAPERCLIP_CAS_MAX_BATCH_BYTES
    if length > max_batch:
        raise BatchTooLarge(max_bytes=max_batch)
    max_blob = settings.PAPERCLIP_CAS_MAX_BLOB_BYTES
    most = max_batch_blobs()
    body = _Body(stream, length)
    spooled: list[Spooled] = []
    order: list[str] = []
    # All frames go to one temporary file on disk (never the batch in memory: a web process
    # serves several batches at once), next to the store so its bytes are copied into place
    # by the kernel.
    with _batch_file() as into:
        while (header := _frame_header(body)) is not None:
            name, size = header
            if len(order) >= most:
                raise _bad_frame(f"More than {most} frames.")
            if size > max_blob:
                raise BlobTooLarge(max_bytes=max_blob, digest=name)
            if size > body.remaining:
                raise _bad_frame(f"The body ends inside the frame of {name}.")
            try:
                spooled.append(
                    spool_upload(body, digest=name, length=size, max_bytes=max_blob, into=into)
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
                created = store_spooled(company_id, spooled)
    stored: list[str] = []
    existing: list[str] = []
    seen: set[str] = set()
    for name in order:
        if name not in seen:
            seen.add(name)
            (stored if created[name] else existing).append(name)
    return CasBatch(stored=stored, existing=existing)
