"""Running a worker process (docs/worker.md#running-workers).

The worker is Procrastinate's own: it polls and LISTENs on a connection pool of its own, runs
sync tasks in threads (Django connections cleaned around each), heartbeats every
PAPERCLIP_WORKER_HEARTBEAT_SECONDS and stops gracefully on SIGINT / SIGTERM, waiting for its
running jobs. Around it this module adds what the admin shows: where the worker runs (host, pid,
started), and the exception each failed job ended with.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import psutil
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from django.db.models.functions import Now
from procrastinate import JobContext, exceptions
from procrastinate import worker as procrastinate_worker
from procrastinate.contrib.django import app
from procrastinate.jobs import Job, Status
from procrastinate.manager import JobManager

from paperclip.compat import HookedWorker, Upstream
from paperclip.db.errors import connection_lost
from paperclip.host import kernel_boot_id
from paperclip.models import JobError, WorkerProcess
from paperclip.observability import metrics
from paperclip.observability.context import log_context

logger = logging.getLogger(__name__)
job_logger = logging.getLogger("paperclip.jobs")


def _record_error(
    context: JobContext, worker: procrastinate_worker.Worker, exc: BaseException
) -> None:
    try:
        JobError.objects.create(
            job_id=context.job.id or 0,
            task_name=context.job.task_name,
            attempt=context.job.attempts,
            error=f"{type(exc).__name__}: {exc}"[:4000],
            traceback="".join(traceback.format_exception(exc))[-20000:],
            worker_id=worker.worker_id,
        )
    except Exception:  # the job's own failure is what matters; never mask it
        logger.exception("could not record the error of job %s", context.job.id)
    finally:
        close_old_connections()


class _JobObservation:
    """A job's log context, and after it its counters and its one `paperclip.jobs` line."""

    def __init__(self, context: JobContext) -> None:
        self.task = context.job.task_name
        self.periodic = context.job.queue == "maintenance"
        self.fields = {"job_id": context.job.id, "task": self.task, "attempt": context.job.attempts}
        self.token = log_context.set(dict(self.fields))
        self.started = time.perf_counter()

    def finish(self, outcome: str, result: object = None) -> None:
        elapsed = time.perf_counter() - self.started
        metrics.JOBS.labels(self.task, outcome).inc()
        metrics.JOB_DURATION.labels(self.task).observe(elapsed)
        # A periodic job that succeeded is routine: at PAPERCLIP_PERIODIC_JOB_LOG_LEVEL (DEBUG
        # under `make run`), so an idle server is quiet; what it changed has its audit lines.
        level = (
            logging.getLevelName(settings.PAPERCLIP_PERIODIC_JOB_LOG_LEVEL)
            if self.periodic and outcome == "succeeded"
            else logging.INFO
        )
        job_logger.log(
            level,
            "job %s %s %s in %.3f s%s",
            self.fields["job_id"],
            self.task,
            outcome,
            elapsed,
            f": {result}" if isinstance(result, str) else "",
            extra={"job": {**self.fields, "outcome": outcome, "duration_ms": elapsed * 1000}},
        )
        log_context.reset(self.token)


def record_errors(
    call_next: Callable[[], Any], context: JobContext, worker: procrastinate_worker.Worker
) -> Any:
    """Sync task middleware: the job's log context and metrics; keep the exception a sync job
    ends with, then let it fail."""
    observation = _JobObservation(context)
    try:
        result = call_next()
    except Exception as exc:
        _record_error(context, worker, exc)
        observation.finish("failed")
        raise
    observation.finish("succeeded", result)
    return result


async def record_errors_async(
    call_next: Callable[[], Awaitable[Any]],
    context: JobContext,
    worker: procrastinate_worker.Worker,
) -> Any:
    """Async task middleware: the same for async jobs."""
    observation = _JobObservation(context)
    try:
        result = await call_next()
    except Exception as exc:
        await sync_to_async(_record_error, thread_sensitive=False)(context, worker, exc)
        observation.finish("failed")
        raise
    observation.finish("succeeded", result)
    return result


class ResilientWorker(HookedWorker):
    """Procrastinate's worker, riding out a lost database session.

    Procrastinate stops a worker when one of its side tasks raises: right for a bug, wrong for
    a heartbeat or a periodic defer whose query was in flight when its session ended (a
    failover, `pg_terminate_backend`): the pool replaces the connection at the next checkout.
    Here a database error in the heartbeat, the periodic deferrer, the LISTEN connection
    (reopened, on the new primary after a failover: docs/ha.md) or the job fetch is logged
    and the loop goes on after a pause, however long the database stays away.

    An outage longer than the stalled-worker timeout may have let another worker (one that
    could still reach the database) take this one for dead and retry its running jobs. So
    the first heartbeat after such an outage checks: when this worker's registration is gone
    or one of its running jobs is no longer its own, it stops as Procrastinate would (after
    its running jobs; its supervisor restarts it); otherwise it carries on. And while the
    database has been back for less than that timeout, this process's stalled-job recovery
    waits (`database_back_for`): every worker was cut off alike, and needs a heartbeat's time
    to show it is alive (docs/worker.md#postgresql-failover).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._heartbeat_ok_at = time.monotonic()

    def _missing_after(self) -> float:
        """How long without a heartbeat written means heartbeats are being missed."""
        return float(self.update_heartbeat_interval) * 1.5 + 1

    async def heartbeat_loop(self, upstream: Upstream) -> None:
        # Replaces upstream's loop: same interval, but a database error does not end it.
        _heartbeat_written(missing_after=self._missing_after(), after_missing=False)
        try:
            while True:
                await asyncio.sleep(self.update_heartbeat_interval)
                if self.worker_id is None:  # set by run() before the side tasks start
                    continue
                try:
                    await self.app.job_manager.update_heartbeat(self.worker_id)
                except exceptions.ConnectorException as exc:
                    self._ride_out("the heartbeat", exc)
                    continue
                silent = time.monotonic() - self._heartbeat_ok_at
                self._heartbeat_ok_at = time.monotonic()
                missed = silent > self._missing_after()
                _heartbeat_written(missing_after=self._missing_after(), after_missing=missed)
                if missed:
                    await self._requeue_lost_jobs()
                if silent > self.stalled_worker_timeout:
                    await self._after_long_outage(silent)
        finally:
            _heartbeat_loop_ended()

    async def _requeue_lost_jobs(self) -> None:
        """After missed heartbeats: jobs `doing` under this worker that it no longer runs are
        lost: their outcome was recorded on a primary that died before shipping it
        (asynchronous replication), or never. They are queued again, as a stalled worker's
        would be (our jobs are safe to run again). Only jobs started over a second ago (by the
        database's clock) count: one fetched while this query runs is not in the running set
        yet, and the lost ones started before the outage, longer ago than that."""
        try:
            rows = await self.app.connector.execute_query_all_async(
                "SELECT j.id FROM procrastinate_jobs j WHERE j.worker_id = %(worker)s"
                " AND j.status = 'doing' AND (SELECT max(e.at) FROM procrastinate_events e"
                " WHERE e.job_id = j.id AND e.type = 'started') < now() - interval '1 second'",
                worker=self.worker_id,
            )
            running = set(self.running_job_ids())  # after the query
            for job_id in [row["id"] for row in rows if row["id"] not in running]:
                [job] = await self.app.job_manager.list_jobs_async(id=job_id)
                outcome = await requeue_job(self.app.job_manager, job)
                logger.warning(
                    "worker %s: job %s (%s) was left doing with its outcome lost; %s",
                    self.worker_id,
                    job_id,
                    job.task_name,
                    outcome,
                )
        except exceptions.ConnectorException as exc:
            self._ride_out("looking for lost jobs", exc)

    async def _after_long_outage(self, silent: float) -> None:
        """Carry on only if nobody took this worker for dead while it was cut off."""
        running = self.running_job_ids()
        try:
            rows = await self.app.connector.execute_query_all_async(
                "SELECT (SELECT count(*) FROM procrastinate_workers WHERE id = %(worker)s)"
                " AS registered, (SELECT count(*) FROM procrastinate_jobs"
                " WHERE id = ANY(%(jobs)s) AND (status = 'todo'"
                " OR (status = 'doing' AND worker_id IS DISTINCT FROM %(worker)s))) AS taken",
                worker=self.worker_id,
                jobs=running,
            )
        except exceptions.ConnectorException as exc:
            self._ride_out("the check after an outage", exc)
            self._heartbeat_ok_at -= silent  # check again at the next heartbeat
            return
        registered, taken = rows[0]["registered"], rows[0]["taken"]
        if registered and not taken:
            logger.warning(
                "worker %s: back after %.0f s without the database; none of its %d running"
                " job(s) was taken over: carrying on",
                self.worker_id,
                silent,
                len(running),
            )
            return
        logger.error(
            "worker %s: back after %.0f s without the database, and taken for dead meanwhile"
            " (%s); stopping after its running jobs",
            self.worker_id,
            silent,
            "its registration was pruned" if not registered else f"{taken} job(s) retried",
        )
        self.stop()  # type: ignore[no-untyped-call]

    async def periodic_deferrer_loop(self, upstream: Upstream) -> None:
        # Started at once, in every worker (`make run`'s included): nothing delays recovery of
        # work in flight after a restart (docs/worker.md#tasks).
        while True:
            try:
                return await upstream()
            except exceptions.ConnectorException as exc:
                self._ride_out("the periodic deferrer", exc)
            await asyncio.sleep(1.0)

    def side_tasks_start(
        self, upstream: Callable[[], list[asyncio.Task[Any]]]
    ) -> list[asyncio.Task[Any]]:
        # Procrastinate's listener reconnects after a lost session but dies when the
        # reconnection itself fails (no primary yet during a failover); this one keeps trying.
        listen, self.listen_notify = self.listen_notify, False
        try:
            side_tasks = upstream()
        finally:
            self.listen_notify = listen
        if listen:
            side_tasks.append(asyncio.create_task(self._listen(), name="listener"))
        return side_tasks

    async def _listen(self) -> None:
        while True:
            try:
                await self.jobs_listen()
            except exceptions.ConnectorException as exc:
                # Meanwhile the fetch loop polls every PAPERCLIP_WORKER_POLL_SECONDS.
                self._ride_out("listening for jobs", exc)
            await asyncio.sleep(1.0)

    async def jobs_fetch(self, upstream: Upstream) -> None:
        try:
            await upstream()
        except exceptions.ConnectorException as exc:
            # The worker loop waits for a notification or the next poll, then fetches again.
            self._ride_out("fetching jobs", exc)

    async def job_status_persist(self, upstream: Upstream, *, job: Job) -> None:
        """Record a finished job's outcome, waiting for the database when it is away: given up,
        the job's row would stay `doing` under a live worker, and nothing would ever recover
        it. An error other than a lost connection is raised as before."""
        while True:
            try:
                await upstream()
            except exceptions.ConnectorException as exc:
                if not connection_lost(exc.__cause__):
                    raise
                self._ride_out(f"recording the outcome of job {job.id}", exc)
                await asyncio.sleep(1.0)
            else:
                return

    def _ride_out(self, what: str, exc: exceptions.ConnectorException) -> None:
        logger.warning(
            "worker %s: database error in %s (%s); retrying",
            self.worker_id,
            what,
            " ".join(str(exc.__cause__ or exc).split()),
        )


# When this process's worker last wrote a heartbeat after missing some (the database was
# away): stalled-job recovery waits a stalled timeout from then (`database_back_for`).
_back_at = time.monotonic() - 1e9
# When it last wrote one at all, and how long without one means it is missing them (None: no
# worker runs in this process).
_heartbeat_at = time.monotonic()
_missing_after: float | None = None


def _heartbeat_written(*, missing_after: float, after_missing: bool) -> None:
    global _back_at, _heartbeat_at, _missing_after
    _heartbeat_at, _missing_after = time.monotonic(), missing_after
    if after_missing:
        _back_at = _heartbeat_at


def _heartbeat_loop_ended() -> None:
    global _missing_after
    _missing_after = None  # no heartbeats to miss: `database_back_for` stops looking


async def requeue_job(manager: JobManager, job: Job) -> str:
    """Queue a job again whose worker lost it (stalled, or its outcome lost); when its
    queueing lock is taken by a waiting job (the reconciler deferred the same work), close it
    as failed instead: the waiting job does that work. Says which."""
    try:
        await manager.retry_job(job)
    except exceptions.UniqueViolation:
        await manager.finish_job(job, status=Status.FAILED, delete_job=False)
        return "closed (the same work is already queued)"
    return "queued again"


def database_back_for() -> float:
    """Seconds since this process's worker wrote a heartbeat again after missing some (very
    large when it never missed one); 0 while its heartbeats are being missed now. That covers
    a job that runs as the database comes back, before the heartbeat loop has noticed the
    outage: every other worker's heartbeat is as stale as this one's, and taking their
    silence for death then would retry their running jobs under them."""
    now = time.monotonic()
    if _missing_after is not None and now - _heartbeat_at > _missing_after:
        return 0.0
    return now - _back_at


def _register(worker_id: int, *, concurrency: int, queues: Sequence[str]) -> None:
    process = psutil.Process(os.getpid())
    WorkerProcess.objects.update_or_create(
        worker_id=worker_id,
        defaults={
            "hostname": socket.gethostname(),
            "pid": process.pid,
            "process_started_at": datetime.fromtimestamp(process.create_time(), tz=UTC),
            "kernel_boot_id": kernel_boot_id(),
            "concurrency": concurrency,
            "queues": list(queues),
            "stopped_at": None,
        },
    )
    close_old_connections()


def _unregister(worker_id: int) -> None:
    WorkerProcess.objects.filter(worker_id=worker_id).update(stopped_at=Now())
    close_old_connections()


async def _serve(
    worker: procrastinate_worker.Worker,
    *,
    concurrency: int,
    queues: Sequence[str],
    on_started: Callable[[int], None] | None,
) -> None:
    run = asyncio.create_task(worker.run(), name="procrastinate worker")  # type: ignore[no-untyped-call]
    while worker.worker_id is None and not run.done():
        await asyncio.sleep(0.02)
    worker_id = worker.worker_id
    if worker_id is not None:
        await sync_to_async(_register, thread_sensitive=False)(
            worker_id, concurrency=concurrency, queues=queues
        )
        if on_started is not None:
            on_started(worker_id)
    try:
        await run
    finally:
        if worker_id is not None:
            await sync_to_async(_unregister, thread_sensitive=False)(worker_id)


def _already_stopping(signum: int, frame: object) -> None:
    logger.warning("the worker is already stopping: waiting for its running jobs to finish")


def worker_run(
    *,
    concurrency: int = 1,
    queues: Sequence[str] = (),
    name: str | None = None,
    wait: bool = True,
    on_started: Callable[[int], None] | None = None,
) -> None:
    """Run one worker in the foreground until SIGINT / SIGTERM (or, with `wait=False`, until no
    job is left). `queues` empty: every queue."""
    middleware = [
        *app.worker_defaults.get("task_middleware", []),
        record_errors,
        record_errors_async,
    ]
    # Procrastinate's Django connector is for deferring inside Django's transactions (and stays
    # so for our services: paperclip/worker/jobs.py defers through its own Django-bound job
    # manager); the worker polls, listens, heartbeats and defers periodic jobs on a psycopg
    # pool instead, which replaces connections that died (a failover, a terminated session).
    worker_connector = app.connector.get_worker_connector()  # type: ignore[attr-defined]
    # Procrastinate stops gracefully on the first SIGINT / SIGTERM and then restores the
    # handlers it found: make those "ignore, the worker is already stopping" so that a second
    # Ctrl-C (or the one a supervisor passes on) cannot cancel the running job half-way.
    # SIGKILL still stops the process at once.
    previous = {
        sig: signal.signal(sig, _already_stopping) for sig in (signal.SIGINT, signal.SIGTERM)
    }

    async def main() -> None:
        with app.replace_connector(worker_connector) as worker_app:
            async with worker_app.open_async():
                worker = ResilientWorker(
                    app=worker_app,
                    queues=list(queues) or None,
                    name=name or f"{socket.gethostname()}:{os.getpid()}",
                    concurrency=concurrency,
                    wait=wait,
                    fetch_job_polling_interval=settings.PAPERCLIP_WORKER_POLL_SECONDS,
                    update_heartbeat_interval=settings.PAPERCLIP_WORKER_HEARTBEAT_SECONDS,
                    stalled_worker_timeout=settings.PAPERCLIP_WORKER_STALLED_AFTER_SECONDS,
                    task_middleware=middleware,
                )
                await _serve(worker, concurrency=concurrency, queues=queues, on_started=on_started)

    try:
        asyncio.run(main())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
