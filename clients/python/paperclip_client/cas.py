"""The content-addressed store's calls of `Client` (limits, find-missing, blob upload by
stream or in batches, checked download) and the workspace snapshot's (register, head).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, NamedTuple, cast

from paperclip_client._httpx import httpx
from paperclip_client._lazy import LazyModule
from paperclip_client.errors import BlobCorrupt
from paperclip_client.transport import Transport, operation

if TYPE_CHECKING:
    from paperclip_client import models
else:  # imported at the first answer read, not at the CLI's start (_lazy.py says why)
    models = LazyModule("paperclip_client.models")

FIND_MISSING_MAX = 10_000
# Requests to the store at once while uploading or fetching (`--transfers`).
TRANSFER_THREADS = 4
PIECE_BYTES = 1024 * 1024
# What one batch read may ask for (the server's limits: docs/snapshots.md#batch-read).
BATCH_READ_MAX = 1_000
BATCH_READ_MAX_BYTES = 8 * 1024 * 1024


class StoreCalls(Transport):
    """The store's and the snapshots' operations (a part of `Client`)."""

    @operation("cas_limits")
    def cas_config(self) -> models.CasConfig:
        """The store's limits: what a client needs to plan uploads."""
        data = self._get("/api/cas")
        return models.build(models.CasConfig, data)

    @operation("cas_find_missing")
    def cas_find_missing(
        self, digests: Sequence[str], *, batch: int = FIND_MISSING_MAX
    ) -> list[str]:
        """The names among `digests` the store lacks (for this company), in order; asked in
        requests of at most `batch` names."""
        missing: list[str] = []
        for start in range(0, len(digests), batch):
            data = self.request(
                "POST",
                "/api/cas/find-missing",
                json={"digests": list(digests[start : start + batch])},
                idempotent=True,
            )
            missing.extend(str(d) for d in data["missing"])
        return missing

    @operation("cas_blob_put")
    def cas_put(
        self, name: str, content: IO[bytes] | Iterator[bytes] | bytes, size: int
    ) -> models.CasPut:
        """Store one blob, streamed: `content` is a binary file (read from its current
        position, `size` bytes, in pieces; re-read from there on a retry), an iterator of
        chunks (not repeated once started) or bytes. Repeatable: a blob is named by its
        content. `BlobDigestMismatch` when the bytes are not `name`'s; `BlobTooLarge`."""
        body: Callable[[], bytes | Iterator[bytes]]
        if isinstance(content, bytes):
            data = content
            body = lambda: data  # noqa: E731
        elif hasattr(content, "seek") and hasattr(content, "read"):
            stream = cast(IO[bytes], content)
            start = stream.tell()

            def body() -> Iterator[bytes]:
                stream.seek(start)
                return _read_pieces(stream, size)
        else:
            pieces = content
            used: list[bool] = []

            def body() -> Iterator[bytes]:
                if used:
                    raise httpx.ConnectError("an iterator body cannot be sent twice")
                used.append(True)
                return pieces

        data_ = self.request(
            "PUT",
            f"/api/cas/blobs/{name}",
            content=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            idempotent=True,
        )
        return models.build(models.CasPut, data_)

    @operation("cas_batch_upload")
    def cas_put_batch(self, frames: Sequence[tuple[str, bytes] | BatchFrame]) -> models.CasBatch:
        """Store many small blobs in one request, all or nothing: the body is, for each blob,
        the ASCII line `<name> <size>\n` then exactly `size` bytes. Keep it under the store's
        `max_batch_bytes` and `max_batch_blobs` (`cas_config()`). A frame is `(name, bytes)`
        or a `BatchFrame` whose bytes are read while the body is sent: the body is streamed
        with its `Content-Length`, never joined in memory (read again on a retry)."""
        parts = [
            f if isinstance(f, BatchFrame) else BatchFrame(f[0], len(f[1]), _constant(f[1]))
            for f in frames
        ]
        heads = [f"{f.name} {f.size}\n".encode("ascii") for f in parts]
        length = sum(len(h) for h in heads) + sum(f.size for f in parts)

        def body() -> Iterator[bytes]:
            # Small blobs' frames are gathered into pieces of about PIECE_BYTES: one socket
            # write per frame part cost more than the bytes (tens of thousands of sends for a
            # first snapshot). Memory stays bounded by one piece.
            pending: list[bytes] = []
            held = 0
            for head, frame in zip(heads, parts, strict=True):
                pending.append(head)
                held += len(head)
                for piece in frame.read():
                    pending.append(piece)
                    held += len(piece)
                    if held >= PIECE_BYTES:
                        yield b"".join(pending)
                        pending, held = [], 0
            if pending:
                yield b"".join(pending)

        data_ = self.request(
            "POST",
            "/api/cas/batch",
            content=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(length)},
            idempotent=True,
        )
        return models.build(models.CasBatch, data_)

    @operation("cas_blob_get")
    def cas_get(self, name: str, dest: IO[bytes]) -> int:
        """Stream the blob `name` into the binary file `dest` (from its current position,
        which a retry goes back to, truncating what follows) and check its digest; the number
        of bytes written. `NotFound` for a name the store lacks; `BlobCorrupt` when the bytes
        received are not `name`'s."""
        start = dest.tell()

        def receive(response: httpx.Response) -> int:
            dest.seek(start)
            dest.truncate()
            digest = hashlib.sha256()
            written = 0
            for piece in response.iter_bytes(PIECE_BYTES):
                digest.update(piece)
                dest.write(piece)
                written += len(piece)
            if "sha256:" + digest.hexdigest() != name:
                raise BlobCorrupt(name, written)
            return written

        return int(self.request("GET", f"/api/cas/blobs/{name}", idempotent=True, receive=receive))

    @operation("cas_batch_read")
    def cas_get_batch(self, names: Sequence[str]) -> dict[str, bytes]:
        """Many small blobs in one request (at most BATCH_READ_MAX names, their sizes adding
        up to at most BATCH_READ_MAX_BYTES), each checked against its name: the answer is, for
        each name once in order, the line `<name> <size>\n` then exactly `size` bytes.
        `NotFound` (its `details["digests"]`) when the store lacks any of them; `BlobCorrupt`
        when a frame's bytes are not its name's or the answer is not the frames asked for."""
        wanted = list(dict.fromkeys(names))

        def receive(response: httpx.Response) -> dict[str, bytes]:
            return _read_frames(response.read(), wanted)

        result: dict[str, bytes] = self.request(
            "POST",
            "/api/cas/batch-read",
            json={"digests": wanted},
            idempotent=True,
            receive=receive,
        )
        return result

    def cas_get_bytes(self, name: str) -> bytes:
        """A small blob (a directory) in memory, checked."""
        buffer = io.BytesIO()
        self.cas_get(name, buffer)
        return buffer.getvalue()

    @operation("run_snapshot_register")
    def snapshot_register(
        self,
        run_id: str,
        *,
        tree: str,
        base: str | None,
        generation: int,
        fence: int | None = None,
    ) -> models.Snapshot:
        """Register the tree `tree` (every blob it reaches already stored) as the run's
        snapshot, started from the workspace head `base`; fenced by the runtime lease's
        `generation` (`WorkspaceRuntimeLeaseSuperseded`). `SnapshotBlobsMissing` (with
        `details["missing"]`), `SnapshotTreeInvalid` (`details["path"]`, `["reason"]`).
        Repeatable: the same registration again is answered 200."""
        body: dict[str, Any] = {"tree": tree, "base": base, "generation": generation}
        if fence is not None:
            body["fence"] = fence
        data = self.request(
            "POST", f"/api/heartbeat-runs/{run_id}/snapshots", json=body, idempotent=True
        )
        return models.build(models.Snapshot, data)

    @operation("execution_workspace_head")
    def workspace_head(self, workspace_id: str) -> models.WorkspaceHead:
        """The workspace's published tree (`tree` None: empty), the run that published it."""
        data = self._get(f"/api/execution-workspaces/{workspace_id}/head")
        return models.build(models.WorkspaceHead, data)

    @operation("execution_workspace_history")
    def workspace_history(
        self, workspace_id: str, *, limit: int = 50, before: int | None = None
    ) -> dict[str, Any]:
        """A page of the moves of the workspace's head, newest first: `{"results", "next"}`
        (`next`: the `before` of the following page, None at the end)."""
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        data: dict[str, Any] = self._get(
            f"/api/execution-workspaces/{workspace_id}/history", params
        )
        return data

    @operation("execution_workspace_diff")
    def workspace_diff(
        self, workspace_id: str, from_tree: str | None, to_tree: str, *, limit: int = 1000
    ) -> dict[str, Any]:
        """The changes from `from_tree` (None: empty) to `to_tree`, path by path:
        `{"from", "to", "changes", "truncated"}`."""
        params = {"from": from_tree or "empty", "to": to_tree, "limit": limit}
        data: dict[str, Any] = self._get(f"/api/execution-workspaces/{workspace_id}/diff", params)
        return data


class BatchFrame(NamedTuple):
    """One blob of a batch upload: its name, its size and `read()`, which gives its bytes
    from the start each time it is called (exactly `size` of them, in pieces)."""

    name: str
    size: int
    read: Callable[[], Iterable[bytes]]


def _read_frames(body: bytes, wanted: Sequence[str]) -> dict[str, bytes]:
    """A batch read's answer taken apart and checked: exactly the frames of `wanted`, in
    order, each hashing to its name."""
    found: dict[str, bytes] = {}
    at = 0
    for name in wanted:
        end = body.find(b"\n", at, at + 128)
        head = body[at:end].decode("ascii", "replace").split(" ") if end >= 0 else []
        if len(head) != 2 or head[0] != name or not head[1].isdigit():
            raise BlobCorrupt(name, 0)
        size = int(head[1])
        data = body[end + 1 : end + 1 + size]
        if len(data) != size or "sha256:" + hashlib.sha256(data).hexdigest() != name:
            raise BlobCorrupt(name, len(data))
        found[name] = data
        at = end + 1 + size
    if at != len(body):
        raise BlobCorrupt(wanted[-1] if wanted else "", len(body) - at)
    return found


def _constant(data: bytes) -> Callable[[], Iterable[bytes]]:
    return lambda: (data,)


def _read_pieces(stream: IO[bytes], size: int) -> Iterator[bytes]:
    left = size
    while left > 0:
        piece = stream.read(min(PIECE_BYTES, left))
        if not piece:
            break  # the file shrank: the server answers blob_digest_mismatch
        left -= len(piece)
        yield piece
