"""A finalization that meets what it did not foresee fails like any attempt (backed off,
counted, shown), never hangs the worker nor loops every second; found in review."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from paperclip.models import NativeRunFinalization, WorkspaceOperation
from recovery.adapters import copyback
from recovery.services import Acquired, run_finalize
from recovery.services.finalization import finalize as finalize_module
from tests.recovery.factories import make_binding

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_skipped_name_that_is_not_utf8_does_not_stop_the_commit(tmp_path: Path) -> None:
    """A FIFO named `pipe-\\xff` in the run's directory is skipped and reported; the report,
    written to the operation's JSON, was refused by PostgreSQL (a lone surrogate), and the
    run could never commit."""
    b = make_binding(tmp_path=tmp_path)
    os.mkfifo(os.fsencode(str(b.source_dir)) + b"/pipe-\xff")
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "committed"
    operation = WorkspaceOperation.objects.get(
        heartbeat_run_id=b.run.pk, phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE
    )
    assert operation.metadata["copied"]["skipped"] == ["pipe-\\xff"]


def test_an_unforeseen_error_is_a_failed_attempt_backed_off_and_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Anything the attempt did not foresee escaped the job: its receipt's release deferred
    the next job a second later, for ever, with the budget never spent and nothing on the
    run saying why."""
    b = make_binding(tmp_path=tmp_path)

    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise TypeError("a bug")

    monkeypatch.setattr(finalize_module, "commit_finalized", broken)
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "retry_scheduled"
    coordinator = NativeRunFinalization.objects.get(run_id=b.run.pk)
    assert coordinator.failure_code == "workspace_copyback_failed"
    assert coordinator.failure_detail["code"] == "finalization_failed"
    assert coordinator.failure_detail["detail"] == "TypeError: a bug"
    assert coordinator.next_attempt_at is not None


def test_a_file_swapped_for_a_fifo_during_the_copy_never_hangs_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapped between the copy's lstat and its open, a FIFO blocked the open (and the
    worker's slot) until someone wrote to it."""
    b = make_binding(tmp_path=tmp_path)
    victim = str(b.source_dir / "README.md")
    real = copyback._copy_file

    def swapped(source: str, target: str, state: os.stat_result, root: str | None = None) -> int:
        if source == victim:
            os.unlink(source)
            os.mkfifo(source)
        return real(source, target, state, root)

    monkeypatch.setattr(copyback, "_copy_file", swapped)
    outcome: list[object] = []
    job = threading.Thread(
        target=lambda: outcome.append(run_finalize(company_id=b.company.pk, run_id=b.run.pk)),
        daemon=True,
    )
    job.start()
    job.join(20)
    if job.is_alive():  # release it, so the test process can end
        with open(victim, "wb") as fifo:
            fifo.write(b"x")
        job.join(10)
        pytest.fail("the finalization blocked opening a FIFO")
    assert isinstance(outcome[0], Acquired)
    assert outcome[0].value.status == "committed"
    operation = WorkspaceOperation.objects.get(
        heartbeat_run_id=b.run.pk, phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE
    )
    assert operation.metadata["copied"]["skipped"] == ["README.md"]
