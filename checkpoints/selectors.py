"""Reads of the checkpoints app. Every read of parts is scoped by (company, issue, run)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from django.db.models import Exists, Func, OuterRef, Q, QuerySet
from django.db.models.functions import Now

from checkpoints.crypto import Binding, Sealed, decrypt_part, read_keyring
from checkpoints.errors import (
    CheckpointBindingMismatch,
    CheckpointUnreadable,
    ControllerLeaseRunNotNative,
)
from checkpoints.models import SEALED_FIELDS, NativeRunnerCheckpoint
from paperclip.db.bound import bound_cursor
from paperclip.errors import NotFoundError, PermissionDenied
from paperclip.models import HeartbeatRun, NativeRunFinalization
from paperclip.observability import metrics

HEADER_PART = "header"


@dataclass(frozen=True, slots=True)
class RunnerRun:
    """A native run as its runner sees it: who runs it and which row binding its parts get."""

    run_id: UUID
    company_id: UUID
    issue_id: UUID
    agent_id: UUID
    status: str

    @property
    def binding(self) -> Binding:
        return Binding(company_id=self.company_id, issue_id=self.issue_id, run_id=self.run_id)


def runner_run_get(*, run_id: UUID, agent_id: UUID | None) -> RunnerRun:
    """The native run `run_id`, checked to be run by `agent_id` (None: no agent check).

    Raises NotFoundError (no such run), PermissionDenied (another agent's run) and
    ControllerLeaseRunNotNative (a legacy run, or one without an issue).
    """
    # At most one row (a primary-key lookup): iterating skips the ORDER BY and slice that
    # first() would compile on every checkpoint write.
    rows = HeartbeatRun.objects.filter(pk=run_id).values_list(
        "company_id", "native_issue_id", "agent_id", "status", "runtime_mode"
    )
    row = next(iter(rows), None)
    if row is None:
        raise NotFoundError()
    company_id, issue_id, run_agent_id, status, mode = row
    if agent_id is not None and run_agent_id != agent_id:
        raise PermissionDenied("Only the run's own agent may use its controller lease.")
    if mode != HeartbeatRun.RuntimeMode.NATIVE or issue_id is None:
        raise ControllerLeaseRunNotNative(run_id=str(run_id))
    return RunnerRun(
        run_id=run_id,
        company_id=company_id,
        issue_id=issue_id,
        agent_id=run_agent_id,
        status=status,
    )


def _scoped_parts(binding: Binding) -> list[tuple[str, Sealed]]:
    rows = _binary_rows(
        NativeRunnerCheckpoint.objects.filter(
            company_id=binding.company_id, issue_id=binding.issue_id, run_id=binding.run_id
        )
        .order_by("part")
        .values_list("part", *SEALED_FIELDS)
    )
    return [(part, _sealed(*columns)) for part, *columns in rows]


def _binary_rows(rows: QuerySet[Any, Any]) -> list[tuple[Any, ...]]:
    """The queryset's rows read in binary: the ORM's SQL, but the ciphertext arrives as bytes
    rather than as hex text twice its size (paperclip/db/bound.py)."""
    sql, params = rows.query.sql_with_params()
    with bound_cursor(binary=True) as cursor:
        cursor.execute(sql, params)
        return list(cursor.fetchall())


def _sealed(scheme: str, key_id: str, nonce: Any, ciphertext: Any) -> Sealed:
    # bytes() of a bytes object is the object itself; a memoryview (other drivers) is copied.
    return Sealed(scheme=scheme, key_id=key_id, nonce=bytes(nonce), ciphertext=bytes(ciphertext))


def checkpoint_load(*, binding: Binding) -> dict[str, str]:
    """All parts of the run's checkpoint, decrypted (empty when there is none).

    Raises CheckpointUnreadable naming the first part (in name order) that fails to decrypt or
    is bound to another row; nothing is returned partially.
    """
    started = time.perf_counter()
    rows = _scoped_parts(binding)
    if not rows:
        return {}
    ring = read_keyring()
    try:
        parts = {part: decrypt_part(binding, part, sealed, ring) for part, sealed in rows}
    except CheckpointUnreadable:
        metrics.CHECKPOINT_UNREADABLE_PARTS.inc()
        raise
    nbytes = sum(len(value.encode()) for value in parts.values())
    metrics.checkpoint_observed("read", parts=len(parts), nbytes=nbytes, started=started)
    return parts


def checkpoint_header_load(*, binding: Binding) -> str | None:
    """The decrypted `header` part, or None when it is missing or unreadable for any reason."""
    rows = _binary_rows(
        NativeRunnerCheckpoint.objects.filter(
            company_id=binding.company_id,
            issue_id=binding.issue_id,
            run_id=binding.run_id,
            part=HEADER_PART,
        ).values_list(*SEALED_FIELDS)
    )
    if not rows:
        return None
    row = rows[0]
    started = time.perf_counter()
    try:
        header = decrypt_part(binding, HEADER_PART, _sealed(*row), read_keyring())
    except Exception:
        # A header that cannot be read is "no header", never an error (but it is counted).
        metrics.CHECKPOINT_UNREADABLE_PARTS.inc()
        return None
    metrics.checkpoint_observed("header", parts=1, nbytes=len(header.encode()), started=started)
    return header


def checkpoint_restore(
    *, binding: Binding, normalized_session_id: str | None = None
) -> dict[str, str] | None:
    """The checkpoint to restore a runner session from, or None when there is none.

    With `normalized_session_id`, the header must be JSON whose
    `recoveryEvidence.normalizedSessionId` equals it, else CheckpointBindingMismatch: a runner
    must never resume another session's state. Raises CheckpointUnreadable like
    `checkpoint_load`.
    """
    parts = checkpoint_load(binding=binding)
    if not parts:
        return None
    if normalized_session_id is not None:
        recorded: object = None
        try:
            header = json.loads(parts.get(HEADER_PART, ""))
            if isinstance(header, dict) and isinstance(header.get("recoveryEvidence"), dict):
                recorded = header["recoveryEvidence"].get("normalizedSessionId")
        except (ValueError, RecursionError):  # a header nested past the parser's depth
            recorded = None
        if recorded != normalized_session_id:
            raise CheckpointBindingMismatch(reason="session_mismatch")
    return parts


def checkpoint_exists(*, binding: Binding) -> bool:
    return NativeRunnerCheckpoint.objects.filter(
        company_id=binding.company_id, issue_id=binding.issue_id, run_id=binding.run_id
    ).exists()


@dataclass(frozen=True, slots=True)
class PartInfo:
    part: str
    size_bytes: int
    key_id: str | None
    created_at: datetime
    updated_at: datetime


def checkpoint_parts_list(*, binding: Binding) -> list[PartInfo]:
    """Metadata of the stored parts (names, sizes, key ids, times); never contents."""
    rows = (
        NativeRunnerCheckpoint.objects.filter(
            company_id=binding.company_id, issue_id=binding.issue_id, run_id=binding.run_id
        )
        .order_by("part")
        .values_list("part", "size_bytes", "key_id", "created_at", "updated_at")
    )
    return [
        PartInfo(part=p, size_bytes=s, key_id=k or None, created_at=c, updated_at=u)
        for p, s, k, c, u in rows
    ]


def expired_authorities(*, clock: Func) -> QuerySet[NativeRunFinalization]:
    """Coordinators whose controller authority has lapsed, by `clock` (`Now()` for a read,
    `ClockTimestamp()` for a re-check under the row lock), while they hold a checkpoint.

    All of: the run is `running`; its coordinator is `observed` with no result; the lease
    expiry is null or not after `clock`; at least one checkpoint row exists for the
    (run, issue, company).
    """
    return NativeRunFinalization.objects.filter(
        Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=clock),
        Exists(
            NativeRunnerCheckpoint.objects.filter(
                run_id=OuterRef("run_id"),
                issue_id=OuterRef("issue_id"),
                company_id=OuterRef("company_id"),
            )
        ),
        run__status=HeartbeatRun.Status.RUNNING,
        phase=NativeRunFinalization.Phase.OBSERVED,
        result__isnull=True,
    )


def list_expired_authorities(
    *, run_ids: list[UUID] | None = None, after: UUID | None = None, limit: int | None = None
) -> list[UUID]:
    """Runs whose controller authority has lapsed while they hold a checkpoint.

    See `expired_authorities`, with the database's now(). Returns every match (ordered by run
    id), not just the first, so one blocked owner cannot starve the others. `run_ids`
    restricts the candidates as upstream's caller-supplied inventory does; None means all
    runs. `after` and `limit` page through the matches by run id.
    """
    found = expired_authorities(clock=Now())
    if run_ids is not None:
        if not run_ids:
            return []
        found = found.filter(pk__in=run_ids)
    if after is not None:
        found = found.filter(pk__gt=after)
    ids = found.order_by("pk").values_list("pk", flat=True)
    return list(ids if limit is None else ids[:limit])
