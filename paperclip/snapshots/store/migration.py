"""Copying every blob to another backend (`manage.py cas_migrate --to ...`,
docs/snapshots.md#moving-the-store-to-another-backend). Nothing here changes which backend the
service uses: the setting stays as it is, the operator switches it afterwards.

A pass walks the index (`cas_blobs`, every company) in id order up to the highest id at its
start, a batch of rows read outside any transaction at a time. For each blob it first asks the
target whether the bytes are already there (`stat`; for the postgres target the blob's pieces
are counted and measured, as that backend's own `stat` trusts the row): a blob an earlier,
interrupted pass copied, or one the target got from an upload, is skipped without reading
the source. That check is what makes a pass resumable: there is no progress table to keep in
step, and a second pass costs a `stat` per blob.

A missing blob is copied in its own short transaction, which

1. holds the row `FOR KEY SHARE` (waits bounded): the collector deletes rows `FOR UPDATE SKIP
   LOCKED`, so it skips a blob being copied and takes it at its next run (then removing the
   bytes of both built-in backends, the copy included); a row it deleted first is gone here
   and counted so, never re-created. Uploads upsert the row with `FOR NO KEY UPDATE`, which
   this lock does not block;
2. reads the source's bytes into a spooled temporary file (never a whole blob in memory),
   hashing them: bytes that are missing, longer or shorter than the row's size or that hash to
   another name are reported and not copied;
3. places them through the target backend's `put` and reads them back from the target,
   hashing them again; a copy that cannot be written or does not read back as its name
   stops the pass (`TargetFailed`), after removing what it placed (the postgres target's
   pieces go with the rollback).

Big files are several blobs (their chunks) in the index, each copied alone; a blob's postgres
pieces are read and written one at a time.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final
from uuid import UUID

from django.conf import settings
from django.db import connection, transaction

from paperclip.db.locking import busy_on_lock_timeout, set_local_lock_timeout
from paperclip.db.prepared import prepared_cursor
from paperclip.errors import ResourceBusy
from paperclip.snapshots.store.backends import (
    BlobBackend,
    FilesystemBackend,
    PostgresBackend,
)
from paperclip.snapshots.store.names import (
    CHUNK_BYTES,
    READ_BYTES,
    BlobDigestMismatch,
    BlobStoreUnavailable,
    BlobTooLarge,
)
from paperclip.snapshots.store.spool import Spooled, spool_upload

BACKENDS: Final = ("filesystem", "postgres", "s3")

# One pass at a time: two would copy the same blobs side by side (and, into postgres, collide
# on the same pieces). Session-scoped, on the command's main connection (the copying threads
# have their own), so it ends with the process however that ends; the service never runs
# behind a transaction pooler (setup.md).
MIGRATION_LOCK_KEY: Final = "cas-migrate"


def backend_named(name: str) -> BlobBackend:
    """The backend `PAPERCLIP_CAS_BACKEND=name` would use, with its settings (ValueError for
    an unknown name; ImproperlyConfigured for s3 without PAPERCLIP_CAS_S3_BUCKET)."""
    if name == "filesystem":
        return FilesystemBackend()
    if name == "postgres":
        return PostgresBackend()
    if name == "s3":
        from paperclip.snapshots.store.s3 import S3Backend  # obstore: imported when needed

        return S3Backend()
    raise ValueError(f"unknown blob backend {name!r}")


class Outcome(StrEnum):
    COPIED = "copied"
    PRESENT = "present"  # already in the target: not read
    GONE = "gone"  # the row was deleted (collected) before it could be copied
    UNREADABLE = "unreadable"  # the source's bytes are missing or are not the blob
    BUSY = "busy"  # the row stayed locked (a collection deleting it): the next pass retries


@dataclass(frozen=True, slots=True)
class Problem:
    """A blob a pass did not copy and cannot vouch for."""

    blob_id: int
    company_id: UUID
    digest: str
    outcome: Outcome
    reason: str


@dataclass(frozen=True, slots=True)
class MigrateTotals:
    """What a pass covers, read at its start: the rows up to `last_id`."""

    blobs: int
    bytes: int
    last_id: int


@dataclass(frozen=True, slots=True)
class MigrateProgress:
    """Where a pass stands after a batch (and, the last one, its summary)."""

    batch: int
    blobs: int  # rows examined, whatever their outcome
    bytes: int  # their sizes
    copied: int
    copied_bytes: int
    present: int
    gone: int
    problems: tuple[Problem, ...]


class TargetFailed(Exception):
    """A copy could not be written to the target or did not read back as its name; the pass
    stops there (the target is unwell: every other blob would fail alike)."""

    def __init__(self, *, company_id: UUID, digest: str, reason: str) -> None:
        super().__init__(f"company {company_id} blob {digest}: {reason}")
        self.company_id, self.digest, self.reason = company_id, digest, reason


class StoreUnavailable(Exception):
    """The source or the target store cannot be reached (s3); the pass stops there."""

    def __init__(self, *, side: str, reason: str) -> None:
        super().__init__(f"the {side} store cannot be reached ({reason})")
        self.side, self.reason = side, reason


class MigrationRunning(Exception):
    """Another `cas_migrate` holds the migration lock."""


@dataclass(frozen=True, slots=True)
class _Row:
    id: int
    company_id: UUID
    digest: str
    size: int


@dataclass(slots=True)
class _Tally:
    batch: int = 0
    blobs: int = 0
    bytes: int = 0
    copied: int = 0
    copied_bytes: int = 0
    present: int = 0
    gone: int = 0
    problems: list[Problem] = field(default_factory=list)

    def add(self, row: _Row, outcome: Outcome, reason: str) -> None:
        self.blobs += 1
        self.bytes += row.size
        if outcome is Outcome.COPIED:
            self.copied += 1
            self.copied_bytes += row.size
        elif outcome is Outcome.PRESENT:
            self.present += 1
        elif outcome is Outcome.GONE:
            self.gone += 1
        else:
            self.problems.append(Problem(row.id, row.company_id, row.digest, outcome, reason))

    def snapshot(self) -> MigrateProgress:
        return MigrateProgress(
            batch=self.batch,
            blobs=self.blobs,
            bytes=self.bytes,
            copied=self.copied,
            copied_bytes=self.copied_bytes,
            present=self.present,
            gone=self.gone,
            problems=tuple(self.problems),
        )


@contextmanager
def migration_lock() -> Iterator[None]:
    """Hold the migration's session advisory lock for the block; MigrationRunning when another
    process holds it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", [MIGRATION_LOCK_KEY])
        row = cursor.fetchone()
    if not (row and row[0]):
        raise MigrationRunning()
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_unlock(hashtextextended(%s, 0))", [MIGRATION_LOCK_KEY]
            )


def cas_migrate_totals() -> MigrateTotals:
    """The blobs a pass starting now covers (every company's): count, bytes, highest id."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), coalesce(sum(size), 0), coalesce(max(id), 0) FROM cas_blobs"
        )
        blobs, size, last_id = cursor.fetchone()
    return MigrateTotals(blobs=int(blobs), bytes=int(size), last_id=int(last_id))


def cas_migrate(
    *,
    target: str,
    totals: MigrateTotals,
    batch_size: int,
    max_batch_bytes: int,
    progress: Callable[[MigrateProgress], None] | None = None,
    dry_run: bool = False,
    jobs: int = 1,
) -> MigrateProgress:
    """Copy every blob up to `totals.last_id` that the backend named `target` lacks from the
    configured backend to it, verified (module docstring); returns the pass's tally, whose
    `problems` lists the blobs not copied. A batch holds at most `batch_size` rows and ends
    early once it holds `max_batch_bytes` to copy; its copies run on up to `jobs` threads;
    `progress` is called after each. Locks: each copied row `FOR KEY SHARE`, one row per
    transaction, waits bounded. Raises ValueError for
    an unknown or the configured `target`, TargetFailed or StoreUnavailable (the pass stops;
    re-run to go on).
    `dry_run` counts the blobs the target lacks as copied and copies nothing."""
    if target == settings.PAPERCLIP_CAS_BACKEND:
        raise ValueError(f"the store already uses the {target} backend")
    source, dest = backend_named(settings.PAPERCLIP_CAS_BACKEND), backend_named(target)
    tally = _Tally()
    after = 0
    while rows := _rows(after=after, last_id=totals.last_id, limit=batch_size):
        present = _present(dest, rows)
        todo: list[_Row] = []
        planned = 0
        for row in rows:
            after = row.id
            if row.id in present:
                tally.add(row, Outcome.PRESENT, "")
                continue
            todo.append(row)
            planned += row.size
            if planned >= max_batch_bytes:
                break
        if dry_run:
            for row in todo:
                tally.add(row, Outcome.COPIED, "")
        else:
            for row, (outcome, reason) in _copy_all(source, dest, todo, jobs):
                tally.add(row, outcome, reason)
        tally.batch += 1
        if progress is not None:
            progress(tally.snapshot())
    return tally.snapshot()


def _copy_all(
    source: BlobBackend, dest: BlobBackend, rows: list[_Row], jobs: int
) -> list[tuple[_Row, tuple[Outcome, str]]]:
    """`_copy_one` of each row, on up to `jobs` threads (each with its database connection of
    its own, closed when its share is done): a copy is a round trip or two to each store, so a
    remote one (s3) is latency-bound. The first failure stops the others before their next
    row (a copy in hand finishes or rolls back in its own transaction) and is raised."""
    if jobs <= 1 or len(rows) <= 1 or connection.in_atomic_block:
        # Inside a caller's transaction (a test's) the rows may be its own, uncommitted:
        # invisible to other connections, so copied on this one.
        return [(row, _copy_one(source, dest, row)) for row in rows]
    stop = threading.Event()

    def share(part: list[_Row]) -> list[tuple[_Row, tuple[Outcome, str]]]:
        done = []
        try:
            for row in part:
                if stop.is_set():
                    break
                done.append((row, _copy_one(source, dest, row)))
        except BaseException:
            stop.set()
            raise
        finally:
            connection.close()  # this thread's own
        return done

    parts = [rows[i::jobs] for i in range(min(jobs, len(rows)))]
    with ThreadPoolExecutor(len(parts), thread_name_prefix="cas-migrate") as pool:
        futures = [pool.submit(share, part) for part in parts]
        try:
            return [pair for future in futures for pair in future.result()]
        except BaseException:  # a failed copy, or Ctrl-C in this thread: the others stop
            stop.set()
            raise


def _rows(*, after: int, last_id: int, limit: int) -> list[_Row]:
    with prepared_cursor() as cursor:
        cursor.execute(
            "SELECT id, company_id, digest, size FROM cas_blobs "
            "WHERE id > %s AND id <= %s ORDER BY id LIMIT %s",
            [after, last_id, limit],
        )
        return [_Row(int(i), c, d, int(s)) for i, c, d, s in cursor.fetchall()]


def _present(dest: BlobBackend, rows: list[_Row]) -> set[int]:
    """The ids among `rows` whose bytes the target holds whole."""
    if isinstance(dest, PostgresBackend):
        # Its `stat` answers from the row alone (pieces commit with it); here the row exists
        # without them, so the pieces themselves are counted (octet_length reads no data).
        with prepared_cursor() as cursor:
            cursor.execute(
                """
                SELECT b.id FROM cas_blobs b
                CROSS JOIN LATERAL (
                    SELECT count(*) AS pieces, coalesce(sum(octet_length(c.data)), 0) AS bytes
                    FROM cas_blob_chunks c WHERE c.blob_id = b.id
                ) p
                WHERE b.id = ANY(%s::bigint[])
                  AND p.bytes = b.size AND p.pieces = (b.size + %s - 1) / %s
                """,
                [[r.id for r in rows], CHUNK_BYTES, CHUNK_BYTES],
            )
            return {int(r[0]) for r in cursor.fetchall()}
    try:
        return {
            r.id for r in rows if dest.stat(company_id=r.company_id, digest=r.digest, size=r.size)
        }
    except BlobStoreUnavailable as exc:
        raise StoreUnavailable(side="target", reason=str(exc.details.get("reason"))) from exc


def _copy_one(source: BlobBackend, dest: BlobBackend, row: _Row) -> tuple[Outcome, str]:
    """Copy one blob in its own transaction (module docstring); (outcome, reason)."""
    try:
        with busy_on_lock_timeout(), transaction.atomic(durable=True):
            set_local_lock_timeout()
            with prepared_cursor() as cursor:
                cursor.execute("SELECT 1 FROM cas_blobs WHERE id = %s FOR KEY SHARE", [row.id])
                if cursor.fetchone() is None:
                    return Outcome.GONE, ""
            spooled, problem = _read_source(source, row)
            if spooled is None:
                return Outcome.UNREADABLE, problem
            try:
                _place(dest, row, spooled)
            finally:
                spooled.file.close()
    except ResourceBusy:
        return Outcome.BUSY, "its row stayed locked (a collection deleting it?)"
    return Outcome.COPIED, ""


def _read_source(source: BlobBackend, row: _Row) -> tuple[Spooled | None, str]:
    """The source's bytes of `row`, spooled and verified against its name and size; or None
    and why they are not the blob."""
    try:
        chunks = source.get(
            blob_id=row.id, company_id=row.company_id, digest=row.digest, size=row.size
        )
    except FileNotFoundError:
        return None, "missing from the source"
    except BlobStoreUnavailable as exc:
        raise StoreUnavailable(side="source", reason=str(exc.details.get("reason"))) from exc
    reader = _ChunkReader(chunks)
    try:
        spooled = spool_upload(reader, digest=row.digest, length=None, max_bytes=row.size)
    except BlobStoreUnavailable as exc:  # cut off part way
        raise StoreUnavailable(side="source", reason=str(exc.details.get("reason"))) from exc
    except BlobTooLarge:
        return None, f"longer than its recorded {row.size} bytes"
    except BlobDigestMismatch as exc:
        return None, (
            f"its {exc.details['size']} bytes (recorded {row.size}) hash to {exc.details['actual']}"
        )
    except OSError as exc:
        return None, f"cannot be read: {exc}"
    finally:
        reader.close()
    if spooled.size != row.size:  # pragma: no cover - a name's bytes have one size
        spooled.file.close()
        return None, f"{spooled.size} bytes, recorded {row.size}"
    return spooled, ""


def _place(dest: BlobBackend, row: _Row, spooled: Spooled) -> None:
    """Write the verified bytes to the target and read them back; TargetFailed (after removing
    them) when either fails. Runs in the blob's transaction."""
    try:
        dest.put(
            blob_id=row.id, company_id=row.company_id, digest=row.digest, source=spooled.reader()
        )
        problem = _readback_problem(dest, row)
    except BlobStoreUnavailable as exc:
        # The target cannot be reached: said as such (resume when it is back), not as a
        # blob the target wrote wrong.
        with suppress(Exception):
            dest.delete(company_id=row.company_id, digest=row.digest)
        raise StoreUnavailable(side="target", reason=str(exc.details.get("reason"))) from exc
    except Exception as exc:
        problem = f"cannot be written: {type(exc).__name__}: {exc}"
    if problem:
        with suppress(Exception):
            dest.delete(company_id=row.company_id, digest=row.digest)
        raise TargetFailed(company_id=row.company_id, digest=row.digest, reason=problem)


def _readback_problem(dest: BlobBackend, row: _Row) -> str:
    """Why the target's copy of `row` is not the blob, or ""."""
    hasher = hashlib.sha256()
    size = 0
    try:
        chunks = dest.get(
            blob_id=row.id, company_id=row.company_id, digest=row.digest, size=row.size
        )
    except FileNotFoundError:
        return "not found when read back"
    for data in chunks:
        hasher.update(data)
        size += len(data)
    actual = "sha256:" + hasher.hexdigest()
    if size != row.size or actual != row.digest:
        return f"read back as {size} bytes hashing to {actual}"
    return ""


class _ChunkReader:
    """A backend's pieces as a `read(n)` stream (what `spool_upload` reads)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._piece = b""
        self._offset = 0

    def read(self, size: int = READ_BYTES, /) -> bytes:
        while self._offset >= len(self._piece):
            piece = next(self._chunks, None)
            if piece is None:
                return b""
            self._piece, self._offset = piece, 0
        data = self._piece[self._offset : self._offset + size]
        self._offset += len(data)
        return data

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()
