"""Collection of unreferenced blobs (docs/snapshots.md#collection).

A blob is kept while it is young (uploaded, or referenced by an upload, a find-missing answer
or a snapshot registration, within `PAPERCLIP_CAS_GRACE_SECONDS` on the database clock) or
reachable from a root of its company: a workspace's head (and the tree its `cwd` was last made
equal to), the tree and base of a snapshot of a live run (not terminal, or its finalization
coordinator exists and has not settled: committed, terminal failure, applied), the tree
and base of every snapshot registered within the grace, and every tree a head moved to or
from within `PAPERCLIP_WORKSPACE_HISTORY_DAYS` (the history's retention).

Per company: the roots are read in one statement under the company's roots lock
(`roots_lock_key`, exclusive, for that read only; a registration that trusts the head's blobs
holds it shared until it commits), then one reachability pass (reading each directory blob
once), then the old unreachable rows are deleted in batches, each batch one transaction that
re-checks the age on the row itself (`FOR UPDATE SKIP LOCKED`): a registration that touched a
blob after the reachability pass (it holds the row, or has committed a young `referenced_at`)
wins. Each batch's rows are first marked `doomed` in a committed transaction of their own
(missing from then on to find-missing and pins); the bytes go in the next, before its commit,
while the deleted rows are still locked (the s3 backend's objects too, one DeleteObjects
request per 1,000).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final, Literal
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.advisory import advisory_xact_lock
from paperclip.db.prepared import prepared_cursor
from paperclip.models import ExecutionWorkspace, HeartbeatRun, NativeRunFinalization, RunSnapshot
from paperclip.snapshots import trees
from paperclip.snapshots.models import WorkspaceHeadMove
from paperclip.snapshots.store.backends import (
    BlobBackend,
    FilesystemBackend,
    PostgresBackend,
    blob_backend,
)
from paperclip.snapshots.store.reads import cas_load_many

logger = logging.getLogger(__name__)

# Coordinator phases after which a run's snapshots can no longer be published.
SETTLED_PHASES: Final = frozenset(
    {
        NativeRunFinalization.Phase.COMMITTED,
        NativeRunFinalization.Phase.TERMINAL_FAILURE,
        NativeRunFinalization.Phase.APPLIED,
    }
)
AUDIT_ACTION: Final = "cas.blobs_collected"
LOAD_BATCH: Final = 1000  # directory blobs read per query in the reachability pass


@dataclass(frozen=True, slots=True)
class CollectProgress:
    """One step of a collection, for progress lines (and tests that pause it)."""

    company_id: UUID
    phase: Literal["reached", "deleted"]
    reachable: int = 0  # blobs reachable from the company's roots
    candidates: int = 0  # old blobs not reachable
    batch: int = 0
    deleted: int = 0
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class CollectSummary:
    dry_run: bool
    companies: int = 0  # companies with old blobs, examined
    skipped_companies: tuple[UUID, ...] = ()  # a root could not be walked: nothing deleted
    skip_reasons: dict[str, str] = field(default_factory=dict)  # why, by company id
    candidates: int = 0  # old and unreachable (what a dry run would delete)
    deleted: int = 0
    bytes: int = 0
    batches: int = 0
    by_company: dict[str, int] = field(default_factory=dict)


def _live_snapshot_filter() -> Q:
    live_phases = [p for p in NativeRunFinalization.Phase.values if p not in SETTLED_PHASES]
    return ~Q(run__status__in=HeartbeatRun.TERMINAL_STATUSES) | Q(
        run__finalization__phase__in=live_phases
    )


def roots_lock_key(company_id: UUID) -> str:
    """The advisory key that orders reading a company's roots against registrations that
    trust its head's blobs without touching them (paperclip.snapshots.registration)."""
    return f"cas-roots:{company_id}"


def _roots(company_id: UUID, grace: int) -> set[str]:
    """The company's roots, read under its roots lock in one statement, so from one snapshot
    of the database: a commit that publishes a snapshot (its run settles and the head moves,
    in one transaction) is seen whole or not at all, never half (the snapshot settled and the
    head not yet moved, which would leave the published tree nobody's root)."""
    recent = Q(created_at__gte=Now() - timedelta(seconds=grace))
    snapshots = (
        RunSnapshot.objects.filter(company_id=company_id)
        .filter(_live_snapshot_filter() | recent)
        .values_list("tree", "base")
    )
    heads = ExecutionWorkspace.objects.filter(company_id=company_id).values_list(
        "head_tree", "cwd_tree"
    )
    # The history's retention: every tree a head moved to or from within the window.
    days = int(settings.PAPERCLIP_WORKSPACE_HISTORY_DAYS)
    moves = WorkspaceHeadMove.objects.filter(
        company_id=company_id, at__gte=Now() - timedelta(days=days)
    ).values_list("tree", "previous_tree")
    with transaction.atomic():
        advisory_xact_lock(roots_lock_key(company_id))
        rows = list(heads.union(snapshots, moves, all=True))
    return {tree for row in rows for tree in row if tree}


def cas_reachable(company_id: UUID, grace: int | None = None) -> set[str]:
    """Every blob name reachable from the company's roots (names it lacks included), each
    directory blob read and decoded once however many roots share it, a level at a time in
    batches of LOAD_BATCH names. The walk costs what the roots hold between them: with a root
    for every snapshot of the grace, about the directory blobs uploaded in it. Raises
    TreeInvalid when a directory cannot be read as one, or cannot be read at all (its row
    missing, or its bytes missing or damaged, `unreadable`): what lies below it is unknown,
    and taken for unreachable it would be deleted though a root still names it (a damaged
    directory, repaired by uploading it again, would then name blobs gone for good)."""
    grace = int(settings.PAPERCLIP_CAS_GRACE_SECONDS) if grace is None else grace
    max_bytes = settings.PAPERCLIP_CAS_MAX_BLOB_BYTES
    reached: set[str] = set()
    level = sorted(_roots(company_id, grace))
    while level:
        following: list[str] = []
        reached.update(level)
        for start in range(0, len(level), LOAD_BATCH):
            names = level[start : start + LOAD_BATCH]
            stored = cas_load_many(company_id=company_id, digests=names, max_bytes=max_bytes)
            for name in names:
                data = stored.get(name)
                if data is None:
                    raise trees.TreeInvalid(
                        name, "unreadable", "a directory the roots reach is missing or damaged"
                    )
                for entry in trees.decode_stored_dir(data, name):
                    if entry.type == "dir":
                        assert entry.digest is not None  # noqa: S101 - decode_dir checked it
                        following.append(entry.digest)
                    else:
                        reached.update(entry.blobs())
        level = sorted(set(following) - reached)
    return reached


def _old() -> str:
    return (
        "referenced_at < now() - make_interval(secs => %(grace)s::double precision) "
        "AND created_at < now() - make_interval(secs => %(grace)s::double precision)"
    )


def _companies_with_old_blobs(grace: int) -> list[UUID]:
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT DISTINCT company_id FROM cas_blobs WHERE {_old()} ORDER BY company_id",  # noqa: S608 - constant text
            {"grace": grace},
        )
        return [row[0] for row in cursor.fetchall()]


def _old_blobs(company_id: UUID, grace: int) -> list[tuple[int, str]]:
    with prepared_cursor() as cursor:
        cursor.execute(
            f"SELECT id, digest FROM cas_blobs WHERE company_id = %(company)s AND {_old()} "  # noqa: S608 - constant text
            "ORDER BY id",
            {"company": company_id, "grace": grace},
        )
        return [(int(r[0]), r[1]) for r in cursor.fetchall()]


_DOOM: Final = f"""
    UPDATE cas_blobs SET doomed = true WHERE id IN (
        SELECT id FROM cas_blobs
        WHERE id = ANY(%(ids)s::bigint[]) AND company_id = %(company)s AND {_old()}
        ORDER BY id FOR UPDATE SKIP LOCKED
    )
    RETURNING id
"""  # noqa: S608 - constant text
_DELETE: Final = """
    DELETE FROM cas_blobs WHERE id IN (
        SELECT id FROM cas_blobs
        WHERE id = ANY(%(ids)s::bigint[]) AND company_id = %(company)s AND doomed
        ORDER BY id FOR UPDATE SKIP LOCKED
    )
    RETURNING id, digest, size
"""


def _delete_batch(
    *, company_id: UUID, ids: list[int], grace: int, collection_id: str, number: int
) -> tuple[int, int]:
    """Delete those of `ids` that are still old and not locked, their bytes with them, and
    write the batch's audit row; (deleted, bytes). Two transactions: the rows are first
    marked `doomed` (committed: from then on find-missing and pins count them missing, so
    nothing comes to rely on them), then, under their locks again, their bytes go and they
    are deleted with the audit row. Dying between the bytes and the commit leaves doomed rows
    without bytes, which no registration can pin and an upload restores (clearing the mark);
    the next collection deletes the rest. An upload clearing the mark in between keeps its
    row and bytes (the delete takes only rows still doomed)."""
    with transaction.atomic(durable=True), prepared_cursor() as cursor:
        cursor.execute(_DOOM, {"ids": ids, "company": company_id, "grace": grace})
        doomed = [int(row[0]) for row in cursor.fetchall()]
    if not doomed:
        return 0, 0
    with transaction.atomic(durable=True):
        with prepared_cursor() as cursor:
            cursor.execute(_DELETE, {"ids": doomed, "company": company_id})
            rows: list[tuple[int, str, int]] = cursor.fetchall()
            if not rows:
                return 0, 0
            # Both backends' bytes: a store that changed backend keeps no orphans either.
            cursor.execute(
                "DELETE FROM cas_blob_chunks WHERE blob_id = ANY(%s::bigint[])",
                [[r[0] for r in rows]],
            )
            # A tree's counts go with its root blob (a tree stored again is counted again).
            cursor.execute(
                "DELETE FROM tree_counts WHERE company_id = %s AND tree = ANY(%s::text[])",
                [company_id, [r[1] for r in rows]],
            )
        digests = [r[1] for r in rows]
        for backend in _remote_backends():
            # The s3 backend's objects: requests to the store while the rows are locked, on
            # purpose (docs/snapshots.md#collection-and-object-storage): deleted after the
            # commit, an upload re-creating a row and its object in between would lose its
            # bytes. BlobStoreUnavailable rolls the batch back (its rows stay; the next
            # collection tries again), so these go first: the local files, which cannot be
            # put back, are removed only once the store has let go of its objects.
            backend.delete_many(company_id=company_id, digests=digests)
        FilesystemBackend().delete_many(company_id=company_id, digests=digests)
        total = sum(r[2] for r in rows)
        activity_record(
            company_id=company_id,
            actor_type="system",
            actor_id="cas_collect",
            action=AUDIT_ACTION,
            entity_type="company",
            entity_id=company_id,
            details={
                "collection_id": collection_id,
                "batch": number,
                "deleted": len(rows),
                "bytes": total,
            },
        )
    return len(rows), total


def _remote_backends() -> list[BlobBackend]:
    """The stores beside the two built-in ones whose bytes a deleted row takes with it: the
    configured s3 backend, and the s3 bucket that is configured while another backend is in
    use (a move to or from it, `cas_migrate`: its copies of collected blobs go too)."""
    backend = blob_backend()
    if isinstance(backend, FilesystemBackend | PostgresBackend):
        if not settings.PAPERCLIP_CAS_S3_BUCKET:
            return []
        from paperclip.snapshots.store.s3 import S3Backend  # obstore: imported when needed

        return [S3Backend()]
    return [backend]


def cas_collect(
    *,
    batch_size: int,
    progress: Callable[[CollectProgress], None] | None = None,
    dry_run: bool = False,
) -> CollectSummary:
    """Delete every company's blobs that are older than PAPERCLIP_CAS_GRACE_SECONDS (both
    `created_at` and `referenced_at`, database clock) and unreachable from its roots (module
    docstring), `batch_size` rows per transaction. A company with a root that cannot be walked
    as a tree is skipped whole (logged). Calls `progress` after each company's reachability
    pass (`reached`) and after each batch (`deleted`). Locks: the batch's rows, `SKIP LOCKED`
    (a row an upload or a registration holds is young by the time it commits). Writes one
    audit row (`cas.blobs_collected`, actor system) per batch that deleted something, in its
    transaction, sharing the collection's `collection_id`."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    grace = int(settings.PAPERCLIP_CAS_GRACE_SECONDS)
    collection_id = str(uuid.uuid4())
    companies = _companies_with_old_blobs(grace)
    skipped: list[UUID] = []
    reasons: dict[str, str] = {}
    candidates_total = deleted_total = bytes_total = batches = 0
    by_company: dict[str, int] = {}
    for company_id in companies:
        old = _old_blobs(company_id, grace)
        try:
            reachable = cas_reachable(company_id, grace)
        except trees.TreeInvalid as exc:
            logger.warning(
                "cas collection skips company %s: a root cannot be walked (%s)", company_id, exc
            )
            skipped.append(company_id)
            reasons[str(company_id)] = str(exc)
            continue
        candidates = [blob_id for blob_id, digest in old if digest not in reachable]
        candidates_total += len(candidates)
        if progress is not None:
            progress(
                CollectProgress(
                    company_id=company_id,
                    phase="reached",
                    reachable=len(reachable),
                    candidates=len(candidates),
                )
            )
        if dry_run:
            by_company[str(company_id)] = len(candidates)
            continue
        for start in range(0, len(candidates), batch_size):
            batches += 1
            deleted, size = _delete_batch(
                company_id=company_id,
                ids=candidates[start : start + batch_size],
                grace=grace,
                collection_id=collection_id,
                number=batches,
            )
            deleted_total += deleted
            bytes_total += size
            if deleted:
                by_company[str(company_id)] = by_company.get(str(company_id), 0) + deleted
            if progress is not None:
                progress(
                    CollectProgress(
                        company_id=company_id,
                        phase="deleted",
                        batch=batches,
                        deleted=deleted,
                        bytes=size,
                    )
                )
    return CollectSummary(
        dry_run=dry_run,
        companies=len(companies),
        skipped_companies=tuple(skipped),
        skip_reasons=reasons,
        candidates=candidates_total,
        deleted=deleted_total,
        bytes=bytes_total,
        batches=batches,
        by_company=by_company,
    )
