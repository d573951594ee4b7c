"""`manage.py run_worker [--concurrency N] [--queue Q ...] [--once]`: run one worker process."""

from __future__ import annotations

import os
import socket
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.worker.process import worker_run

QUEUES = ("finalization", "maintenance")


class Command(BaseCommand):
    help = (
        "Run a Procrastinate worker: finalizations and the periodic maintenance tasks. Start "
        "as many as you like, on any number of machines, against the one database; each job "
        "runs once. Stops gracefully on Ctrl-C / SIGTERM, waiting for running jobs."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--concurrency",
            type=int,
            default=1,
            help="Jobs run at once by this process (threads; default 1).",
        )
        parser.add_argument(
            "--queue",
            action="append",
            choices=QUEUES,
            dest="queues",
            help="Only this queue (repeatable; default: every queue).",
        )
        parser.add_argument(
            "--once",
            action="store_true",
            help="Run the jobs that are due now, then exit (maintenance and tests).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        concurrency: int = options["concurrency"]
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        queues: list[str] = options["queues"] or []

        def started(worker_id: int) -> None:
            self.stdout.write(
                f"worker {worker_id} running on {socket.gethostname()} (pid {os.getpid()}), "
                f"queues {', '.join(queues) or 'all'}, concurrency {concurrency}; heartbeat "
                f"every {settings.PAPERCLIP_WORKER_HEARTBEAT_SECONDS:g} s. Ctrl-C stops it."
            )
            self.stdout.flush()

        worker_run(
            concurrency=concurrency, queues=queues, wait=not options["once"], on_started=started
        )
        self.stdout.write("worker stopped")
