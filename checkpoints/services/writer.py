"""The fenced checkpoint writer (`checkpoint_write`): its limits and database-free validation,
the owner fence (docs/checkpoints.md#owner-fence), the predecessor check, and the part and
work-command-memory writes.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, TextField
from django.db.models.functions import Cast

from checkpoints import locks
from checkpoints.crypto import Binding, CheckpointKey, KeyUnavailable, encrypt_part, keyring
from checkpoints.errors import CheckpointBindingMismatch, CheckpointOwnerLost
from checkpoints.models import SEALED_FIELDS, NativeRunnerCheckpoint, NativeRunnerCheckpointWork
from checkpoints.selectors import runner_run_get
from checkpoints.services.shared import live_run_recovery_notify
from paperclip.activity import activity_record
from paperclip.db.bound import bound_cursor
from paperclip.db.clock import ClockTimestamp
from paperclip.db.locking import busy_on_lock_timeout, require_transaction, set_local_lock_timeout
from paperclip.errors import InvalidRequest
from paperclip.models import HeartbeatRun, Issue, NativeRunFinalization
from paperclip.observability import metrics

MAX_PART_NAME_CHARS = 200
MAX_WORK_COMMAND_ID_CHARS = 200
MAX_WORK_COMMAND_IDS = 10_000


# The defaults live in paperclip/settings.py only (read at call time: tests override them).
def max_part_bytes() -> int:
    return int(settings.PAPERCLIP_CHECKPOINT_MAX_PART_BYTES)


def max_write_bytes() -> int:
    return int(settings.PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES)


def max_parts_per_write() -> int:
    return int(settings.PAPERCLIP_CHECKPOINT_MAX_PARTS_PER_WRITE)


@dataclass(frozen=True, slots=True)
class CheckpointOwner:
    """What a controller presents: its boot, its lease token, the generation it was given, and
    the run whose coordinator carries the lease (default: the checkpoint's own run)."""

    boot_id: str
    lease_owner: str
    generation: int
    authority_run_id: UUID | None = None


@dataclass(frozen=True, slots=True)
class Predecessor:
    run_id: UUID
    normalized_session_id: UUID


@dataclass(frozen=True, slots=True)
class CheckpointWrite:
    parts: int  # parts stored for the run after the write
    owner_active: bool  # False: tolerated as an expired owner with a result (§3.5)
    changed: int
    removed: int


def _invalid_part_name(name: object) -> str | None:
    if not isinstance(name, str) or not name:
        return "Part names are non-empty strings."
    if len(name) > MAX_PART_NAME_CHARS:
        return f"Part names are at most {MAX_PART_NAME_CHARS} characters."
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in name):
        return "Part names contain no control characters."
    return None


def _invalid_text(value: str) -> bool:
    if "\x00" in value:
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def checkpoint_write_validate(
    *, changed: Mapping[str, str], removed: Sequence[str], work_command_ids: Sequence[str]
) -> None:
    """Database-free checks of a write; InvalidRequest (400) naming the fields."""
    errors: dict[str, list[str]] = {}
    _part_name_errors(changed, removed, errors)
    if len(changed) > max_parts_per_write():
        errors.setdefault("changed", []).append(f"At most {max_parts_per_write()} parts a write.")
    if len(removed) > max_parts_per_write():
        # Deleted under the coordinator's lock: unbounded, a body of short names held it for
        # seconds while the run's renewals waited.
        errors.setdefault("removed", []).append(f"At most {max_parts_per_write()} parts a write.")
    _contents_errors(changed, errors)
    both = sorted(set(changed) & set(removed))
    if both:
        errors.setdefault("removed", []).append(
            f"Parts both changed and removed: {', '.join(map(repr, both[:5]))}."[:300]
        )
    _work_command_id_errors(work_command_ids, errors)
    if errors:
        raise InvalidRequest(fields=errors)


def _part_name_errors(
    changed: Mapping[str, str], removed: Sequence[str], errors: dict[str, list[str]]
) -> None:
    for name in [*changed, *removed]:
        problem = _invalid_part_name(name)
        if problem:
            errors.setdefault("changed" if name in changed else "removed", []).append(
                f"{name!r}: {problem}"[:300]
            )


def _contents_errors(changed: Mapping[str, str], errors: dict[str, list[str]]) -> None:
    """Each part's contents a string within the part limit, all of them within the write's."""
    total = 0
    for name, contents in changed.items():
        if not isinstance(contents, str):
            errors.setdefault("changed", []).append(f"{name!r}: contents must be a string.")
            continue
        try:
            size = len(contents.encode("utf-8"))
        except UnicodeEncodeError:
            errors.setdefault("changed", []).append(
                f"{name!r}: contents are not valid Unicode (lone surrogate)."[:300]
            )
            continue
        total += size
        if size > max_part_bytes():
            errors.setdefault("changed", []).append(
                f"{name!r}: {size} bytes exceeds the part limit of {max_part_bytes()}."[:300]
            )
    if total > max_write_bytes():
        errors.setdefault("changed", []).append(
            f"{total} bytes in one write exceeds the limit of {max_write_bytes()}."
        )


def _work_command_id_errors(work_command_ids: Sequence[str], errors: dict[str, list[str]]) -> None:
    if len(work_command_ids) > MAX_WORK_COMMAND_IDS:
        errors.setdefault("work_command_ids", []).append(f"At most {MAX_WORK_COMMAND_IDS} ids.")
    if any(
        not isinstance(i, str) or not i or len(i) > MAX_WORK_COMMAND_ID_CHARS
        for i in work_command_ids
    ):
        errors.setdefault("work_command_ids", []).append(
            f"Ids are non-empty strings of at most {MAX_WORK_COMMAND_ID_CHARS} characters."
        )
    elif any(_invalid_text(i) for i in work_command_ids):
        # Stored in jsonb, which cannot hold NUL or unpaired surrogates.
        errors.setdefault("work_command_ids", []).append(
            "Ids contain no NUL characters or unpaired surrogates."
        )


def _owner_validate(
    locked: locks.LockedCoordinator, owner: CheckpointOwner, binding: Binding, *, new_work: bool
) -> bool:
    """The fence (docs/checkpoints.md#owner-fence): True for an active owner; False for a
    tolerated inactive one; CheckpointOwnerLost otherwise. Runs under the coordinator lock."""
    require_transaction()
    if locked.lease_owner == owner.lease_owner and locked.lease_active:
        return True
    if locked.result_id is None:
        raise CheckpointOwnerLost(reason="lease_not_held")
    if new_work:
        raise CheckpointOwnerLost(reason="new_work_after_lease")
    # A legitimate successor on the same controller boot: a native coordinator with an
    # unexpired lease, or a legacy run still preparing under an unexpired controller lease
    # and without a coordinator. The controller boot is the presenting owner's (this server
    # has no controller process of its own: docs/checkpoints.md#successor-rule).
    native_successor = NativeRunFinalization.objects.filter(
        run_id=OuterRef("execution_run_id"),
        company_id=binding.company_id,
        issue_id=binding.issue_id,
        controller_boot_id=owner.boot_id,
        lease_expires_at__gt=ClockTimestamp(),
    )
    legacy_successor = HeartbeatRun.objects.alias(
        boot_text=Cast("controller_boot_id", TextField())
    ).filter(
        ~Exists(NativeRunFinalization.objects.filter(run_id=OuterRef("pk"))),
        pk=OuterRef("execution_run_id"),
        company_id=binding.company_id,
        issue_id=binding.issue_id,
        runtime_mode=HeartbeatRun.RuntimeMode.LEGACY,
        status=HeartbeatRun.Status.RUNNING,
        execution_stage="preparing",
        boot_text=owner.boot_id,
        controller_lease_expires_at__gt=ClockTimestamp(),
    )
    issue = (
        Issue.objects.filter(company_id=binding.company_id, pk=binding.issue_id)
        .annotate(successor=Exists(native_successor) | Exists(legacy_successor))
        .values_list("execution_run_id", "successor")
        .first()
    )
    if issue is None:
        raise CheckpointOwnerLost(reason="issue_missing")
    execution_run_id, successor = issue
    if execution_run_id is None or execution_run_id == binding.run_id:
        return False
    if not successor:
        raise CheckpointOwnerLost(reason="issue_rebound")
    return False


def _require_live_run(run_id: UUID) -> None:
    """CheckpointOwnerLost (`run_terminal`) for a run that reached a terminal status: its
    checkpoint is closed, whoever presents a lease (its own, whose expiry a tolerated owner
    outlives once a result was accepted, or a live run's as the authority). The run's row is
    held (FOR NO KEY UPDATE, after the coordinator's, in the global order) so that it cannot
    end between this check and the commit."""
    require_transaction()
    status = (
        HeartbeatRun.objects.select_for_update(no_key=True)
        .filter(pk=run_id)
        .values_list("status", flat=True)
        .first()
    )
    if status is None or status in HeartbeatRun.TERMINAL_STATUSES:
        raise CheckpointOwnerLost(reason="run_terminal")


def _predecessor_check(predecessor: Predecessor, binding: Binding) -> None:
    require_transaction()
    found = HeartbeatRun.objects.filter(
        pk=predecessor.run_id,
        company_id=binding.company_id,
        native_issue_id=binding.issue_id,
        native_session_id=predecessor.normalized_session_id,
    ).exists()
    if not found:
        raise CheckpointBindingMismatch(
            reason="predecessor_mismatch", predecessor_run_id=str(predecessor.run_id)
        )


def checkpoint_write(
    *,
    run_id: UUID,
    agent_id: UUID,
    owner: CheckpointOwner,
    reset: bool,
    changed: Mapping[str, str],
    removed: Sequence[str],
    work_command_ids: Sequence[str],
    predecessor: Predecessor | None,
) -> CheckpointWrite:
    """Persist one checkpoint snapshot of the run, fenced by the controller lease.

    Changed parts are encrypted before the transaction (no crypto under a row lock). Inside it:
    the owner fence (coordinator of the authority run, on the presented boot and generation,
    locked with the time sampled after the lock); the predecessor check; a live-run-recovery
    NOTIFY; `reset` (delete every part) or deletion of `removed`; an upsert of the changed
    parts on (run, part); the remembered work command ids; one audit row. The write costs what
    it changes, not what the run stores.

    Locks, in order: the coordinator row, the run's work-memory row, the changed part rows.
    Raises: InvalidRequest (names, sizes), NotFoundError, PermissionDenied,
    ControllerLeaseRunNotNative, CheckpointOwnerLost, CheckpointBindingMismatch, ResourceBusy.
    """
    started = time.perf_counter()
    checkpoint_write_validate(changed=changed, removed=removed, work_command_ids=work_command_ids)
    run = runner_run_get(run_id=run_id, agent_id=agent_id)
    binding = run.binding
    authority_run_id = owner.authority_run_id or run.run_id
    key = keyring(create=True).primary
    parts = [_part_row(binding, name, contents, key) for name, contents in changed.items()]
    work_ids = list(dict.fromkeys(work_command_ids))

    with transaction.atomic(durable=True):
        set_local_lock_timeout()
        fence = locks.checkpoint_owner_lock(
            company_id=binding.company_id,
            issue_id=binding.issue_id,
            authority_run_id=authority_run_id,
            boot_id=owner.boot_id,
            generation=owner.generation,
            run_id=binding.run_id,
        )
        if fence is None:
            raise CheckpointOwnerLost(reason="generation_or_boot_changed")
        _require_live_run(binding.run_id)
        locked, remembered = fence.coordinator, fence.remembered
        previous = (
            set(remembered[1]) if remembered and remembered[0] == owner.lease_owner else set()
        )
        new_work = any(i not in previous for i in work_ids)
        active = _owner_validate(locked, owner, binding, new_work=new_work)
        if predecessor is not None:
            _predecessor_check(predecessor, binding)
        if not (reset or parts or removed or new_work):
            # Nothing to change: answered, nothing written (no audit row, no NOTIFY).
            count = NativeRunnerCheckpoint.objects.filter(run_id=binding.run_id).count()
            return CheckpointWrite(parts=count, owner_active=active, changed=0, removed=0)
        removed_count = _parts_apply(binding, reset, removed, parts)
        if not (parts or new_work or removed_count):
            # Only parts already gone were named (a retry whose answer was lost): the
            # deletion changed nothing, so nothing is written (no audit row, no NOTIFY).
            count = NativeRunnerCheckpoint.objects.filter(run_id=binding.run_id).count()
            return CheckpointWrite(parts=count, owner_active=active, changed=0, removed=0)
        parts, key = _resealed_if_rotated(binding, changed, parts, key)
        _work_remember(binding, owner.lease_owner, work_ids)
        live_run_recovery_notify(company_id=binding.company_id, run_id=run.run_id)
        count = NativeRunnerCheckpoint.objects.filter(run_id=binding.run_id).count()
        activity_record(
            company_id=binding.company_id,
            actor_type="agent",
            actor_id=str(run.agent_id),
            action="checkpoint.written",
            entity_type="heartbeat_run",
            entity_id=run.run_id,
            run_id=run.run_id,
            details={
                "authorityRunId": str(authority_run_id),
                "generation": owner.generation,
                "ownerActive": active,
                "reset": reset,
                "changed": len(parts),
                "removed": removed_count,
                "keyId": key.key_id,
            },
        )
    nbytes = sum(part.size_bytes for part in parts)  # measured once, as the rows were built
    metrics.checkpoint_observed("write", parts=len(parts), nbytes=nbytes, started=started)
    return CheckpointWrite(
        parts=count, owner_active=active, changed=len(parts), removed=removed_count
    )


def _resealed_if_rotated(
    binding: Binding,
    changed: Mapping[str, str],
    parts: list[NativeRunnerCheckpoint],
    key: CheckpointKey,
) -> tuple[list[NativeRunnerCheckpoint], CheckpointKey]:
    """The parts as stored, and their key: sealed before the transaction, under the primary
    key of that moment. When `rotate_checkpoint_key --new-key` made another key primary since,
    they are sealed again under it and stored again. Called once the upsert holds the table's
    ROW EXCLUSIVE lock: the rotation's last count (SHARE lock) then either waits for this
    commit and sees these parts, or comes before this read of the key file, which it changed
    before it started; so no part is left under a key the rotation reported gone."""
    if not parts:
        return parts, key
    try:
        now = keyring().primary
    except KeyUnavailable:  # the key file removed meanwhile: the parts keep the key they have
        return parts, key
    if now.key_id == key.key_id:
        return parts, key
    resealed = [_part_row(binding, name, contents, now) for name, contents in changed.items()]
    with busy_on_lock_timeout(resource="native_run_finalization"):
        _parts_upsert(resealed)
    return resealed, now


def _part_row(
    binding: Binding, name: str, contents: str, key: CheckpointKey
) -> NativeRunnerCheckpoint:
    sealed = encrypt_part(binding, name, contents, key)
    return NativeRunnerCheckpoint(
        company_id=binding.company_id,
        issue_id=binding.issue_id,
        run_id=binding.run_id,
        part=name,
        scheme=sealed.scheme,
        key_id=sealed.key_id,
        nonce=sealed.nonce,
        ciphertext=sealed.ciphertext,
        size_bytes=len(contents.encode("utf-8")),
    )


def _parts_apply(
    binding: Binding, reset: bool, removed: Sequence[str], parts: list[NativeRunnerCheckpoint]
) -> int:
    require_transaction()
    removed_count = 0
    with busy_on_lock_timeout(resource="native_run_finalization"):
        if reset or removed:
            doomed = NativeRunnerCheckpoint.objects.filter(
                company_id=binding.company_id, issue_id=binding.issue_id, run_id=binding.run_id
            )
            if not reset:
                doomed = doomed.filter(part__in=removed)
            removed_count, _ = doomed.delete()
        _parts_upsert(parts)
    return removed_count


# What bulk_create(update_conflicts=True) would send, but bound server-side: Django's cursors
# write each ciphertext into the SQL text as hex, which cost a 64 KiB part more than its
# encryption (paperclip/db/bound.py). created_at/updated_at take their default (now).
_UPSERT_COLUMNS = ("id", "company_id", "issue_id", "run_id", "part", *SEALED_FIELDS, "size_bytes")
_UPSERT_SQL = (  # built from constants only; the values are bound parameters
    f"INSERT INTO {NativeRunnerCheckpoint._meta.db_table} ({', '.join(_UPSERT_COLUMNS)}) "  # noqa: S608
    "VALUES {rows} ON CONFLICT (run_id, part) DO UPDATE SET "
    + ", ".join(f"{c} = EXCLUDED.{c}" for c in (*SEALED_FIELDS, "size_bytes", "updated_at"))
)
_UPSERT_ROW = f"({', '.join(['%s'] * len(_UPSERT_COLUMNS))})"
_UPSERT_ROWS_PER_STATEMENT = 1000  # PostgreSQL takes at most 65,535 parameters a statement


def _parts_upsert(parts: list[NativeRunnerCheckpoint]) -> None:
    require_transaction()
    with bound_cursor() as cursor:
        for start in range(0, len(parts), _UPSERT_ROWS_PER_STATEMENT):
            chunk = parts[start : start + _UPSERT_ROWS_PER_STATEMENT]
            cursor.execute(
                _UPSERT_SQL.format(rows=", ".join([_UPSERT_ROW] * len(chunk))),
                [getattr(part, column) for part in chunk for column in _UPSERT_COLUMNS],
            )


def _work_remember(binding: Binding, lease_owner: str, work_ids: list[str]) -> None:
    require_transaction()
    with busy_on_lock_timeout(resource="native_run_finalization"):
        NativeRunnerCheckpointWork.objects.bulk_create(
            [
                NativeRunnerCheckpointWork(
                    run_id=binding.run_id,
                    company_id=binding.company_id,
                    issue_id=binding.issue_id,
                    lease_owner=lease_owner,
                    work_command_ids=work_ids,
                )
            ],
            update_conflicts=True,
            unique_fields=["run"],
            update_fields=["lease_owner", "work_command_ids", "updated_at"],
        )
