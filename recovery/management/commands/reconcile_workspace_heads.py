"""`manage.py reconcile_workspace_heads`: the periodic task of the same name, run once now."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from paperclip.snapshots.head import materializations_reconcile
from paperclip.worker.health import worker_fresh


class Command(BaseCommand):
    help = (
        "Defer a materialization for every workspace whose cwd is behind its head (a crash "
        "part way, a lost job: docs/snapshots.md#materialization); the worker runs them. The "
        "worker runs this every PAPERCLIP_RECONCILE_INTERVAL_SECONDS by itself."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        deferred = materializations_reconcile()
        self.stdout.write(f"deferred {deferred} materialization(s)")
        if deferred and not worker_fresh():
            self.stderr.write(
                "warning: no worker heartbeat is fresh, so nothing will run these jobs; start "
                "one with `manage.py run_worker` (or `make run`)."
            )
