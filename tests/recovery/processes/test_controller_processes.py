"""Controllers in real OS processes: crashes, orphaned copy children, exits after the
barrier, and a lock held by another process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection

from paperclip.access import board_actor
from paperclip.models import ActivityEvent, BoardMembership, WorkspaceOperation
from paperclip.receipts import OWNER_KEY
from recovery.errors import FinalizationOwnershipLost
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.services import (
    Acquired,
    NotAcquired,
    recovery_owner_stop_confirm,
    run_finalize,
    with_finalization_ownership,
)
from tests.helpers import run_jobs
from tests.paperclip.factories import UserFactory
from tests.recovery.factories import make_binding
from tests.support.processes import child_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.embedded]

TIMEOUT = 30


def _child_env() -> dict[str, str]:
    return child_env()


def _spawn(mode: str, company_id: Any, run_id: Any, status_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.recovery.processes.controller_proc",
            mode,
            str(company_id),
            str(run_id),
            str(status_dir),
        ],
        cwd=settings.BASE_DIR,
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"controller exited early: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.05)


def _attempt_until_lock_free(b: Any, action: Any) -> Any:
    """The dead controller's session ends when the server sees its socket close; until then
    the lock still answers busy."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        outcome = with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=action
        )
        if outcome != NotAcquired("busy") or time.monotonic() > deadline:
            return outcome
        time.sleep(0.1)


@pytest.fixture
def reaper() -> Iterator[list[int]]:
    """Pids (process groups) to SIGKILL at the end of the test, whatever happens."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def test_controller_sigkilled_mid_copyback_with_a_live_orphan_is_held_for_the_board(
    tmp_path: Path, reaper: list[int]
) -> None:
    b = make_binding(tmp_path=tmp_path)
    status = tmp_path / "status"
    status.mkdir()
    proc = _spawn("crash_during_real_copyback", b.company.pk, b.run.pk, status)
    try:
        _wait_for(status / "ready", proc)
        orphan_pid = int((status / "orphan.pid").read_text())
        reaper.append(orphan_pid)
        orphan_log = status / "orphan.log"
        assert orphan_log.exists(), "ready was reported before the orphan started copying"
        b.refresh()
        receipt = b.run.runner_profile_json[OWNER_KEY]
        assert receipt["pid"] == proc.pid
        assert b.coordinator.phase == "workspace_finalizing"
        running = WorkspaceOperation.objects.get(heartbeat_run=b.run, phase="workspace_finalize")
        assert running.status == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    ran: list[int] = []

    # The controller is dead, but its copy child isn't, and no barrier says copy-back ended.
    outcome = _attempt_until_lock_free(b, lambda own: ran.append(1))

    assert outcome == NotAcquired("owner_unverified")
    assert ran == []
    size = orphan_log.stat().st_size
    deadline = time.monotonic() + TIMEOUT
    while orphan_log.stat().st_size == size:
        assert time.monotonic() < deadline, "orphan stopped writing"
        time.sleep(0.05)
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == receipt
    running.refresh_from_db()
    assert running.status == "running"  # a stale running row is never a barrier
    assert b.dest_dir is not None
    assert not b.dest_dir.exists()
    action = IssueRecoveryAction.objects.get(source_issue=b.issue)
    assert (action.cause, action.owner_type, action.wake_policy) == (
        OWNER_UNVERIFIED_CAUSE,
        "board",
        None,
    )
    assert action.evidence["owner"] == receipt
    # Later sweeps (reconciler included) still refuse and spend nothing.
    assert _attempt_until_lock_free(b, lambda own: ran.append(1)) == NotAcquired("owner_unverified")
    out = StringIO()
    call_command("reconcile_finalizations", stdout=out)
    assert "skipped held 1" in out.getvalue()
    action.refresh_from_db()
    assert (action.status, action.attempt_count, ran) == ("active", 1, [])

    # The operator stops the orphan through the platform, then confirms.
    os.killpg(orphan_pid, signal.SIGKILL)
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=b.company)
    recovery_owner_stop_confirm(
        actor=board_actor(user),
        issue_id=b.issue.pk,
        action_id=action.pk,
        run_id=b.run.pk,
        owner_token=receipt["token"],
        stop_evidence="controller pid killed, orphan copy process group killed at 12:00",
        controller_and_copyback_stopped=True,
    )
    # The confirmation deferred the finalization job: a worker commits it with no other step.
    run_jobs()
    b.refresh()
    assert (b.coordinator.phase, b.run.status) == ("committed", "succeeded")
    assert (b.dest_dir / "src" / "main.py").read_text() == "print('hi')\n"
    running.refresh_from_db()
    assert (running.status, running.metadata["error"]) == ("failed", "abandoned_by_previous_owner")
    action.refresh_from_db()
    assert (action.status, action.outcome) == ("resolved", "restored")


def test_terminated_lock_connection_admits_no_owner_from_another_process(
    tmp_path: Path,
) -> None:
    b = make_binding()
    inside, checked = threading.Event(), threading.Event()
    backend: dict[str, int] = {}

    def action(own: Any) -> None:
        backend["pid"] = own.lock_backend_pid
        inside.set()
        assert checked.wait(timeout=TIMEOUT)
        own.assert_held()

    def holder() -> Any:
        try:
            return with_finalization_ownership(
                company_id=b.company.pk, run_id=b.run.pk, action=action
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(holder)
        try:
            assert inside.wait(timeout=TIMEOUT)
            b.run.refresh_from_db()
            receipt = b.run.runner_profile_json[OWNER_KEY]
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(%s)", [backend["pid"]])
            # The lock is free now, but the receipt of a live controller still fences the run.
            proc = _spawn("try", b.company.pk, b.run.pk, tmp_path)
            out, err = proc.communicate(timeout=TIMEOUT)
            b.run.refresh_from_db()
            assert b.run.runner_profile_json[OWNER_KEY] == receipt
        finally:
            checked.set()
        with pytest.raises(FinalizationOwnershipLost):
            future.result(timeout=TIMEOUT)
    assert json.loads(out.strip().splitlines()[-1]) == {
        "acquired": False,
        "reason": "owner_unverified",
    }, err
    assert IssueRecoveryAction.objects.get(source_issue=b.issue).evidence["owner"] == receipt


def test_same_host_controller_that_exited_after_the_barrier_is_taken_over(
    tmp_path: Path,
) -> None:
    b = make_binding()
    proc = _spawn("exit_after_barrier", b.company.pk, b.run.pk, tmp_path)
    proc.wait(timeout=TIMEOUT)
    assert (tmp_path / "ready").exists(), proc.communicate()
    b.run.refresh_from_db()
    prior = b.run.runner_profile_json[OWNER_KEY]

    barrier = WorkspaceOperation.objects.get(heartbeat_run=b.run, status="succeeded")
    deadline = time.monotonic() + TIMEOUT
    while (outcome := run_finalize(company_id=b.company.pk, run_id=b.run.pk)) == NotAcquired(
        "busy"
    ):  # the dead controller's session ends when the server notices its socket closed
        assert time.monotonic() < deadline
        time.sleep(0.1)

    assert isinstance(outcome, Acquired)
    # Copy-back already finished under the dead owner: only the commit is left.
    assert (outcome.value.status, outcome.value.operation_id) == ("committed", barrier.pk)
    assert WorkspaceOperation.objects.filter(heartbeat_run=b.run).count() == 1
    assert not IssueRecoveryAction.objects.filter(source_issue=b.issue).exists()
    takeover = ActivityEvent.objects.get(action="run.finalization_owner_takeover")
    assert takeover.details["priorToken"] == prior["token"]
    assert takeover.details["takeoverBasis"] == "controller_process_dead+copyback_barrier"


def test_lock_held_by_another_process_is_busy_not_owner_active(tmp_path: Path) -> None:
    b = make_binding()
    inside, release = threading.Event(), threading.Event()

    def hold(own: Any) -> str:
        inside.set()
        assert release.wait(timeout=TIMEOUT)
        return "held"

    def holder() -> Any:
        try:
            return with_finalization_ownership(
                company_id=b.company.pk, run_id=b.run.pk, action=hold
            )
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(holder)
        assert inside.wait(timeout=TIMEOUT)
        try:
            proc = _spawn("try", b.company.pk, b.run.pk, tmp_path)
            out, err = proc.communicate(timeout=TIMEOUT)
        finally:
            release.set()
        assert future.result(timeout=TIMEOUT) == Acquired("held")
    assert json.loads(out.strip().splitlines()[-1]) == {"acquired": False, "reason": "busy"}, err
