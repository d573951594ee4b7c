"""The worker's pieces in this process: deferring in the caller's transaction, the queueing
lock, finalization requests, interval schedules, readiness, the cleanup retry sweep, job errors
recorded by a real (in-process) worker, and the admin pages."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.test import Client
from procrastinate import exceptions as procrastinate_exceptions
from procrastinate.contrib.django import app as procrastinate_app
from procrastinate.contrib.django.models import ProcrastinateJob

from leases.environment.services import environment_cleanups_retry_due
from leases.models import EnvironmentLease
from paperclip.db.clock import db_now
from paperclip.host import kernel_boot_id
from paperclip.models import ActivityEvent, JobError, WorkerProcess
from paperclip.tasks import recover_stalled_jobs
from paperclip.worker import process
from paperclip.worker.jobs import job_defer_in_tx, pending_jobs
from paperclip.worker.process import ResilientWorker
from paperclip.worker.schedule import cron_every
from recovery.locks import finalization_queueing_lock
from recovery.services import finalization_request
from tests.helpers import run_jobs
from tests.leases.environment.factories import EnvironmentLeaseFactory, set_meta
from tests.paperclip.factories import NativeRunFactory, UserFactory
from tests.recovery.factories import make_binding


def _defer(run_id: str = "r", **kw: Any) -> int | None:
    return job_defer_in_tx(
        "finalize_run", queueing_lock=f"finalize-run:{run_id}", company_id="c", run_id=run_id, **kw
    )


@pytest.mark.django_db
def test_a_job_exists_only_if_its_transaction_commits() -> None:
    def cause_that_fails() -> None:
        with transaction.atomic():
            assert _defer("rolled-back") is not None
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        cause_that_fails()
    assert not ProcrastinateJob.objects.filter(queueing_lock="finalize-run:rolled-back").exists()
    with transaction.atomic():
        first = _defer("kept")
        # A second waiting job for the same lock is refused without breaking the transaction.
        assert _defer("kept") is None
        ActivityEvent.objects.count()
    assert [j.id for j in pending_jobs("finalize-run:kept")] == [first]


@pytest.mark.django_db
def test_an_unknown_task_name_fails_loudly() -> None:
    with pytest.raises(procrastinate_exceptions.TaskNotFound), transaction.atomic():
        job_defer_in_tx("no_such_task")


@pytest.mark.parametrize(
    ("seconds", "cron"),
    [
        (1, "* * * * * */1"),
        (15, "* * * * * */15"),
        (30, "* * * * * */30"),
        (60, "* * * * *"),
        (300, "*/5 * * * *"),
        (3600, "0 * * * *"),
    ],
)
def test_intervals_become_cron_schedules(seconds: int, cron: str) -> None:
    assert cron_every(seconds, setting="X") == cron


@pytest.mark.parametrize("seconds", [0, 7, 45, 90, 7200, -5])
def test_an_interval_no_cron_can_keep_is_refused_naming_the_setting(seconds: int) -> None:
    with pytest.raises(ImproperlyConfigured, match="PAPERCLIP_X_SECONDS"):
        cron_every(seconds, setting="PAPERCLIP_X_SECONDS")


@pytest.mark.django_db
def test_a_finalize_request_replaces_a_retry_scheduled_later_and_repeats_write_nothing() -> None:
    b = make_binding(phase="workspace_finalizing")
    later = db_now() + timedelta(minutes=10)
    with transaction.atomic():
        retry = job_defer_in_tx(
            "finalize_run",
            queueing_lock=finalization_queueing_lock(b.run.pk),
            schedule_at=later,
            company_id=str(b.company.pk),
            run_id=str(b.run.pk),
            explicit=False,
        )
    asked = finalization_request(
        company_id=b.company.pk, run_id=b.run.pk, actor_type="agent", actor_id="a"
    )
    assert asked.created
    assert ProcrastinateJob.objects.get(pk=retry).status == "cancelled"
    [waiting] = pending_jobs(finalization_queueing_lock(b.run.pk))
    assert (waiting.id, waiting.args["explicit"]) == (asked.job_id, True)
    audit = ActivityEvent.objects.get(action="run.finalization_requested")
    assert audit.details == {"jobId": asked.job_id, "replacedJobId": retry}
    rows = ActivityEvent.objects.count()
    again = finalization_request(
        company_id=b.company.pk, run_id=b.run.pk, actor_type="agent", actor_id="a"
    )
    assert (again.status, again.job_id, again.created) == ("queued", asked.job_id, False)
    assert ActivityEvent.objects.count() == rows


@pytest.mark.django_db
def test_readyz_names_what_is_not_ready() -> None:
    stale = Client().get("/readyz")
    assert stale.status_code == 503
    assert stale.json() == {"database": "ok", "migrations": "ok", "worker": "stale"}
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO procrastinate_workers (last_heartbeat) VALUES (now() - interval '2 min')"
        )
    assert Client().get("/readyz").json()["worker"] == "stale"
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO procrastinate_workers (last_heartbeat) VALUES (now())")
    ready = Client().get("/readyz")
    assert (ready.status_code, ready.json()) == (
        200,
        {"database": "ok", "migrations": "ok", "worker": "ok"},
    )
    assert Client().get("/healthz").status_code == 200  # liveness never asks for a worker


@pytest.mark.django_db
def test_failed_cleanups_reopen_after_their_back_off_and_not_before() -> None:
    run = NativeRunFactory(status="failed")
    now_ms = int(db_now().timestamp() * 1000)
    due, early = (
        EnvironmentLeaseFactory(
            company=run.company,
            heartbeat_run=run,
            status="pending_cleanup",
            cleanup_status="failed",
        )
        for _ in range(2)
    )
    set_meta(due, pendingCleanupRetryAfterMs=now_ms - 1, pendingCleanupRetryAttempts=2)
    set_meta(early, pendingCleanupRetryAfterMs=now_ms + 60_000, pendingCleanupRetryAttempts=1)
    sweep = environment_cleanups_retry_due()
    assert sweep.reopened == [due.pk]
    due.refresh_from_db()
    early.refresh_from_db()
    assert due.cleanup_status == "pending"
    assert (
        due.metadata["pendingCleanupRetryAfterMs"],
        due.metadata["pendingCleanupRetryAttempts"],
    ) == (0, 2)
    assert early.cleanup_status == "failed"
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_retry_due").count() == 1
    # Idempotent: nothing more is due, nothing is written.
    assert environment_cleanups_retry_due().reopened == []
    assert ActivityEvent.objects.filter(action="environment_lease.cleanup_retry_due").count() == 1
    assert EnvironmentLease.objects.get(pk=early.pk).metadata == early.metadata


@pytest.mark.django_db(transaction=True)
def test_a_failing_job_keeps_its_error_for_the_admin() -> None:
    with transaction.atomic():
        job_id = job_defer_in_tx("finalize_run", company_id="not-a-uuid", run_id="x")
    output = run_jobs()
    assert "running on" in output
    assert ProcrastinateJob.objects.get(pk=job_id).status == "failed"
    error = JobError.objects.get(job_id=job_id)
    assert error.task_name == "finalize_run"
    assert error.error.startswith("ValueError")
    assert "Traceback" in error.traceback
    worker = WorkerProcess.objects.get()
    assert worker.stopped_at is not None  # --once: it stopped cleanly and said so
    assert worker.kernel_boot_id == kernel_boot_id()  # with its host name: which boot it ran in


@pytest.mark.django_db(transaction=True)
def test_the_worker_admin_pages_show_workers_jobs_errors_and_periodic_runs(
    superuser_client: Client,
) -> None:
    with transaction.atomic():
        job_defer_in_tx("finalize_run", company_id="not-a-uuid", run_id="x")
    run_jobs()
    pages = {
        "/admin/paperclip/workerprocess/": "stopped",
        "/admin/procrastinate/procrastinatejob/": "ValueError",
        "/admin/paperclip/joberror/": "ValueError",
        "/admin/procrastinate/procrastinateperiodicdefer/": "schedule",
    }
    for url, text in pages.items():
        page = superuser_client.get(url)
        assert page.status_code == 200, url
        assert text in page.content.decode(), url
    # Jobs name any company's runs: a board member who is not a superuser does not see them.
    staff = Client()
    staff.force_login(UserFactory(is_staff=True))
    for url in pages:
        assert staff.get(url).status_code in (302, 403), url


def test_a_worker_rides_out_database_errors_however_long_they_last() -> None:
    """A lost database is ridden out whatever its length: a worker whose last heartbeat is
    older than the stalled-worker timeout keeps going, and checks when the database is back
    whether it was taken for dead meanwhile (tests/ha/test_failover.py, a 9 s outage)."""
    worker = ResilientWorker(app=procrastinate_app, stalled_worker_timeout=30)
    error = procrastinate_exceptions.ConnectorException()
    worker._ride_out("the heartbeat", error)  # a fresh worker: logged, not raised
    worker._heartbeat_ok_at -= 3600
    worker._ride_out("the heartbeat", error)  # an hour without the database: still logged


def test_stalled_job_recovery_waits_while_this_process_misses_heartbeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A recovery job that runs as the database comes back, before this process's heartbeat
    loop has noticed the outage, must not take the other workers' heartbeats, as stale as its
    own, for death: tests/ha/test_failover.py met it (a recovery deferred before the primary
    was killed ran at its return, retried the other worker's running jobs, and that worker
    stopped). While heartbeats are being missed, the database does not count as back."""
    monkeypatch.setattr(process, "_back_at", time.monotonic() - 1e9)  # never missed one
    monkeypatch.setattr(process, "_missing_after", 2.5)
    monkeypatch.setattr(process, "_heartbeat_at", time.monotonic())
    assert process.database_back_for() > 1e6
    monkeypatch.setattr(process, "_heartbeat_at", time.monotonic() - 15)  # cut off for 15 s
    assert process.database_back_for() == 0
    answer = asyncio.run(recover_stalled_jobs.func(None, timestamp=0))  # type: ignore[arg-type]
    assert answer.startswith("waiting: the database came back 0 s ago")
    monkeypatch.setattr(process, "_missing_after", None)  # no heartbeat loop in this process
    assert process.database_back_for() > 1e6


def test_the_heartbeat_loop_marks_its_heartbeats_and_clears_the_mark_when_it_ends() -> None:
    async def run_briefly() -> tuple[float | None, float | None]:
        worker = ResilientWorker(app=procrastinate_app, update_heartbeat_interval=0.05)
        loop = asyncio.create_task(worker._update_heartbeat())
        await asyncio.sleep(0.01)
        during = process._missing_after
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        return during, process._missing_after

    during, after = asyncio.run(run_briefly())
    assert during == pytest.approx(0.05 * 1.5 + 1)
    assert after is None
