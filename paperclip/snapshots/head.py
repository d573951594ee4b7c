"""Publishing a run's snapshot as its workspace's head, and materializing the head into the
workspace's `cwd` (docs/snapshots.md#publishing).

The head moves only in the transaction that commits the run, by compare-and-set on the head
the plan was made against: a publisher that lost the race plans again. The plan is made
outside that transaction (trees are read from the store): the head still equal to the run's
`base` becomes the run's tree; a head another run moved is merged path by path with the run's
changes since `base` (`paperclip.snapshots.merge`), and overlapping changes are held for the
board (`workspace_head_conflict`) instead of published.

Materialization follows the head, not the run: `cwd_tree` records what the `cwd` holds, and a
job (one at a time per workspace, under an advisory lock on a dedicated connection) makes the
`cwd` equal to the head, touching only what differs. `cwd_tree` is marked unknown before the
first write, so a crash or a failure part way leaves it unknown and the next attempt (the job
retried, or the reconciler's) compares the head with the disk.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import stat
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, BinaryIO, Final, Literal
from uuid import UUID

import psycopg
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models.functions import Now

from paperclip.activity import activity_record
from paperclip.db.advisory import dedicated_connection
from paperclip.db.locking import require_transaction
from paperclip.models import ExecutionWorkspace
from paperclip.snapshots.behind import (
    FAILURE_CLEARED,
    MaterializeFailure,
    behind_head,
    due_for_attempt,
    materialize_defer_in_tx,
    materialize_failure_record,
)
from paperclip.snapshots.changes import KnownPair, decode_known_pair
from paperclip.snapshots.counts import (
    counts_against_head,
    counts_of,
    known_valid_trees,
    tree_counts_record,
)
from paperclip.snapshots.history import head_published_record_in_tx
from paperclip.snapshots.materialize import MaterializeReport, materialize
from paperclip.snapshots.merge import merge3, merge_trees, unknown_base
from paperclip.snapshots.processes import Processes
from paperclip.snapshots.store.ahead import ReadAhead
from paperclip.snapshots.store.backends import blob_file
from paperclip.snapshots.store.reads import (
    ChunkStream,
    cas_blob_file,
    cas_open,
    cas_rows,
    directory_loader,
)
from paperclip.snapshots.store.uploads import cas_store_blobs
from paperclip.snapshots.trees import (
    RESERVED_ROOT_NAMES,
    Entry,
    TreeInvalid,
    build,
    check_symlinks,
    decode_dir,
    decode_known_dir,
    walk,
)

logger = logging.getLogger(__name__)

PUBLISHER: Final = "workspace_publisher"


class PublishError(Exception):
    """Publishing cannot proceed now (a tree unreadable from the store): retried later."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class HeadMoved(Exception):
    """Another run moved the head after the plan was made: plan again."""


type PublishKind = Literal[
    "fast_forward", "merged", "unchanged", "conflict", "resolved", "discarded"
]


@dataclass(frozen=True, slots=True)
class PublishPlan:
    kind: PublishKind
    workspace_id: UUID
    tree: str  # the run's snapshot
    base: str | None
    expected_head: str | None  # the head the plan was made against
    new_head: str | None
    conflicts: tuple[str, ...] = field(default_factory=tuple)
    conflict_count: int = 0
    resolution: str | None = None  # the board's, for a resolved conflict
    decided_head: str | None = None  # the head the board decided against
    action_id: UUID | None = None  # the board's conflict hold, for a resolved conflict
    decided_by: str | None = None  # the board member who resolved it

    def as_json(self) -> dict[str, Any]:
        shown = {
            "kind": self.kind,
            "tree": self.tree,
            "base": self.base,
            "previousHead": self.expected_head,
            "head": self.new_head,
            "conflictCount": self.conflict_count,
        }
        if self.resolution is not None:
            shown |= {"resolution": self.resolution, "decidedHead": self.decided_head}
        return shown


def tree_entries(company_id: UUID, tree: str | None) -> dict[str, Entry]:
    """The entries of a stored tree by path (an empty dict for None). Raises PublishError when
    a directory blob is gone or the tree breaks a rule."""
    if tree is None:
        return {}
    known = tree in known_valid_trees(company_id=company_id, trees=[tree])
    try:
        walked = walk(tree, load_many=directory_loader(company_id), known_valid=known)
    except TreeInvalid as exc:
        raise PublishError("snapshot_tree_invalid", f"tree {tree}: {exc}") from exc
    if walked.missing:
        raise PublishError(
            "snapshot_blobs_missing", f"tree {tree}: {len(walked.missing)} blob(s) not stored"
        )
    return walked.entries


type Alike = dict[str, list[dict[str, Any]]]


def tree_diff_entries(
    company_id: UUID, target: str, previous: str | None
) -> tuple[dict[str, Entry], dict[str, Entry] | None, Alike]:
    """The entries materialization needs to take a directory from `previous` to `target`:
    both trees read together level by level, descending only into directories whose blob
    differs between them (an unchanged subtree is one entry, its directory, on both sides),
    so a small change costs a few directory reads, not the whole tree. The regular files such
    a directory holds alike in both known valid trees are apart, by their directory's path,
    as their blobs' JSON objects (`materialize`'s `alike`). Without a readable `previous`,
    the whole target, None and nothing apart. Raises PublishError as `tree_entries`."""
    if previous is None:
        return tree_entries(company_id, target), None, {}
    load_many = directory_loader(company_id)
    # Both trees are normally known valid (a head is registered or built by the publisher):
    # their directories are then decoded without the checks they passed when recorded.
    known = known_valid_trees(company_id=company_id, trees=[target, previous])
    ours: dict[str, Entry] = {}
    theirs: dict[str, Entry] = {}
    alike: Alike = {}
    level: list[tuple[str, str, str | None]] = [("", target, previous)]
    while level:
        stored = load_many(sorted({d for _, t, p in level for d in (t, p) if d}))
        following: list[tuple[str, str, str | None]] = []
        for path, digest, before in level:
            if digest not in stored or (before is not None and before not in stored):
                if path == "" and digest in stored:
                    return tree_entries(company_id, target), None, {}  # previous collected
                raise PublishError(
                    "snapshot_blobs_missing", f"tree {target}: directory {path or '/'} gone"
                )
            try:
                pair = _decoded_pair(
                    stored[digest],
                    None if before is None else stored[before],
                    path,
                    (target in known, previous in known),
                )
            except TreeInvalid as exc:
                raise PublishError("snapshot_tree_invalid", f"tree {target}: {exc}") from exc
            now, then = pair.now, pair.then
            if pair.alike:
                alike[path] = pair.alike
            earlier = {entry.name: entry for entry in then}
            for entry in then:
                theirs[f"{path}/{entry.name}" if path else entry.name] = entry
            for entry in now:
                where = f"{path}/{entry.name}" if path else entry.name
                ours[where] = entry
                old = earlier.get(entry.name)
                if entry.type != "dir" or (old is not None and old.same_dir(entry)):
                    continue  # a file, a symlink, or a directory whose content is unchanged
                assert entry.digest is not None  # noqa: S101 - decode_dir checked it
                gone = old.digest if old is not None and old.type == "dir" else None
                following.append((where, entry.digest, gone))
        level = following
    try:
        check_symlinks(ours)
    except TreeInvalid as exc:
        raise PublishError("snapshot_tree_invalid", f"tree {target}: {exc}") from exc
    return ours, theirs, alike


def _decoded_pair(
    data: bytes, before: bytes | None, path: str, known: tuple[bool, bool]
) -> KnownPair:
    """The directory blob at `path` of the target and of the previous tree (`before`; None
    when that has none there), each known valid or not (`known`)."""
    if before is not None and all(known):
        return decode_known_pair(data, before, path)
    now = (decode_known_dir if known[0] else decode_dir)(data, path)
    then = () if before is None else (decode_known_dir if known[1] else decode_dir)(before, path)
    return KnownPair(now, then, [])


def _store(company_id: UUID, blobs: dict[str, bytes]) -> None:
    cas_store_blobs(company_id=company_id, blobs=blobs)


def publish_plan(
    *,
    company_id: UUID,
    workspace_id: UUID,
    tree: str,
    base: str | None,
    resolution: Literal["merge", "discard"] = "merge",
) -> PublishPlan:
    """What committing the run will do to the head, read now (no lock): fast-forward, merge
    (the merged tree's directories are stored here), nothing, or a conflict. `discard` is the
    board's answer to an earlier conflict that leaves the head as it is (the board's merging
    answers are planned by `paperclip.snapshots.resolutions.resolution_plan`)."""
    head = (
        ExecutionWorkspace.objects.filter(pk=workspace_id, company_id=company_id)
        .values_list("head_tree", flat=True)
        .first()
    )

    def plan(
        kind: PublishKind, new_head: str | None, conflicts: tuple[str, ...] = (), count: int = 0
    ) -> PublishPlan:
        return PublishPlan(
            kind=kind,
            workspace_id=workspace_id,
            tree=tree,
            base=base,
            expected_head=head,
            new_head=new_head,
            conflicts=conflicts,
            conflict_count=count,
        )

    if resolution == "discard":
        return plan("discarded", head)
    if head == tree:
        return plan("unchanged", head)
    if head == base:
        return plan("fast_forward", tree)
    if head is not None and (
        by_directory := merge_trees(
            base,
            tree,
            head,
            load_many=directory_loader(company_id),
            known_valid=base is not None
            and {base, tree, head}
            <= known_valid_trees(company_id=company_id, trees=[base, tree, head]),
        )
    ):
        _store(company_id, by_directory.blobs)
        _count_merged(company_id, by_directory.root, head)
        return plan("merged", by_directory.root)
    # A conflict, a symlink changed, or a base gone: the whole trees, path by path.
    ours, theirs = tree_entries(company_id, tree), tree_entries(company_id, head)
    try:
        based = tree_entries(company_id, base)
    except PublishError:
        based = unknown_base(ours, theirs)  # collected while the run worked: every difference
    merged = merge3(based, ours, theirs)
    if merged.entries is None:
        return plan("conflict", None, merged.conflicts, merged.conflict_count)
    try:
        # Each side's links stayed inside its own tree; together they may not (one side's
        # link through a directory the other side turned into a link).
        check_symlinks(merged.entries)
    except TreeInvalid as exc:
        return plan("conflict", None, (exc.path,), 1)
    root, blobs = build(merged.entries)
    _store(company_id, blobs)
    # The next run registers against this head by difference, as against a registered tree.
    tree_counts_record(company_id=company_id, tree=root, counts=counts_of(merged.entries))
    return plan("merged", root)


def _count_merged(company_id: UUID, merged: str, head: str) -> None:
    """Record the counts of a tree merged by directory, from the head's and the difference
    (not recorded when the head has none: the next registration then walks the whole tree;
    nor if the comparison gives up, which both sides' symlinks being the base's rule out)."""
    found = counts_against_head(
        company_id=company_id, tree=merged, head=head, load_many=directory_loader(company_id)
    )
    if found is not None:
        tree_counts_record(company_id=company_id, tree=merged, counts=found[0])


def _cwd_filled(cwd: str | None) -> bool:
    """Whether the cwd holds anything (the agent CLI's state directory aside). Asked under
    the workspace row's lock (a copy-back's commit takes it too) when a first head moves:
    the publish adopted the cwd empty, and a legacy copy-back that committed since wrote its
    files there, in no tree; a first head moved over them would have the next
    materialization remove them."""
    if not cwd:
        return False
    try:
        names = os.listdir(cwd)
    except OSError:
        return False
    return any(name not in RESERVED_ROOT_NAMES for name in names)


def head_publish_in_tx(*, company_id: UUID, run_id: UUID, plan: PublishPlan) -> bool:
    """Move the head to `plan.new_head` if it still is `plan.expected_head` (HeadMoved
    otherwise); defers the materialization when the workspace has a cwd. Returns whether the
    head changed. Audited when it did."""
    require_transaction()
    if plan.new_head == plan.expected_head:
        # Nothing to move, but the head must still be what the plan saw (None: IS NULL).
        if (
            plan.kind != "discarded"
            and not ExecutionWorkspace.objects.filter(
                pk=plan.workspace_id, head_tree=plan.expected_head
            ).exists()
        ):
            raise HeadMoved
        return False
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE execution_workspaces SET head_tree = %s, head_run_id = %s,"
            " head_committed_at = now(), updated_at = now()"
            " WHERE id = %s AND company_id = %s AND head_tree IS NOT DISTINCT FROM %s"
            " RETURNING cwd",
            [plan.new_head, run_id, plan.workspace_id, company_id, plan.expected_head],
        )
        row = cursor.fetchone()
    if row is None:
        raise HeadMoved
    if plan.expected_head is None and _cwd_filled(row[0]):
        # The row is locked now: planned again (the transaction rolls back), after adopting
        # what the cwd holds.
        raise HeadMoved
    activity_record(
        company_id=company_id,
        actor_type="system",
        actor_id=PUBLISHER,
        action="workspace.head_published",
        entity_type="execution_workspace",
        entity_id=plan.workspace_id,
        run_id=run_id,
        details=plan.as_json(),
    )
    assert plan.new_head is not None  # noqa: S101 - only a conflict has no new head
    head_published_record_in_tx(
        company_id=company_id,
        workspace_id=plan.workspace_id,
        run_id=run_id,
        plan_kind=plan.kind,
        tree=plan.new_head,
        previous_tree=plan.expected_head,
        action_id=plan.action_id,
        decided_by=plan.decided_by,
    )
    if row[0]:
        materialize_defer_in_tx(workspace_id=plan.workspace_id)
    return True


def materializations_reconcile() -> int:
    """Defer a materialization for every workspace whose cwd is behind its head (a crash part
    way, a lost job, a failure whose back-off has passed: one still backing off waits for its
    `materialize_next_at`); returns how many were deferred."""
    behind = list(
        due_for_attempt(behind_head(ExecutionWorkspace.objects.all())).values_list("pk", flat=True)
    )
    deferred = 0
    for workspace_id in behind:
        with transaction.atomic(durable=True):
            if materialize_defer_in_tx(workspace_id=workspace_id) is not None:
                deferred += 1
    return deferred


@dataclass(frozen=True, slots=True)
class MaterializeOutcome:
    status: Literal["materialized", "current", "busy", "no_cwd", "failed"]
    tree: str | None = None
    report: MaterializeReport | None = None
    rounds: int = 0
    error: str | None = None  # failed: what went wrong, recorded on the workspace
    failure: MaterializeFailure | None = None  # failed: attempts in a row, the next one's time


def _without_special_bits(entries: dict[str, Entry]) -> dict[str, Entry]:
    """Permission bits only: an agent's tree never makes a setuid, setgid or sticky entry in a
    cwd written by a worker that may run as root."""
    if all(entry.mode <= 0o777 for entry in entries.values()):
        return entries  # the common case: the comprehension below would change nothing
    return {
        path: entry
        if entry.type == "symlink" or entry.mode <= 0o777
        else replace(entry, mode=entry.mode & 0o777)
        for path, entry in entries.items()
    }


def materialize_lock_key(workspace_id: UUID) -> str:
    return f"workspace-materialize:{workspace_id}"


def workspace_materialize(
    *, workspace_id: UUID, on_round: Callable[[str], None] | None = None
) -> MaterializeOutcome:
    """Make the workspace's cwd hold its head, until it does (the head may move meanwhile).

    One materializer per workspace: a transaction-scoped advisory lock held on a dedicated
    connection for the whole work (`busy` when another holds it: that one carries on to the
    head). Each round diffs the head against `cwd_tree` (what the cwd last held), writes only
    what changed, then records the new `cwd_tree` (audited). Before its first write a round
    marks `cwd_tree` unknown (audited), so a crash or a failure part way leaves it unknown
    (the cwd may hold part of the target) and the next attempt compares with the disk,
    whatever the head is by then.
    """
    with dedicated_connection(application_name="paperclip-materialize") as lock:
        outcome = _materialize_holding(lock, workspace_id=workspace_id, on_round=on_round)
        # The lock's transaction ends here, not with the connection's close: the server frees
        # the lock once it has answered the rollback, while a closed connection's backend may
        # hold it a moment longer, and an attempt made right after this one (a retry of a
        # failure) would find it `busy`. Not after an exception: the connection may be gone.
        lock.rollback()
    return outcome


def _materialize_holding(
    lock: psycopg.Connection[Any],
    *,
    workspace_id: UUID,
    on_round: Callable[[str], None] | None,
) -> MaterializeOutcome:
    """`workspace_materialize`'s work while its connection `lock` is open."""
    last: MaterializeOutcome = MaterializeOutcome("current")
    held = lock.execute(
        "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0))",
        [materialize_lock_key(workspace_id)],
    ).fetchone()
    if not held or not held[0]:
        return MaterializeOutcome("busy")

    def check() -> None:
        lock.execute("SELECT 1")  # raises when the lock connection is gone

    for rounds in range(1, 101):
        row = (
            ExecutionWorkspace.objects.filter(pk=workspace_id)
            .values("company_id", "cwd", "head_tree", "cwd_tree")
            .first()
        )
        if row is None or not row["cwd"]:
            return MaterializeOutcome("no_cwd")
        head, previous_tree = row["head_tree"], row["cwd_tree"]
        if head is None or head == previous_tree:
            return last if rounds > 1 else MaterializeOutcome("current", tree=head)
        company_id: UUID = row["company_id"]
        if previous_tree is not None and not _cwd_unknown_while_writing(
            company_id=company_id,
            workspace_id=workspace_id,
            cwd=row["cwd"],
            tree=head,
            previous_tree=previous_tree,
        ):
            continue  # the row changed meanwhile: read it again
        if on_round is not None:
            on_round(head)
        try:
            report = _materialize_round(
                company_id=company_id,
                cwd=row["cwd"],
                head=head,
                previous_tree=previous_tree,
                check=check,
            )
        except (DatabaseError, psycopg.Error):
            raise  # the database or the lock's connection is gone: the job is retried
        except Exception as exc:
            error = _describe(exc)
            logger.warning("materializing %s into %s failed: %s", head, row["cwd"], error)
            failure = materialize_failure_record(
                company_id=company_id,
                workspace_id=workspace_id,
                tree=head,
                previous_tree=previous_tree,
                cwd=row["cwd"],
                error=error,
            )
            return MaterializeOutcome(
                "failed", tree=head, rounds=rounds, error=error, failure=failure
            )
        with transaction.atomic(durable=True):
            # Only while the cwd is still marked unknown by this round (an adoption that
            # recorded another tree meanwhile wins); a success clears the failure recorded
            # by an earlier attempt.
            updated = ExecutionWorkspace.objects.filter(
                pk=workspace_id, cwd=row["cwd"], cwd_tree__isnull=True
            ).update(cwd_tree=head, updated_at=Now(), **FAILURE_CLEARED)
            if updated:
                activity_record(
                    company_id=company_id,
                    actor_type="system",
                    actor_id=PUBLISHER,
                    action="workspace.materialized",
                    entity_type="execution_workspace",
                    entity_id=workspace_id,
                    details={
                        "tree": head,
                        "previousTree": previous_tree,
                        "cwd": row["cwd"],
                        **asdict(report),
                    },
                )
        last = MaterializeOutcome("materialized", tree=head, report=report, rounds=rounds)
    return last


def _cwd_unknown_while_writing(
    *, company_id: UUID, workspace_id: UUID, cwd: str, tree: str, previous_tree: str
) -> bool:
    """Mark the cwd's tree unknown (null) before the first write, in its own committed
    transaction with one `workspace.materialize_started` audit row: a process killed part way
    then leaves no `cwd_tree` claiming what the disk no longer holds, and the next attempt
    compares with the disk (a head moved back to `previous_tree` is written back). False when
    the row no longer holds `previous_tree` for `cwd`."""
    with transaction.atomic(durable=True):
        updated = ExecutionWorkspace.objects.filter(
            pk=workspace_id, cwd=cwd, cwd_tree=previous_tree
        ).update(cwd_tree=None, updated_at=Now())
        if updated:
            activity_record(
                company_id=company_id,
                actor_type="system",
                actor_id=PUBLISHER,
                action="workspace.materialize_started",
                entity_type="execution_workspace",
                entity_id=workspace_id,
                details={"tree": tree, "previousTree": previous_tree, "cwd": cwd},
            )
    return bool(updated)


def _materialize_round(
    *,
    company_id: UUID,
    cwd: str,
    head: str,
    previous_tree: str | None,
    check: Callable[[], None],
) -> MaterializeReport:
    """Make `cwd` hold `head`, diffed against `previous_tree` (what it last held). A directory
    the diff did not descend into (the same blob in both trees) that is no longer a directory
    in `cwd` (removed by hand) makes it the whole head against the disk: the diff has none of
    its entries to write back."""
    whole, before, alike = tree_diff_entries(company_id, head, previous_tree)
    if before is not None and _unexpanded_gone(cwd, whole, before):
        whole, before, alike = tree_entries(company_id, head), None, {}
    target = _without_special_bits(whole)
    previous = _without_special_bits(before) if before is not None else None
    # One query for the rows of every blob the materializer may write, not one per file
    # (50,000 files: 50,000 round trips to PostgreSQL).
    order = list(_to_write(target, previous))
    known = cas_rows(company_id=company_id, digests=order)
    # A store whose reads are round trips (s3): the small blobs fetched a window at a time,
    # several in flight, instead of one request after the other.
    ahead = (
        ReadAhead(company_id=company_id, order=order, rows=known) if ReadAhead.wanted() else None
    )

    def open_blob(digest: str) -> BinaryIO:
        data = ahead.take(digest) if ahead is not None else None
        if data is not None:
            return io.BytesIO(data)  # checked against its name when it was fetched
        file = cas_blob_file(company_id=company_id, digest=digest, known=known)
        if file is not None:
            return file  # the store's own file: materialize copies it in the kernel
        reader = cas_open(company_id=company_id, digest=digest, known=known)
        if reader is None:
            raise PublishError("snapshot_blobs_missing", f"blob {digest} not stored")
        return io.BufferedReader(ChunkStream(reader.chunks), 1 << 20)

    return materialize(
        destination=cwd,
        target=target,
        previous=previous,
        alike=alike,
        open_blob=open_blob,
        check=check,
        split=_processes(company_id, known) if ahead is None else None,
    )


def _unexpanded_gone(cwd: str, target: Mapping[str, Entry], previous: Mapping[str, Entry]) -> bool:
    """Whether a directory both trees hold with the same blob (so not expanded) is missing
    from `cwd` or is something else there, or a directory above it is (one lstat per path,
    each component looked at itself: a directory above it replaced by a link to a place
    holding such a directory would otherwise pass, and the round, replacing the link, would
    make the unexpanded directory anew, empty, while recording the head as the cwd's tree)."""
    seen: dict[str, bool] = {}

    def is_directory(path: str) -> bool:
        if path not in seen:
            try:
                found = os.lstat(os.path.join(cwd, path))
            except OSError:  # missing or unreadable: the whole comparison with the disk decides
                seen[path] = False
            else:
                seen[path] = stat.S_ISDIR(found.st_mode)
        return seen[path]

    for path, entry in target.items():
        if entry.type != "dir":
            continue
        before = previous.get(path)
        if before is None or not before.same_dir(entry):
            continue
        parts = path.split("/")
        if not all(is_directory("/".join(parts[:depth])) for depth in range(1, len(parts) + 1)):
            return True
    return False


def _processes(company_id: UUID, known: Mapping[str, tuple[int, int]]) -> Processes | None:
    """Child processes for a large change, where the blobs are plain files they can open."""
    count = settings.PAPERCLIP_MATERIALIZE_PROCESSES
    if count < 2 or settings.PAPERCLIP_CAS_BACKEND != "filesystem":
        return None

    def path(digest: str) -> str | None:
        return blob_file(company_id, digest) if digest in known else None

    return Processes(
        count=count, blob_file=path, min_files=settings.PAPERCLIP_MATERIALIZE_PROCESSES_MIN_FILES
    )


def _describe(exc: Exception) -> str:
    """An error as the console shows it: its code or class, its message, and the blob or
    path it names (a blob that cannot be read back is named, so the operator knows which)."""
    code = getattr(exc, "code", None)
    text = f"{code if isinstance(code, str) else type(exc).__name__}: {exc}"
    details = getattr(exc, "details", None)
    if isinstance(details, dict):
        named = [
            f"{key} {details[key]}"
            for key in ("digest", "path")
            if details.get(key) and str(details[key]) not in text
        ]
        if named:
            text += f" ({', '.join(named)})"
    return text


def _to_write(target: dict[str, Entry], previous: dict[str, Entry] | None) -> Iterator[str]:
    """The content blobs of the target's files that the previous tree did not hold as such
    (all of them when it is unknown)."""
    for path, entry in target.items():
        if entry.type == "file" and (previous is None or not entry.same_as(previous.get(path))):
            yield from entry.blobs()


def conflict_fingerprint(run_id: UUID, tree: str, head: str | None) -> str:
    return hashlib.sha256(f"{run_id}:{tree}:{head}".encode()).hexdigest()
