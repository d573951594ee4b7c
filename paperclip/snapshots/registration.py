"""Snapshot registration's core: checking a run's tree and storing its snapshot row
(docs/snapshots.md#registering-a-snapshot). The fence around it is the caller's: the runtime
lease's, in `leases.services.snapshots`, which opens the transaction and calls the `_in_tx`
steps here.

The tree is read and validated outside the transaction (it may be large). When the workspace's
head is a tree registered with its counts, only the directories where the two differ are read
(`changes.walk_changes`) and only the blobs the head does not reach are pinned: the head's are
whole and stay so (docs/snapshots.md#registering-against-the-head), which the transaction
re-checks under the company's roots lock, held shared until the commit, so no collection reads
its roots between this check and the snapshot's existence. Otherwise the whole tree is walked
and every blob it reaches pinned. Inside the transaction the blobs to pin are touched
(`referenced_at = now()`), which both proves they are stored and keeps the collector away from
them (docs/snapshots.md#collection). Nothing is written on any error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final
from uuid import UUID

from django.conf import settings

from paperclip.db.advisory import advisory_xact_lock_shared
from paperclip.db.locking import require_transaction
from paperclip.errors import ConflictError, DomainError, InvalidRequest
from paperclip.models import ExecutionWorkspace, RunSnapshot
from paperclip.snapshots.collect import roots_lock_key
from paperclip.snapshots.counts import counts_against_head
from paperclip.snapshots.store.names import BlobTooLarge
from paperclip.snapshots.store.pins import cas_pin
from paperclip.snapshots.store.reads import cas_rows, directory_loader
from paperclip.snapshots.trees import (
    BLOB_NAME,
    RESERVED_ROOT_NAMES,
    TreeInvalid,
    Walk,
    decode_stored_dir,
    walk,
)

MAX_MISSING_LISTED: Final = 1000


class SnapshotTreeInvalid(DomainError):
    """A snapshot's tree breaks the tree rules (docs/snapshots.md#trees)."""

    code = "snapshot_tree_invalid"
    message = "The snapshot's tree is malformed."
    status_code = 400
    remediation = "Fix the entry named by details.path (details.reason says what is wrong)."


class SnapshotBlobsMissing(ConflictError):
    """Blobs the tree reaches are not in the company's store."""

    code = "snapshot_blobs_missing"
    message = "Some blobs the snapshot's tree reaches are not stored."
    remediation = "Upload the blobs in details.missing, then register the snapshot again."


@dataclass(frozen=True, slots=True)
class SnapshotRegistration:
    snapshot: RunSnapshot
    created: bool  # False for a repeat of the same tree


@dataclass(frozen=True, slots=True)
class SnapshotTarget:
    """What is registered: `tree` for run `run_id` of workspace `workspace_id`, started from
    `base`, under lease generation `generation`."""

    company_id: UUID
    run_id: UUID
    workspace_id: UUID
    tree: str
    base: str | None
    generation: int


@dataclass(frozen=True, slots=True)
class RegistrationPlan:
    """What a registration pins and records. `head`: the head whose blobs it trusts (None:
    it trusts nothing and pins every blob the tree reaches)."""

    pin: list[str]
    files: int
    bytes: int
    entries: int
    head: str | None = None
    # The size each file read names its blob with, and the chunked files by path: checked
    # against the stored sizes in the pinning statement (the files the plan read only; those
    # it shares with the head were checked when the head was registered).
    sizes: dict[str, int] = field(default_factory=dict)
    chunked: dict[str, tuple[int, tuple[str, ...]]] = field(default_factory=dict)


class _OtherSize(Exception):
    """A file names `digest` with a size it is not stored with: refused once the transaction
    is rolled back, with the file's path (found by reading the tree again)."""

    def __init__(self, digest: str) -> None:
        super().__init__(digest)
        self.digest = digest


class _HeadMoved(Exception):
    """The head a plan trusts is no longer the head: plan again without it."""


def snapshot_input_check(*, company_id: UUID, tree: str, base: str | None) -> None:
    """The names are blob names and the base (when given) a directory tree of the company's
    store; the tree's root does not name the agent CLI's state directory. Raises
    InvalidRequest, SnapshotTreeInvalid (`reserved_name`)."""
    _name("tree", tree)
    _name("base", base)
    _require_base_tree(company_id, base)
    _refuse_reserved_names(company_id, tree)


# What the agents' CLI keeps in a workdir's root, which a checkout never writes (its index):
# a head naming it would stop every CLI's checkout of the workspace.


def _refuse_reserved_names(company_id: UUID, tree: str) -> None:
    """SnapshotTreeInvalid when the tree's root directory (if stored and valid: the walk
    refuses it otherwise, with its reason) names a reserved entry."""
    try:
        stored = directory_loader(company_id)([tree])
        entries = decode_stored_dir(stored[tree], tree) if tree in stored else ()
    except (TreeInvalid, BlobTooLarge):
        return
    for entry in entries:
        if entry.name in RESERVED_ROOT_NAMES:
            raise SnapshotTreeInvalid(path=entry.name, reason="reserved_name")


def snapshot_register(
    target: SnapshotTarget,
    *,
    attempt: Callable[[RegistrationPlan], SnapshotRegistration],
) -> SnapshotRegistration:
    """Register `target.tree`: plan against the workspace's head when it can vouch for the
    tree (else from the whole walk) and hand the plan to `attempt`, the caller's transaction,
    which calls `registration_head_hold_in_tx` first and `snapshot_record_in_tx` once its own
    checks pass. A head moved meanwhile makes the whole plan and a second attempt. Raises
    SnapshotTreeInvalid (400), SnapshotBlobsMissing (409), and whatever `attempt` raises."""
    company_id = target.company_id
    plan = _plan_against_head(
        company_id=company_id, workspace_id=target.workspace_id, tree=target.tree
    )
    try:
        if plan is not None:
            try:
                return attempt(plan)
            except _HeadMoved:
                pass  # another run published meanwhile: trust nothing this time
        return attempt(_plan_whole(company_id=company_id, tree=target.tree))
    except _OtherSize as exc:  # the caller's locks are let go before the tree is read again
        path = _file_naming(company_id, target.tree, exc.digest)
        raise SnapshotTreeInvalid(path=path, reason="size_mismatch") from None


def registration_head_hold_in_tx(plan: RegistrationPlan, *, target: SnapshotTarget) -> None:
    """For a plan that trusts the head: hold the company's roots lock shared until the commit
    (an advisory lock: take it before any row lock), then check (in a statement of its own,
    so with a snapshot taken after the lock) that the plan's head is still the head."""
    require_transaction()
    if plan.head is None:
        return
    advisory_xact_lock_shared(roots_lock_key(target.company_id))
    if _head(target.workspace_id) != plan.head:
        raise _HeadMoved


def snapshot_record_in_tx(
    plan: RegistrationPlan, *, target: SnapshotTarget
) -> SnapshotRegistration:
    """Pin the plan's blobs (and the base's own) and write the snapshot row, in the caller's
    transaction; a repeat of the run's registered tree from the same base writes nothing.
    Locks the rows of the blobs to pin. Raises InvalidRequest (the tree registered from
    another base), SnapshotBlobsMissing, SnapshotTreeInvalid."""
    require_transaction()
    existing = RunSnapshot.objects.filter(run_id=target.run_id, tree=target.tree).first()
    if existing is not None and existing.base == target.base:
        return SnapshotRegistration(existing, created=False)
    if existing is not None:
        raise InvalidRequest(
            "This run registered the tree already, from another base.",
            fields={"base": [f"The tree was registered with base {existing.base}."]},
        )
    # The base's own blob only: publishing reads the base's directories to merge, and a base
    # collected meanwhile is merged as an empty tree, which holds overlapping paths for the
    # board rather than losing anything (docs/snapshots.md#merging).
    base = target.base
    pin = sorted({*plan.pin, *([base] if base is not None else [])})
    pinned = cas_pin(company_id=target.company_id, digests=pin, sizes=plan.sizes)
    _raise_missing(pinned.missing)
    _raise_other_size(target.company_id, pinned.other_size, plan.chunked)
    snapshot = RunSnapshot.objects.create(
        company_id=target.company_id,
        run_id=target.run_id,
        execution_workspace_id=target.workspace_id,
        tree=target.tree,
        base=base,
        files=plan.files,
        bytes=plan.bytes,
        entries=plan.entries,
        lease_generation=target.generation,
    )
    return SnapshotRegistration(snapshot, created=True)


def snapshot_walk(*, company_id: UUID, tree: str) -> Walk:
    """Read and validate `tree` from the company's store (its directories a level per query,
    repeats from the per-process cache); `missing` lists the directory blobs that are not
    stored. File contents are not looked up here: registration checks them on the rows. Its
    `entries` hold directories and symlinks only (a web process registering a 50,000-file
    tree keeps no entry per file). Raises SnapshotTreeInvalid."""
    try:
        return walk(
            tree,
            load_many=directory_loader(company_id),
            max_entries=settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES,
            max_path_bytes=settings.PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES,
            max_symlink_steps=settings.PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS,
            keep_files=False,  # registration needs the counts and the blobs, not the paths
        )
    except TreeInvalid as exc:
        raise SnapshotTreeInvalid(path=exc.path, reason=exc.reason) from exc


def _head(workspace_id: UUID) -> str | None:
    return (
        ExecutionWorkspace.objects.filter(pk=workspace_id)
        .values_list("head_tree", flat=True)
        .first()
    )


def _plan_against_head(
    *, company_id: UUID, workspace_id: UUID, tree: str
) -> RegistrationPlan | None:
    """Plan from the differences with the workspace's head, when the head is a registered
    tree whose counts are known and the comparison can vouch for the tree (None otherwise)."""
    head = _head(workspace_id)
    if not head:
        return None
    # None also for a head whose counts are not known (registered before counts were kept,
    # or set by hand).
    found = counts_against_head(
        company_id=company_id, tree=tree, head=head, load_many=directory_loader(company_id)
    )
    if found is None:
        return None
    counts, changes = found
    if counts.entries > settings.PAPERCLIP_SNAPSHOT_MAX_ENTRIES:
        return None  # the whole walk names the entry past the limit
    return RegistrationPlan(
        pin=sorted(changes.new),
        files=counts.files,
        bytes=counts.bytes,
        entries=counts.entries,
        head=head,
        sizes=changes.sizes,
        chunked=changes.chunked,
    )


def _plan_whole(*, company_id: UUID, tree: str) -> RegistrationPlan:
    walked = snapshot_walk(company_id=company_id, tree=tree)
    _raise_missing(walked.missing)
    return RegistrationPlan(
        pin=sorted(walked.reached()),
        files=walked.files,
        bytes=walked.bytes,
        entries=walked.count,
        sizes=walked.sizes,
        chunked=walked.chunked,
    )


def _name(field: str, value: str | None) -> None:
    if value is not None and not BLOB_NAME.fullmatch(value):
        raise InvalidRequest(fields={field: ["A blob name: sha256: and 64 lowercase hex digits."]})


def _require_base_tree(company_id: UUID, base: str | None) -> None:
    """A base is null or a directory tree of the company's store (its root directory blob;
    the base's other directories are read by publishing, which merges a collected one as
    empty)."""
    if base is None:
        return
    try:
        stored = directory_loader(company_id)([base])
        if base in stored:
            decode_stored_dir(stored[base], base)
            return
    except (TreeInvalid, BlobTooLarge):
        pass
    raise InvalidRequest(
        "The base is not a directory tree of this company's store.",
        fields={"base": ["Null, or the tree the run's checkout fetched (a stored directory)."]},
    )


def _raise_other_size(
    company_id: UUID,
    other_size: list[str],
    chunked: dict[str, tuple[int, tuple[str, ...]]],
) -> None:
    """SnapshotTreeInvalid(path, "size_mismatch") for a chunked file whose size is not its
    stored chunks' sum, and _OtherSize for a file whose blob is stored with another size
    (`other_size`: the blobs the pin found so; its path is looked for after the rollback). In
    the caller's transaction: the chunks are pinned and stored by now."""
    if other_size:
        raise _OtherSize(other_size[0])
    if not chunked:
        return
    stored = cas_rows(
        company_id=company_id, digests={c for _, chunks in chunked.values() for c in chunks}
    )
    for path, (size, chunks) in sorted(chunked.items()):
        if sum(stored[c][1] if c in stored else 0 for c in chunks) != size:
            raise SnapshotTreeInvalid(path=path, reason="size_mismatch")


def _file_naming(company_id: UUID, tree: str, digest: str) -> str:
    """The path of a file of `tree` naming `digest` with a size it is not stored with (the
    error's path: read again, with every file, only on this refusal)."""
    try:
        walked = walk(tree, load_many=directory_loader(company_id))
    except TreeInvalid as exc:
        return exc.path  # the same blob named with two sizes: the whole walk names the file
    stored = cas_rows(company_id=company_id, digests=[digest]).get(digest)
    return next(
        (
            path
            for path, entry in walked.entries.items()
            if entry.type == "file"
            and entry.digest == digest
            and (stored is None or entry.size != stored[1])
        ),
        "",
    )


def _raise_missing(missing: list[str]) -> None:
    if missing:
        unique = list(dict.fromkeys(missing))
        raise SnapshotBlobsMissing(missing=unique[:MAX_MISSING_LISTED], count=len(unique))
