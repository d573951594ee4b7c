"""The worker as real OS processes (`manage.py run_worker`) against the test database: a result
finalized with no command run by hand, SIGKILL in the middle of a copy-back, two workers racing
on one run, a frozen worker's job recovered as stalled, the periodic lease sweep."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from procrastinate.contrib.django.models import ProcrastinateJob

from leases.models import WorkspaceRuntimeLease
from paperclip.access import board_actor
from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    HeartbeatRun,
    NativeRunFinalization,
    WorkspaceOperation,
)
from paperclip.worker.jobs import job_defer_in_tx, job_status
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.finalization import finalization_state
from recovery.services import recovery_owner_stop_confirm
from tests.leases.factories import claim, expire
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    UserFactory,
)
from tests.recovery.factories import make_binding
from tests.support.processes import child_env

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.embedded]

TIMEOUT = 40
GATED = "tests.paperclip.worker.gated_copyback.GatedCopyback"
FAST = {
    "PAPERCLIP_WORKER_HEARTBEAT_SECONDS": "0.5",
    "PAPERCLIP_WORKER_STALLED_AFTER_SECONDS": "3",
    "PAPERCLIP_STALLED_JOB_INTERVAL_SECONDS": "1",
    "PAPERCLIP_RECONCILE_INTERVAL_SECONDS": "1",
    "PAPERCLIP_LEASE_SWEEP_INTERVAL_SECONDS": "1",
    "PAPERCLIP_WORKER_POLL_SECONDS": "1",
}


class Worker:
    """A `manage.py run_worker` child in its own session; its output is drained by a thread."""

    def __init__(self, **env: str) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "run_worker"],
            cwd=settings.BASE_DIR,
            env=child_env(**{**FAST, **env}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()
        wait_for(lambda: any(" running on " in line for line in self.lines), "worker start", self)

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGCONT)
                self.signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()

    def output(self) -> str:
        return "\n".join(self.lines[-40:])


@contextlib.contextmanager
def workers(*envs: dict[str, str]) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        for env in envs:
            started.append(Worker(**env))
        yield started
    finally:
        for worker in started:
            worker.stop()


def wait_for(condition: Callable[[], Any], what: str, *watched: Worker) -> Any:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    logs = "\n---\n".join(w.output() for w in watched)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def state(run: HeartbeatRun) -> str:
    run.refresh_from_db()
    return finalization_state(run).state


def post_result(make_agent_client: Any, run: HeartbeatRun) -> None:
    response = make_agent_client(run.agent).post(
        f"/api/heartbeat-runs/{run.pk}/results",
        {"result": {"summary": "done"}, "terminal": {"run_terminal_state": "succeeded"}},
        format="json",
    )
    assert response.status_code in (200, 201), response.json()


def copy_started(base: Path) -> list[Path]:
    return sorted(base.glob("copy-started-*"))


def fresh_binding(tmp_path: Path) -> Any:
    """A running native run with a workspace directory and no result yet."""
    b = make_binding(tmp_path=tmp_path, with_result=False)
    NativeRunFinalization.objects.filter(run_id=b.run.pk).delete()
    return b


def test_a_worker_finalizes_a_run_once_its_result_is_posted(
    tmp_path: Path, make_agent_client: Any
) -> None:
    b = fresh_binding(tmp_path)
    with workers({}) as [worker]:
        post_result(make_agent_client, b.run)
        wait_for(lambda: state(b.run) == "committed", "commit", worker)
    b.refresh()
    assert b.run.status == "succeeded"
    assert (b.dest_dir / "src" / "main.py").read_text() == "print('hi')\n"
    assert (b.issue.execution_run_id, b.issue.checkout_run_id) == (None, None)


def test_a_worker_killed_mid_copyback_leaves_the_run_held_until_the_board_confirms(
    tmp_path: Path, make_agent_client: Any
) -> None:
    b = fresh_binding(tmp_path)
    base = b.source_dir.parent
    (base / "hold").touch()
    with workers({"PAPERCLIP_COPYBACK_BACKEND": GATED}) as [first]:
        post_result(make_agent_client, b.run)
        wait_for(lambda: copy_started(base), "copy-back to start", first)
        first.signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
    # Never copied over: the destination was not published, and no worker may take over.
    assert not b.dest_dir.exists()
    with workers({}) as [second]:
        wait_for(lambda: state(b.run) == "held", "the board hold", second)
        action = IssueRecoveryAction.objects.get(cause=OWNER_UNVERIFIED_CAUSE)
        assert action.evidence["owner"]["pid"] == first.proc.pid
        time.sleep(1.5)  # more reconcile periods pass: still held, nothing copied
        assert state(b.run) == "held"
        assert not b.dest_dir.exists()
        user = UserFactory()
        BoardMembership.objects.create(user=user, company=b.company)
        recovery_owner_stop_confirm(
            actor=board_actor(user),
            issue_id=b.issue.pk,
            action_id=action.pk,
            run_id=b.run.pk,
            owner_token=action.evidence["owner"]["token"],
            stop_evidence="worker process SIGKILLed by the test, its process group is gone",
            controller_and_copyback_stopped=True,
        )
        wait_for(lambda: state(b.run) == "committed", "commit after the confirmation", second)
    assert (b.dest_dir / "README.md").read_text() == "hello\n"
    abandoned = WorkspaceOperation.objects.get(heartbeat_run=b.run, status="failed")
    assert abandoned.metadata["error"] == "abandoned_by_previous_owner"
    action.refresh_from_db()
    assert (action.status, action.outcome) == ("resolved", "restored")


def finalize_jobs(status: str | None = None) -> list[ProcrastinateJob]:
    jobs = ProcrastinateJob.objects.filter(task_name="finalize_run").order_by("id")
    return list(jobs.filter(status=status) if status else jobs)


def test_two_workers_racing_on_one_run_admit_one_owner(tmp_path: Path) -> None:
    b = make_binding(tmp_path=tmp_path)
    base = b.source_dir.parent
    (base / "hold").touch()
    with transaction.atomic():  # two jobs for one run, past the queueing lock on purpose
        for _ in range(2):
            job_defer_in_tx(
                "finalize_run", company_id=str(b.company.pk), run_id=str(b.run.pk), explicit=True
            )
    gated = {"PAPERCLIP_COPYBACK_BACKEND": GATED}
    with workers(gated, gated) as pair:
        # Every finalization job of the run (ours, and the one each reconciler may defer) is
        # taken; one owner copies, held at the gate, and every other one ended at once: `busy`.
        wait_for(lambda: not finalize_jobs("todo"), "every job taken", *pair)
        wait_for(lambda: len(finalize_jobs("doing")) == 1, "one owner", *pair)
        wait_for(lambda: len(finalize_jobs("succeeded")) >= 1, "the loser", *pair)
        statuses = {job.status for job in finalize_jobs()}
        assert statuses == {"doing", "succeeded"}
        assert len(copy_started(base)) == 1
        (base / "hold").unlink()
        wait_for(lambda: state(b.run) == "committed", "commit", *pair)
    assert len({job.worker_id for job in finalize_jobs()} - {None}) <= 2
    assert WorkspaceOperation.objects.filter(heartbeat_run=b.run).count() == 1
    assert ActivityEvent.objects.filter(action="run.finalization_owner_claimed").count() == 1
    assert ActivityEvent.objects.filter(action="run.finalization_committed").count() == 1


def test_a_frozen_workers_job_is_recovered_as_stalled_without_spending_a_retry(
    tmp_path: Path,
) -> None:
    b = make_binding(tmp_path=tmp_path)  # waiting for finalization: the reconciler defers it
    base = b.source_dir.parent
    (base / "hold").touch()
    with workers({"PAPERCLIP_COPYBACK_BACKEND": GATED}) as [frozen]:
        wait_for(lambda: copy_started(base), "copy-back to start", frozen)
        [owner_job] = finalize_jobs("doing")
        frozen.signal(signal.SIGSTOP)  # heartbeats stop; its lock connection stays open
        with workers({}) as [rescuer]:
            wait_for(
                lambda: (
                    _job_attempts(owner_job.id) >= 1 and job_status(owner_job.id) == "succeeded"
                ),
                "the stalled job retried, and ended by the rescuer",
                rescuer,
            )
            coordinator = NativeRunFinalization.objects.get(run_id=b.run.pk)
            # The rescuer met the frozen owner's lock: `busy`, no attempt spent, nothing copied.
            assert coordinator.attempt == 1
            assert coordinator.phase == "workspace_finalizing"
            assert not b.dest_dir.exists()
            assert len(copy_started(base)) == 1
            frozen.signal(signal.SIGCONT)
            (base / "hold").unlink()
            wait_for(lambda: state(b.run) == "committed", "the thawed owner commits", frozen)
    assert NativeRunFinalization.objects.get(run_id=b.run.pk).attempt == 1
    assert WorkspaceOperation.objects.filter(heartbeat_run=b.run).count() == 1


def _job_attempts(job_id: int) -> int:
    return (
        ProcrastinateJob.objects.filter(pk=job_id).values_list("attempts", flat=True).first() or 0
    )


def test_the_periodic_sweep_removes_a_stale_lease_and_spares_a_renewed_one() -> None:
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    stale, renewed = (
        ExecutionWorkspaceFactory(company=company),
        ExecutionWorkspaceFactory(company=company),
    )
    claim(stale, agent)
    claim(renewed, agent)
    expire(stale)
    expire(renewed)
    claim(renewed, agent)  # the same owner again: a renewal, the expiry moves ahead
    with workers({}) as [worker]:
        wait_for(
            lambda: not WorkspaceRuntimeLease.objects.filter(execution_workspace=stale).exists(),
            "the stale lease swept",
            worker,
        )
    assert WorkspaceRuntimeLease.objects.filter(execution_workspace=renewed).exists()


def test_finalize_with_wait_answers_with_the_outcome_of_the_attempt(
    tmp_path: Path, make_agent_client: Any
) -> None:
    b = fresh_binding(tmp_path)
    base = b.source_dir.parent
    (base / "hold").touch()
    agent = make_agent_client(b.agent)
    url = f"/api/heartbeat-runs/{b.run.pk}/finalize"
    with workers({"PAPERCLIP_COPYBACK_BACKEND": GATED}) as [worker]:
        post_result(make_agent_client, b.run)
        wait_for(lambda: copy_started(base), "copy-back to start", worker)
        running = agent.post(f"{url}?wait=1")  # the wait runs out while the owner copies
        assert running.status_code == 202, running.json()
        assert running.json()["status"] == "running"
        (base / "hold").unlink()
        done = agent.post(f"{url}?wait=20")
        assert done.status_code == 200, done.json()
        assert done.json()["status"] == "committed"
        assert done.json()["finalization"]["state"] == "committed"


def test_finalize_with_wait_on_a_held_run_says_why(tmp_path: Path, make_agent_client: Any) -> None:
    from tests.helpers import assert_error
    from tests.recovery.factories import receipt_for

    b = make_binding(tmp_path=tmp_path, receipt=receipt_for(hostname="lost-node.example"))
    with workers({}):
        response = make_agent_client(b.agent).post(
            f"/api/heartbeat-runs/{b.run.pk}/finalize?wait=20"
        )
    error = assert_error(response, 409, "finalization_not_acquired")
    assert error["details"]["reason"] == "owner_unverified"
    assert not b.dest_dir.exists()


def test_a_worker_whose_sessions_all_end_mid_copyback_resumes_its_own_finalization(
    tmp_path: Path,
) -> None:
    """What a failover does to a worker, as far as one database server can show it: every
    session ends at once (pg_terminate_backend), so the advisory lock vanishes mid copy-back.
    The attempt stops before publishing anything; the worker survives, reconnects and removes
    its own receipt (it knows that attempt ended), and the next attempt commits. Had the
    receipt removal failed too, only this same process could take it over (same-boot
    evidence); any other worker would hold the run for the board."""
    b = make_binding(tmp_path=tmp_path)
    base = b.source_dir.parent
    (base / "hold").touch()
    with workers({"PAPERCLIP_COPYBACK_BACKEND": GATED}) as [worker]:
        wait_for(lambda: copy_started(base), "copy-back to start", worker)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        (base / "hold").unlink()
        wait_for(lambda: state(b.run) == "committed", "the worker to finish it", worker)
        assert worker.proc.poll() is None  # it lived through losing every session
    operations = dict(
        WorkspaceOperation.objects.filter(heartbeat_run=b.run).values_list("status", "metadata")
    )
    assert set(operations) == {"failed", "succeeded"}  # the lost attempt published nothing
    assert operations["failed"]["error"] in ("ownership_lost", "abandoned_by_previous_owner")
    actions = list(
        ActivityEvent.objects.filter(action__startswith="run.finalization_")
        .order_by("created_at")
        .values_list("action", flat=True)
    )
    # Either the first owner let go of its receipt before the next attempt claimed one, or
    # (the receipt removal's own session was terminated too) this same process took its own
    # receipt over on same-boot evidence; never anyone else, and one commit either way.
    released = [
        "run.finalization_owner_claimed",
        "run.finalization_owner_released",
        "run.finalization_owner_claimed",
        "run.finalization_committed",
        "run.finalization_owner_released",
    ]
    taken_over = [
        "run.finalization_owner_claimed",
        "run.finalization_owner_takeover",
        "run.finalization_committed",
        "run.finalization_owner_released",
    ]
    assert actions in (released, taken_over), actions
    takeovers = ActivityEvent.objects.filter(action="run.finalization_owner_takeover")
    assert [event.details["takeoverBasis"] for event in takeovers] in ([], ["same_boot_joined"])


def test_a_worker_whose_heartbeat_was_in_flight_when_its_session_ended_keeps_running() -> None:
    """Procrastinate stops a worker whose heartbeat raised; a query that was in flight when its
    session was terminated is not a reason to (the pool replaces the connection). The worker's
    row is locked so that its heartbeat UPDATE is waiting on the server when every session
    ends. Without ResilientWorker the worker logs "Side task update_heartbeats failed" and
    stops within the second."""
    with workers({}) as [worker]:

        def heartbeat_waiting() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                )
                return cursor.fetchone()[0] > 0

        with transaction.atomic(), connection.cursor() as cursor:
            # NO KEY UPDATE: the heartbeat's UPDATE waits, a job fetch's foreign-key check
            # (KEY SHARE) does not, so the one query in flight is the heartbeat.
            cursor.execute("SELECT id FROM procrastinate_workers FOR NO KEY UPDATE")
            wait_for(heartbeat_waiting, "the heartbeat to wait on the locked row", worker)
            cursor.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            cursor.execute("SELECT now()")
            ended_at = cursor.fetchone()[0]

        def heartbeat_after_the_loss() -> bool:
            assert worker.proc.poll() is None, f"the worker stopped\n{worker.output()}"
            with connection.cursor() as cursor:
                cursor.execute("SELECT max(last_heartbeat) FROM procrastinate_workers")
                latest = cursor.fetchone()[0]
                return latest is not None and latest > ended_at

        wait_for(heartbeat_after_the_loss, "a heartbeat after the sessions ended", worker)
        assert worker.proc.poll() is None, worker.output()
        assert any("database error in the heartbeat" in line for line in worker.lines)
