"""Registering a tree against the workspace's head: only the directories where the two differ
are read and only the blobs the head lacks are pinned, with the same counts as the whole walk;
a head that moves meanwhile sends the registration to the whole walk; and a collection cannot
read its roots between the registration's check of the head and its commit, which the forced
race below shows (docs/snapshots.md#registering-against-the-head)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from django.db import connection
from django.db.models.expressions import RawSQL

from leases.services import run_snapshot_register
from leases.services import snapshots as registration
from paperclip.models import CasBlob, ExecutionWorkspace, HeartbeatRun, RunSnapshot, TreeCounts
from paperclip.snapshots import counts as counting
from paperclip.snapshots import trees
from paperclip.snapshots.adopt import workspace_cwd_adopt
from paperclip.snapshots.collect import cas_collect
from paperclip.snapshots.counts import Counts, tree_counts, tree_counts_record
from paperclip.snapshots.head import publish_plan
from paperclip.snapshots.store.reads import cas_load, cas_open
from tests.helpers import wait_for_lock_waiters
from tests.leases.factories import running_run
from tests.paperclip.factories import HeartbeatRunFactory
from tests.recovery.snapshots import Files, store_tree

LAYOUT: Files = {
    f"pkg{i}/mod{j}/file{k}.py": b"# %d %d %d\n" % (i, j, k)
    for i in range(6)
    for j in range(4)
    for k in range(5)
} | {"README.md": b"hello\n", "pkg0/link": "mod0/file0.py"}
CHANGE: Files = {"pkg3/mod1/file2.py": b"# changed\n", "pkg3/mod1/new.py": b"# new\n"}


def _age_all(company_id: UUID, only: set[str] | None = None) -> None:
    old = RawSQL("now() - interval '2 days'", [])
    rows = CasBlob.objects.filter(company_id=company_id)
    if only is not None:
        rows = rows.filter(digest__in=only)
    rows.update(created_at=old, referenced_at=old)


def _young(company_id: UUID) -> set[str]:
    young = RawSQL("now() - interval '1 hour'", [])
    return set(
        CasBlob.objects.filter(company_id=company_id, referenced_at__gt=young).values_list(
            "digest", flat=True
        )
    )


def _whole(company_id: UUID, tree: str) -> trees.Walk:
    return trees.walk(
        tree, load=lambda n: cas_load(company_id=company_id, digest=n, max_bytes=1 << 20)
    )


def _counts_match_whole_walk(snapshot: RunSnapshot, company_id: UUID, tree: str) -> trees.Walk:
    """The snapshot's counts are the whole walk's of `tree` (which it returns)."""
    whole = _whole(company_id, tree)
    assert (snapshot.files, snapshot.bytes, snapshot.entries) == (
        whole.files,
        whole.bytes,
        whole.count,
    )
    return whole


def _register(run: Any, generation: int, tree: str, base: str | None) -> RunSnapshot:
    return run_snapshot_register(
        company_id=run.company_id,
        run_id=run.pk,
        agent_id=run.agent_id,
        tree=tree,
        base=base,
        generation=generation,
    ).snapshot


def _publish(workspace_id: UUID, tree: str) -> None:
    ExecutionWorkspace.objects.filter(pk=workspace_id).update(head_tree=tree)


def _registered_against(run: Any, generation: int, head: str, files: Files) -> None:
    """Register a tree of `files` changed by CHANGE against `head` (the workspace's head) and
    check it was compared, not walked: the whole walk's counts, and only what the head lacks
    pinned."""
    company_id = run.company_id
    _publish(run.execution_workspace_id, head)
    tree = store_tree(company_id, files | CHANGE)
    _age_all(company_id)
    snapshot = _register(run, generation, tree, head)
    whole = _counts_match_whole_walk(snapshot, company_id, tree)
    # Pinned: the two files' contents, the root, pkg3 and pkg3/mod1, and the base's own blob;
    # nothing else the head has.
    changed_dirs = {d for d, path in whole.directories.items() if path in ("", "pkg3", "pkg3/mod1")}
    assert _young(company_id) == changed_dirs | {
        head,
        trees.blob_name(b"# changed\n"),
        trees.blob_name(b"# new\n"),
    }


@pytest.mark.django_db
def test_a_tree_changed_from_the_head_pins_only_what_the_head_lacks() -> None:
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    company_id, generation = run.company_id, claim.lease.generation
    head = store_tree(company_id, LAYOUT)
    first = _register(run, generation, head, None)  # no head yet: the whole walk
    _counts_match_whole_walk(first, company_id, head)
    _registered_against(run, generation, head, LAYOUT)


@pytest.mark.django_db
def test_a_merged_head_is_registered_against_like_a_registered_one() -> None:
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    company_id = run.company_id
    base = store_tree(company_id, LAYOUT)
    theirs = store_tree(company_id, LAYOUT | {"theirs.txt": b"t\n"})
    ours = store_tree(company_id, LAYOUT | {"ours.txt": b"o\n"})
    _register(run, claim.lease.generation, theirs, None)  # the head, registered: counted
    _publish(run.execution_workspace_id, theirs)
    plan = publish_plan(
        company_id=company_id, workspace_id=run.execution_workspace_id, tree=ours, base=base
    )
    assert plan.kind == "merged"
    assert plan.new_head is not None
    whole = _whole(company_id, plan.new_head)
    counts = tree_counts(company_id=company_id, tree=plan.new_head)
    assert counts == Counts(files=whole.files, bytes=whole.bytes, entries=whole.count)
    merged = LAYOUT | {"theirs.txt": b"t\n", "ours.txt": b"o\n"}
    _registered_against(run, claim.lease.generation, plan.new_head, merged)


@pytest.mark.django_db
def test_a_head_merged_over_whole_trees_is_counted_too() -> None:
    """A symlink added on one side sends the merge to the whole trees (and no head counts are
    needed there): the merged tree's counts are recorded from its entries."""
    run, _claim = running_run()
    company_id = run.company_id
    base = store_tree(company_id, LAYOUT)
    theirs = store_tree(company_id, LAYOUT | {"theirs-link": "README.md"})
    ours = store_tree(company_id, LAYOUT | {"ours.txt": b"o\n"})
    _publish(run.execution_workspace_id, theirs)
    plan = publish_plan(
        company_id=company_id, workspace_id=run.execution_workspace_id, tree=ours, base=base
    )
    assert plan.kind == "merged"
    assert plan.new_head is not None
    whole = _whole(company_id, plan.new_head)
    assert tree_counts(company_id=company_id, tree=plan.new_head) == Counts(
        files=whole.files, bytes=whole.bytes, entries=whole.count
    )


@pytest.mark.django_db
def test_an_adopted_head_is_registered_against_like_a_registered_one(tmp_path: Path) -> None:
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    for path, content in LAYOUT.items():
        where = tmp_path / "cwd" / path
        where.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            where.symlink_to(content)
        else:
            where.write_bytes(content)
            where.chmod(0o644)
    for directory in (tmp_path / "cwd").rglob("*"):
        if directory.is_dir() and not directory.is_symlink():
            directory.chmod(0o755)
    ExecutionWorkspace.objects.filter(pk=run.execution_workspace_id).update(
        cwd=str(tmp_path / "cwd")
    )
    adopted = workspace_cwd_adopt(
        company_id=run.company_id, workspace_id=run.execution_workspace_id
    )
    assert adopted == store_tree(run.company_id, LAYOUT)  # the same tree as the files
    _registered_against(run, claim.lease.generation, adopted, LAYOUT)


@pytest.mark.django_db
def test_a_head_without_counts_is_walked_whole() -> None:
    """A head nobody counted (set by hand, or registered before counts were kept): the
    registration pins everything its tree reaches, as with no head."""
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    company_id = run.company_id
    head = store_tree(company_id, LAYOUT)
    _publish(run.execution_workspace_id, head)
    tree = store_tree(company_id, LAYOUT | CHANGE)
    _age_all(company_id)
    _register(run, claim.lease.generation, tree, head)
    assert _young(company_id) == _whole(company_id, tree).reached() | {head}


@pytest.mark.django_db
def test_a_collected_tree_loses_its_counts() -> None:
    run, _claim = running_run()
    company_id = run.company_id
    tree = store_tree(company_id, {"a.txt": b"a\n"})
    tree_counts_record(company_id=company_id, tree=tree, counts=Counts(1, 2, 1))
    assert tree_counts(company_id=company_id, tree=tree) == Counts(files=1, bytes=2, entries=1)
    _age_all(company_id)
    cas_collect(batch_size=100)  # nobody's root
    assert tree_counts(company_id=company_id, tree=tree) is None
    assert not TreeCounts.objects.filter(company_id=company_id).exists()


@pytest.mark.django_db
def test_a_head_that_moved_before_the_commit_sends_it_to_the_whole_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    company_id = run.company_id
    head = store_tree(company_id, LAYOUT)
    _register(run, claim.lease.generation, head, None)
    _publish(run.execution_workspace_id, head)
    tree = store_tree(company_id, LAYOUT | CHANGE)
    elsewhere = store_tree(company_id, {"other.txt": b"another run's work\n"})
    _age_all(company_id)
    compare = counting.walk_changes  # registration's comparison with the head

    def compare_then_move(*args: Any, **kwargs: Any) -> Any:
        changes = compare(*args, **kwargs)
        _publish(run.execution_workspace_id, elsewhere)  # another run published meanwhile
        return changes

    monkeypatch.setattr(counting, "walk_changes", compare_then_move)
    snapshot = _register(run, claim.lease.generation, tree, head)
    assert snapshot.files == _whole(company_id, tree).files
    assert _young(company_id) == _whole(company_id, tree).reached() | {head}  # all pinned


@pytest.mark.django_db(transaction=True)
def test_a_collection_cannot_read_its_roots_between_the_check_of_the_head_and_the_commit(
    monkeypatch: pytest.MonkeyPatch, settings: Any, tmp_path: Any
) -> None:
    """The forced race: the registration has checked that the head is its head and holds
    the roots lock; the head moves on (nobody's root reaches the old head's own files any
    more); a collection starts. It must wait for the registration's commit, then keep what the
    new snapshot shares with the old head. Without the lock it deletes `pkg3/mod0/file0.py`'s
    content, which the snapshot names and never pinned."""
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    company_id = run.company_id
    head = store_tree(company_id, LAYOUT)
    whole_head = _whole(company_id, head)
    earlier = HeartbeatRunFactory(company=run.company, status=HeartbeatRun.Status.SUCCEEDED)
    RunSnapshot.objects.create(  # the head, registered long ago by a run that has ended
        company_id=company_id,
        run=earlier,
        execution_workspace_id=run.execution_workspace_id,
        tree=head,
        files=whole_head.files,
        bytes=whole_head.bytes,
        entries=whole_head.count,
        lease_generation=1,
        created_at=RawSQL("now() - interval '2 days'", []),
    )
    _publish(run.execution_workspace_id, head)
    tree = store_tree(company_id, LAYOUT | CHANGE)
    elsewhere = store_tree(company_id, {"other.txt": b"another run's work\n"})
    shared = trees.blob_name(LAYOUT["pkg3/mod0/file0.py"])  # type: ignore[arg-type]
    _age_all(company_id, only=whole_head.reached())  # what the run uploaded stays young
    in_transaction, go, collected = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    lease_for_share = registration.locks.runtime_lease_for_share

    def pause_after_the_head_check(**kwargs: Any) -> Any:
        in_transaction.set()
        assert go.wait(timeout=30)
        return lease_for_share(**kwargs)

    monkeypatch.setattr(registration.locks, "runtime_lease_for_share", pause_after_the_head_check)

    def in_thread(work: Any) -> threading.Thread:
        def body() -> None:
            try:
                work()
            except BaseException as exc:
                errors.append(exc)
            finally:
                connection.close()

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    # No base: its own blob, pinned, would only sometimes stand in for the lock (here the
    # collection deletes it too, and the registration would fail rather than lose anything).
    registering = in_thread(lambda: _register(run, claim.lease.generation, tree, None))  # type: ignore[union-attr]
    assert in_transaction.wait(timeout=30)
    _publish(run.execution_workspace_id, elsewhere)
    collecting = in_thread(lambda: (cas_collect(batch_size=100), collected.set()))
    waited = wait_for_lock_waiters(1, until=collected.is_set)
    go.set()
    registering.join(timeout=30)
    collecting.join(timeout=30)
    assert errors == []
    assert waited, "the collection read its roots while the registration was in flight"
    assert RunSnapshot.objects.filter(run=run, tree=tree).exists()
    reader = cas_open(company_id=company_id, digest=shared)
    assert reader is not None
    assert b"".join(reader.chunks) == LAYOUT["pkg3/mod0/file0.py"]
    # The new snapshot is a root for the grace: everything it reaches is still stored.
    reached = _whole(company_id, tree).reached()
    stored = CasBlob.objects.filter(company_id=company_id, digest__in=reached).count()
    assert stored == len(reached)


@pytest.mark.django_db
def test_names_that_hold_the_entries_separator_register_against_the_head() -> None:
    """A name or a symlink's target ending with `},{` puts `},{"` (its closing quote after)
    inside its directory's entry: the comparison piece by piece still splits that directory
    into its entries, so a tree adding a file beside it registers (it was refused)."""
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    company_id, generation = run.company_id, claim.lease.generation
    odd: Files = {"a},{/x.py": b"x\n", "b},{": b"b\n", "c": "a},{/x.py},{", "d": b"d\n"}
    head = store_tree(company_id, LAYOUT | odd)
    _register(run, generation, head, None)
    _publish(run.execution_workspace_id, head)
    tree = store_tree(company_id, LAYOUT | odd | {"b},{z": b"new\n", "a},{/y},{": b"y\n"})
    snapshot = _register(run, generation, tree, head)
    _counts_match_whole_walk(snapshot, company_id, tree)
