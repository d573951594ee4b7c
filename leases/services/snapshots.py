"""Snapshot registration: a run's agent names the tree of its workdir, fenced by the runtime
lease it holds (docs/snapshots.md#registering-a-snapshot).

The tree is read and validated outside the transaction (it may be large). When the workspace's
head is a tree registered with its counts, only the directories where the two differ are read
(`trees.walk_changes`) and only the blobs the head does not reach are pinned: the head's are
whole and stay so (docs/snapshots.md#registering-against-the-head), which the transaction
re-checks under the company's roots lock, held shared until the commit, so no collection reads
its roots between this check and the snapshot's existence. Otherwise the whole tree is walked
and every blob it reaches pinned. Inside the transaction the lease row is share-locked and the
fence checked as for any fenced write, and the blobs to pin are touched (`referenced_at =
now()`), which both proves they are stored and keeps the collector away from them
(docs/snapshots.md#collection). Nothing is written on any error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Final
from uuid import UUID

from django.conf import settings
from django.db import IntegrityError, transaction

from leases import locks
from leases.errors import (
    RuntimeLeaseContended,
    SnapshotBlobsMissing,
    SnapshotTreeInvalid,
)
from leases.services.operations import require_fence
from leases.services.shared import audit, preconditions
from leases.services.types import BUSY_MESSAGE, RuntimeLeaseOwner
from paperclip.db.advisory import advisory_xact_lock_shared
from paperclip.db.locking import busy_on_lock_timeout
from paperclip.errors import InvalidRequest
from paperclip.models import ExecutionWorkspace, HeartbeatRun, RunSnapshot
from paperclip.snapshots.cas import BlobTooLarge, cas_pin, cas_rows, directory_loader
from paperclip.snapshots.collect import roots_lock_key
from paperclip.snapshots.counts import counts_against_head
from paperclip.snapshots.trees import BLOB_NAME, TreeInvalid, Walk, decode_stored_dir, walk

MAX_MISSING_LISTED: Final = 1000


@dataclass(frozen=True, slots=True)
class SnapshotRegistration:
    snapshot: RunSnapshot
    created: bool  # False for a repeat of the same tree


@dataclass(frozen=True, slots=True)
class _Plan:
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


def _head(workspace_id: UUID) -> str | None:
    return (
        ExecutionWorkspace.objects.filter(pk=workspace_id)
        .values_list("head_tree", flat=True)
        .first()
    )


def _plan_against_head(*, company_id: UUID, workspace_id: UUID, tree: str) -> _Plan | None:
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
    return _Plan(
        pin=sorted(changes.new),
        files=counts.files,
        bytes=counts.bytes,
        entries=counts.entries,
        head=head,
        sizes=changes.sizes,
        chunked=changes.chunked,
    )


def _plan_whole(*, company_id: UUID, tree: str) -> _Plan:
    walked = snapshot_walk(company_id=company_id, tree=tree)
    _raise_missing(walked.missing)
    return _Plan(
        pin=sorted(walked.reached()),
        files=walked.files,
        bytes=walked.bytes,
        entries=walked.count,
        sizes=walked.sizes,
        chunked=walked.chunked,
    )


def _require_head_in_tx(*, company_id: UUID, workspace_id: UUID, head: str) -> None:
    """Hold the company's roots lock shared until the commit, then check (in a statement of
    its own, so with a snapshot taken after the lock) that `head` is still the head."""
    advisory_xact_lock_shared(roots_lock_key(company_id))
    current = _head(workspace_id)  # a statement of its own, after the lock
    if current != head:
        raise _HeadMoved


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
            keep_files=False,  # registration needs the counts and the blobs, not the paths
        )
    except TreeInvalid as exc:
        raise SnapshotTreeInvalid(path=exc.path, reason=exc.reason) from exc


def _name(field: str, value: str | None) -> None:
    if value is not None and not BLOB_NAME.fullmatch(value):
        raise InvalidRequest(fields={field: ["A blob name: sha256: and 64 lowercase hex digits."]})


def run_snapshot_register(
    *,
    company_id: UUID,
    run_id: UUID,
    agent_id: UUID,
    tree: str,
    base: str | None,
    generation: int,
    fence: int | None = None,
) -> SnapshotRegistration:
    """Register `tree` (the run's workdir, started from `base`, the head its checkout fetched)
    for the run's agent, fenced by the runtime lease of the run's workspace.

    The lease must be held at `generation` by the run (`run:<id>`) or by the run's issue
    (`issue:<id>`). Locks: when the plan trusts the head, the company's roots advisory lock
    (shared); the lease row FOR SHARE (as every fenced write), then the rows of the blobs to
    pin. Raises InvalidRequest, SnapshotTreeInvalid (400), SnapshotBlobsMissing
    (409, at most 1,000 names), RuntimeLeaseSuperseded / RuntimeLeaseOwnerIneligible (409),
    the lease's 404/403s, ResourceBusy. Audited once; a repeat of a registered tree writes
    nothing.
    """
    _name("tree", tree)
    _name("base", base)
    _require_base_tree(company_id, base)
    run = (
        HeartbeatRun.objects.filter(pk=run_id, company_id=company_id)
        .values("agent_id", "execution_workspace_id", "issue_id", "native_issue_id")
        .first()
    )
    if run is None or run["agent_id"] != agent_id:
        raise InvalidRequest("The run is not this agent's.")  # the API 404s before this
    workspace_id: UUID | None = run["execution_workspace_id"]
    if workspace_id is None:
        raise InvalidRequest(
            "The run has no execution workspace, so it has no lease to fence the snapshot.",
            fields={"run_id": ["The run names no execution workspace."]},
        )
    issue_id: UUID | None = run["native_issue_id"] or run["issue_id"]
    register = partial(
        _register,
        company_id=company_id,
        run_id=run_id,
        agent_id=agent_id,
        workspace_id=workspace_id,
        issue_id=issue_id,
        tree=tree,
        base=base,
        generation=generation,
        fence=fence,
    )
    plan = _plan_against_head(company_id=company_id, workspace_id=workspace_id, tree=tree)
    if plan is not None:
        try:
            return register(plan)
        except _HeadMoved:
            pass  # another run published meanwhile: trust nothing this time
    return register(_plan_whole(company_id=company_id, tree=tree))


def _register(
    plan: _Plan,
    *,
    company_id: UUID,
    run_id: UUID,
    agent_id: UUID,
    workspace_id: UUID,
    issue_id: UUID | None,
    tree: str,
    base: str | None,
    generation: int,
    fence: int | None,
) -> SnapshotRegistration:
    # The base's own blob only: publishing reads the base's directories to merge, and a base
    # collected meanwhile is merged as an empty tree, which holds overlapping paths for the
    # board rather than losing anything (docs/snapshots.md#merging).
    pin = sorted({*plan.pin, *([base] if base is not None else [])})
    owner = RuntimeLeaseOwner.for_agent(agent_id, run_id=run_id)
    try:
        return _register_in_tx(
            plan,
            pin=pin,
            owner=owner,
            company_id=company_id,
            run_id=run_id,
            workspace_id=workspace_id,
            issue_id=issue_id,
            tree=tree,
            base=base,
            generation=generation,
            fence=fence,
        )
    except _OtherSize as exc:  # the locks are let go before the tree is read again
        path = _file_naming(company_id, tree, exc.digest)
        raise SnapshotTreeInvalid(path=path, reason="size_mismatch") from None


def _register_in_tx(
    plan: _Plan,
    *,
    pin: list[str],
    owner: RuntimeLeaseOwner,
    company_id: UUID,
    run_id: UUID,
    workspace_id: UUID,
    issue_id: UUID | None,
    tree: str,
    base: str | None,
    generation: int,
    fence: int | None,
) -> SnapshotRegistration:
    with busy_on_lock_timeout(BUSY_MESSAGE):
        try:
            with transaction.atomic(durable=True):
                preconditions(
                    company_id=company_id, execution_workspace_id=workspace_id, owner=owner
                )
                if plan.head is not None:  # advisory locks first (docs/locking.md)
                    _require_head_in_tx(
                        company_id=company_id, workspace_id=workspace_id, head=plan.head
                    )
                locked = locks.runtime_lease_for_share(
                    execution_workspace_id=workspace_id,
                    company_id=company_id,
                    owner_issue_id=issue_id,
                    owner_run_id=run_id,
                )
                current, ineligible = (None, None) if locked is None else locked
                key = owner.owner_key
                if current is not None and issue_id and current.owner_key == f"issue:{issue_id}":
                    key = current.owner_key  # a runner that claimed for the run's issue
                require_fence(
                    execution_workspace_id=workspace_id,
                    owner_key=key,
                    generation=generation,
                    current=current,
                    ineligible=ineligible,
                    fence=fence,
                )
                existing = RunSnapshot.objects.filter(run_id=run_id, tree=tree).first()
                if existing is not None and existing.base == base:
                    return SnapshotRegistration(existing, created=False)
                if existing is not None:
                    raise InvalidRequest(
                        "This run registered the tree already, from another base.",
                        fields={"base": [f"The tree was registered with base {existing.base}."]},
                    )
                pinned = cas_pin(company_id=company_id, digests=pin, sizes=plan.sizes)
                _raise_missing(pinned.missing)
                _raise_other_size(company_id, tree, pinned.other_size, plan.chunked)
                snapshot = RunSnapshot.objects.create(
                    company_id=company_id,
                    run_id=run_id,
                    execution_workspace_id=workspace_id,
                    tree=tree,
                    base=base,
                    files=plan.files,
                    bytes=plan.bytes,
                    entries=plan.entries,
                    lease_generation=generation,
                )
                audit(
                    owner_actor=(owner.actor_type, owner.actor_id),
                    company_id=company_id,
                    execution_workspace_id=workspace_id,
                    action="run.snapshot_registered",
                    run_id=run_id,
                    details={
                        "tree": tree,
                        "base": base,
                        "files": plan.files,
                        "bytes": plan.bytes,
                        "generation": generation,
                    },
                )
        except IntegrityError as exc:  # the same tree registered concurrently
            raise RuntimeLeaseContended(
                execution_workspace_id=str(workspace_id), requested_action="snapshot"
            ) from exc
    return SnapshotRegistration(snapshot, created=True)


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
    tree: str,
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
