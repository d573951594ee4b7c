"""Key rotation (`checkpoint_key_rotate_batch`, run by `rotate_checkpoint_key`): re-encrypt
parts not under the primary key, in resumable batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from django.db import connection, transaction
from django.db.models import QuerySet

from checkpoints import locks
from checkpoints.crypto import Binding, KeyUnavailable, decrypt_part, encrypt_part, keyring
from checkpoints.errors import CheckpointUnreadable
from checkpoints.models import SEALED_FIELDS, NativeRunnerCheckpoint
from paperclip.activity import activity_record
from paperclip.db.locking import busy_on_lock_timeout, set_local_lock_timeout
from paperclip.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class RotationBatch:
    scanned: int
    reencrypted: int
    unreadable: list[tuple[UUID, str, str]]  # (row id, part, reason): left as they are
    last_id: UUID | None  # resume after this id; None when nothing was left to scan
    primary_key_id: str


ROTATION_BATCH_MAX_BYTES = 64 * 1024 * 1024


def _parts_not_under(
    key_id: str, parts: QuerySet[NativeRunnerCheckpoint]
) -> QuerySet[NativeRunnerCheckpoint]:
    """`parts` not sealed under `key_id`."""
    return parts.exclude(key_id=key_id)


def checkpoint_key_rotate_batch(
    *, after_id: UUID | None, batch_size: int, max_bytes: int = ROTATION_BATCH_MAX_BYTES
) -> RotationBatch:
    """Re-encrypt up to `batch_size` parts not under the primary key (ordered by id, after
    `after_id`), stopping early once `max_bytes` of contents are in the batch (at least one
    part is always taken), so a batch of large parts cannot exhaust memory or hold its row
    locks for long. Resumable: parts already under the primary key are never selected, so a
    re-run after an interruption continues where the last committed batch stopped.

    Parts that fail to decrypt (key lost, tampered) are left unchanged and reported.
    Locks: the batch's part rows (no-key update), under the lock timeout; a part re-keyed by a
    writer meanwhile is skipped.
    Raises KeyUnavailable (no key at all), InvalidRequest (bounds), ResourceBusy.
    Audit: one `checkpoint_key.rotated` row per batch that changed anything (actor system).
    """
    if batch_size < 1:
        raise InvalidRequest(fields={"batch_size": ["Must be at least 1."]})
    if max_bytes < 1:
        raise InvalidRequest(fields={"max_bytes": ["Must be at least 1."]})
    ring = keyring(create=False)
    primary = ring.primary
    with transaction.atomic(durable=True):
        set_local_lock_timeout()
        # Choose the batch from sizes alone (no ciphertext loaded), then lock and load it.
        pending = _parts_not_under(primary.key_id, NativeRunnerCheckpoint.objects.all())
        if after_id is not None:
            pending = pending.filter(pk__gt=after_id)
        candidates: list[UUID] = []
        budget = 0
        for row_id, size in pending.order_by("pk").values_list("pk", "size_bytes")[:batch_size]:
            budget += int(size)
            if candidates and budget > max_bytes:
                break
            candidates.append(row_id)
        if not candidates:
            return RotationBatch(0, 0, [], None, primary.key_id)
        with busy_on_lock_timeout(resource="native_run_finalization"):
            rows = list(
                _parts_not_under(primary.key_id, locks.checkpoint_parts_for_update())
                .filter(pk__in=candidates)
                .only("company_id", "issue_id", "run_id", "part", *SEALED_FIELDS)
            )
        last_id = candidates[-1]
        reencrypted: list[NativeRunnerCheckpoint] = []
        unreadable: list[tuple[UUID, str, str]] = []
        from_keys: set[str] = set()
        for row in rows:
            binding = Binding(company_id=row.company_id, issue_id=row.issue_id, run_id=row.run_id)
            try:
                contents = decrypt_part(binding, row.part, row.sealed, ring)
            except CheckpointUnreadable as exc:
                unreadable.append((row.pk, row.part, str(exc.details.get("reason"))))
                continue
            from_keys.add(row.key_id)
            sealed = encrypt_part(binding, row.part, contents, primary)
            row.scheme, row.key_id = sealed.scheme, sealed.key_id
            row.nonce, row.ciphertext = sealed.nonce, sealed.ciphertext
            reencrypted.append(row)
        if reencrypted:
            NativeRunnerCheckpoint.objects.bulk_update(reencrypted, list(SEALED_FIELDS))
            activity_record(
                company_id=None,
                actor_type="system",
                actor_id="rotate_checkpoint_key",
                action="checkpoint_key.rotated",
                entity_type="checkpoint_key",
                entity_id=primary.key_id,
                details={
                    "toKeyId": primary.key_id,
                    "fromKeyIds": sorted(from_keys),
                    "reencrypted": len(reencrypted),
                    "unreadable": len(unreadable),
                    "firstId": str(candidates[0]),
                    "lastId": str(last_id),
                },
            )
    return RotationBatch(len(candidates), len(reencrypted), unreadable, last_id, primary.key_id)


def checkpoint_parts_remaining_under_old_keys(*, settled: bool = False) -> int:
    """How many parts are not under the primary key (0 after a complete rotation).

    `settled`: counted under a SHARE lock on the parts' table, which waits for the checkpoint
    writes in flight (each holds ROW EXCLUSIVE from its upsert to its commit) and holds off
    new ones while it counts: a write that sealed its parts under the old key before the key
    file changed is either counted here or seals them again under the new one before it
    commits (`checkpoint_write`). What the rotation reports as done stays done."""
    try:
        primary = keyring(create=False).primary
    except KeyUnavailable:
        return 0
    parts = _parts_not_under(primary.key_id, NativeRunnerCheckpoint.objects.all())
    if not settled:
        return parts.count()
    with transaction.atomic(durable=True), connection.cursor() as cursor:
        set_local_lock_timeout()
        with busy_on_lock_timeout(resource="native_runner_checkpoints"):
            cursor.execute(f"LOCK TABLE {NativeRunnerCheckpoint._meta.db_table} IN SHARE MODE")
        return parts.count()
