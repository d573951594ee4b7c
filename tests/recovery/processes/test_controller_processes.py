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
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from paperclip.models import ActivityEvent, WorkspaceOperation
from recovery.models import IssueRecoveryAction
from recovery.receipts import OWNER_KEY
from recovery.selectors import OWNER_UNVERIFIED_CAUSE
from recovery.services import Acquired, NotAcquired, with_finalization_ownership
from tests.recovery.factories import make_binding

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TIMEOUT = 30


def _child_env() -> dict[str, str]:
    s = connection.settings_dict
    url = f"postgres://{s['USER']}"
    if s.get("PASSWORD"):
        url += f":{s['PASSWORD']}"
    url += f"@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "paperclip.settings",
        "DATABASE_URL": url,
        "PYTHONPATH": str(settings.BASE_DIR),
    }


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


def test_sigkilled_controller_with_live_orphan_is_never_taken_over(
    tmp_path: Path, reaper: list[int]
) -> None:
    b = make_binding()
    proc = _spawn("crash_during_copy", b.company.pk, b.run.pk, tmp_path)
    try:
        _wait_for(tmp_path / "ready", proc)
        orphan_pid = int((tmp_path / "orphan.pid").read_text())
        reaper.append(orphan_pid)
        b.run.refresh_from_db()
        receipt = b.run.runner_profile_json[OWNER_KEY]
        assert receipt["pid"] == proc.pid
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=TIMEOUT)
    ran: list[int] = []

    outcome = _attempt_until_lock_free(b, lambda own: ran.append(1))

    assert outcome == NotAcquired("owner_unverified")
    assert ran == []
    # The orphan is still copying: the log keeps growing after its parent died.
    size = (tmp_path / "orphan.log").stat().st_size
    deadline = time.monotonic() + TIMEOUT
    while (tmp_path / "orphan.log").stat().st_size == size:
        assert time.monotonic() < deadline, "orphan stopped writing"
        time.sleep(0.05)
    b.run.refresh_from_db()
    assert b.run.runner_profile_json[OWNER_KEY] == receipt
    assert not WorkspaceOperation.objects.filter(heartbeat_run_id=b.run.pk).exists()
    action = IssueRecoveryAction.objects.get(source_issue=b.issue)
    assert action.cause == OWNER_UNVERIFIED_CAUSE
    assert action.owner_type == "board"
    assert action.evidence["owner"] == receipt
    # A later sweep still refuses and spends nothing.
    assert _attempt_until_lock_free(b, lambda own: ran.append(1)) == NotAcquired("owner_unverified")
    action.refresh_from_db()
    assert (action.status, action.attempt_count, ran) == ("active", 1, [])


def test_same_host_controller_that_exited_after_the_barrier_is_taken_over(
    tmp_path: Path,
) -> None:
    b = make_binding()
    proc = _spawn("exit_after_barrier", b.company.pk, b.run.pk, tmp_path)
    proc.wait(timeout=TIMEOUT)
    assert (tmp_path / "ready").exists(), proc.communicate()
    b.run.refresh_from_db()
    prior = b.run.runner_profile_json[OWNER_KEY]

    outcome = _attempt_until_lock_free(b, lambda own: own.token)

    assert isinstance(outcome, Acquired)
    assert outcome.value != prior["token"]
    assert not IssueRecoveryAction.objects.filter(source_issue=b.issue).exists()
    takeover = ActivityEvent.objects.get(action="run.finalization_owner_takeover")
    assert takeover.details["priorToken"] == prior["token"]


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
