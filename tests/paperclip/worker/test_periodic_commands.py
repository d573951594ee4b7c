"""Every periodic task has a `manage.py` command of the same name that runs it once now,
through the same service, printing what it did (docs/worker.md#tasks)."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command, get_commands
from django.db import connection, transaction
from django.db.models.functions import Now
from procrastinate.contrib.django import app as procrastinate_app
from procrastinate.contrib.django.models import ProcrastinateJob

from paperclip.models import ExecutionWorkspace, HeartbeatRun, JobError, WorkerProcess
from paperclip.worker.jobs import job_defer_in_tx
from tests.leases.factories import expire, running_run
from tests.paperclip.factories import ExecutionWorkspaceFactory


def _run(name: str, *args: str) -> list[str]:
    out = io.StringIO()
    call_command(name, *args, stdout=out, stderr=io.StringIO())
    return out.getvalue().splitlines()


def test_every_periodic_task_has_a_command_of_the_same_name() -> None:
    periodic = {
        task.task.name for task in procrastinate_app.periodic_registry.periodic_tasks.values()
    }
    assert {"interrupt_orphaned_runs", "reconcile_finalizations", "cas_collect"} <= periodic
    assert sorted(periodic - set(get_commands())) == []


@pytest.mark.django_db
def test_interrupt_orphaned_runs_interrupts_a_run_orphaned_past_the_grace(settings: Any) -> None:
    settings.PAPERCLIP_ORPHANED_RUN_GRACE_SECONDS = 600
    run, _claim = running_run()
    expire(run.execution_workspace, seconds_ago=3600)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE heartbeat_runs SET started_at = now() - interval '2 hours' WHERE id = %s",
            [run.pk],
        )
    lines = _run("interrupt_orphaned_runs")
    assert lines == [
        "looking for runs orphaned for more than 600 s",
        f"  run {run.pk}: interrupted",
        "orphaned past the grace 1: interrupted 1, revived 0, failed 0",
    ]
    assert HeartbeatRun.objects.get(pk=run.pk).status == "interrupted"
    assert _run("interrupt_orphaned_runs")[-1] == (
        "orphaned past the grace 0: interrupted 0, revived 0, failed 0"
    )


@pytest.mark.django_db
def test_reconcile_workspace_heads_defers_a_materialization_for_a_cwd_behind_its_head(
    tmp_path: Any,
) -> None:
    behind = ExecutionWorkspaceFactory(cwd=str(tmp_path / "cwd"))
    ExecutionWorkspace.objects.filter(pk=behind.pk).update(head_tree="sha256:" + "a" * 64)
    assert _run("reconcile_workspace_heads") == ["deferred 1 materialization(s)"]
    assert ProcrastinateJob.objects.filter(task_name="materialize_workspace").count() == 1
    # Already queued: deferred again only once that job has run.
    assert _run("reconcile_workspace_heads") == ["deferred 0 materialization(s)"]


@pytest.mark.django_db(transaction=True)
def test_recover_stalled_jobs_retries_the_job_of_a_silent_worker() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO procrastinate_workers (last_heartbeat)"
            " VALUES (now() - interval '1 hour') RETURNING id"
        )
        worker_id = cursor.fetchone()[0]
    with transaction.atomic():
        job_id = job_defer_in_tx("reconcile_finalizations", timestamp=0)
    ProcrastinateJob.objects.filter(pk=job_id).update(status="doing", worker_id=worker_id)

    lines = _run("recover_stalled_jobs")

    assert lines[1:] == [
        f"  job {job_id} (reconcile_finalizations): queued again",
        "stalled 1: retried 1, closed 0 (work already queued)",
    ]
    assert ProcrastinateJob.objects.get(pk=job_id).status == "todo"
    assert (
        _run("recover_stalled_jobs")[-1] == "stalled 0: retried 0, closed 0 (work already queued)"
    )


@pytest.mark.django_db(transaction=True)
def test_remove_old_jobs_removes_what_finished_before_the_retention(settings: Any) -> None:
    settings.PAPERCLIP_JOB_RETENTION_HOURS = 24
    old = Now() - timedelta(days=3)
    error = JobError.objects.create(job_id=1, task_name="t", attempt=1, error="boom")
    JobError.objects.filter(pk=error.pk).update(occurred_at=old)
    JobError.objects.create(job_id=2, task_name="t", attempt=1, error="recent")
    WorkerProcess.objects.create(
        worker_id=987654, hostname="gone", pid=1, process_started_at=Now(), concurrency=1
    )
    WorkerProcess.objects.filter(worker_id=987654).update(stopped_at=old)

    lines = _run("remove_old_jobs")

    assert lines == [
        "removing what finished more than 24 h ago",
        "removed jobs older than 24 h, 1 job error(s), 1 worker record(s)",
    ]
    assert list(JobError.objects.values_list("error", flat=True)) == ["recent"]
    assert not WorkerProcess.objects.filter(worker_id=987654).exists()
