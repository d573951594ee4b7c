"""A legacy copy-back whose workspace got its first head while the copy ran (another run
published it): the copy-back is not committed over it. Its cwd is made from the head, so what
the copy wrote there, in no tree, would be removed by the next materialization with the run
recorded as committed. The commit reads the head under the workspace row's lock (which every
head move takes): the run is held for the board as a copy-back refused with
`workspace_has_head`, its directory (the copy's source) keeps its work, and the cwd is marked
unknown so that the head is written back."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from paperclip.models import (
    ActivityEvent,
    ExecutionWorkspace,
    NativeRunFinalization,
    WorkspaceOperation,
)
from paperclip.snapshots.head import workspace_materialize
from paperclip.snapshots.models import WorkspaceHeadMove
from recovery.adapters import copyback as copyback_module
from recovery.models import IssueRecoveryAction
from recovery.services import Acquired, run_finalize
from recovery.services.finalization import finalize as finalize_module
from recovery.services.finalization import publish as publish_module
from tests.recovery.conflicts import in_workspace
from tests.recovery.factories import make_binding

pytestmark = pytest.mark.django_db(transaction=True)


def _finalized_elsewhere(binding: Any) -> Any:
    """`run_finalize` of the binding's run on another thread, so on another connection (as
    a second worker would), waited for: its outcome."""
    outcome: list[Any] = []

    def other() -> None:
        try:
            outcome.append(run_finalize(company_id=binding.company.pk, run_id=binding.run.pk))
        finally:
            connection.close()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    return outcome[0]


def test_a_head_published_during_a_copy_back_holds_the_copy_back_for_the_board(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make_binding(tmp_path=tmp_path)  # a copy-back run
    assert c.dest_dir is not None
    (c.source_dir / "c_work.txt").write_text("C's work\n")
    s = in_workspace(c, {"s.txt": b"S\n"}, base=None)  # a snapshot run, same workspace
    real = copyback_module.copyback_backend()
    published: dict[str, Any] = {}

    class PublishedMeanwhile:
        def copy_back(self, **kwargs: Any) -> Any:
            # While C copies (its guard passed: no head yet), S finalizes on another
            # connection and publishes the workspace's first head.
            published["s"] = _finalized_elsewhere(s)
            return real.copy_back(**kwargs)

    monkeypatch.setattr(finalize_module, "copyback_backend", lambda: PublishedMeanwhile())
    outcome = run_finalize(company_id=c.company.pk, run_id=c.run.pk)
    assert isinstance(published["s"], Acquired)
    assert published["s"].value.status == "committed"
    assert isinstance(outcome, Acquired)
    coordinator = NativeRunFinalization.objects.get(run_id=c.run.pk)
    assert coordinator.phase == "retryable_failure"
    assert coordinator.failure_code == "workspace_copyback_not_allowed"
    assert coordinator.failure_detail["detail"].startswith("workspace_has_head:")
    hold = IssueRecoveryAction.objects.get(
        evidence__runId=str(c.run.pk), status__in=("active", "escalated")
    )
    assert hold.evidence["failure"]["code"] == "workspace_copyback_not_allowed"
    workspace = ExecutionWorkspace.objects.get(pk=c.workspace.pk)
    assert workspace.head_tree is not None
    assert workspace.cwd_tree is None  # the copy replaced the cwd: unknown until written back
    assert ActivityEvent.objects.filter(action="workspace.copyback_overtaken").count() == 1
    # The run's work is where the agent left it; the cwd goes back to the head.
    assert (c.source_dir / "c_work.txt").read_text() == "C's work\n"
    workspace_materialize(workspace_id=c.workspace.pk)
    assert (c.dest_dir / "s.txt").read_bytes() == b"S\n"
    assert not (c.dest_dir / "c_work.txt").exists()
    # The operation of the refused copy is closed as failed, never as succeeded.
    operations = WorkspaceOperation.objects.filter(
        heartbeat_run_id=c.run.pk, phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE
    )
    assert list(operations.values_list("status", flat=True)) == ["failed"]


def test_a_copy_back_committed_after_a_first_publish_adopted_the_cwd_is_adopted_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order: S's first publish adopts the cwd (empty), then C copies back and
    commits (no head yet), then S moves the empty head to its tree: C's committed files were
    in no tree, and the next materialization removed them. The first head now moves only over
    a cwd still empty under the workspace row's lock (C's commit takes it too); else S adopts
    the cwd again and merges with it (found in review, shown failing first)."""
    c = make_binding(tmp_path=tmp_path)
    assert c.dest_dir is not None
    (c.source_dir / "c_work.txt").write_text("C's work\n")
    s = in_workspace(c, {"s.txt": b"S\n"}, base=None)
    real_adopt = publish_module.workspace_cwd_adopt
    done: dict[str, Any] = {}

    def adopt_then_copy_back_commits(**kwargs: Any) -> Any:
        adopted = real_adopt(**kwargs)
        if "c" not in done:  # right after S's first look at the cwd, C finalizes
            done["c"] = _finalized_elsewhere(c)
        return adopted

    monkeypatch.setattr(publish_module, "workspace_cwd_adopt", adopt_then_copy_back_commits)
    outcome = run_finalize(company_id=s.company.pk, run_id=s.run.pk)
    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "committed"
    assert isinstance(done["c"], Acquired)
    assert done["c"].value.status == "committed"
    workspace_materialize(workspace_id=c.workspace.pk)
    assert (c.dest_dir / "c_work.txt").read_text() == "C's work\n"
    assert (c.dest_dir / "s.txt").read_bytes() == b"S\n"
    moves = WorkspaceHeadMove.objects.filter(workspace_id=c.workspace.pk).order_by("seq")
    assert [move.kind for move in moves] == ["adoption", "merge"]  # S merged with C's files
