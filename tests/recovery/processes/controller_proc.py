"""A finalization controller in its own OS process, for crash tests.

    python -m tests.recovery.processes.controller_proc <mode> <company_id> <run_id> <status_dir>

Modes:
- crash_during_real_copyback: run the real `run_finalize` (workspace_finalize row running,
  coordinator workspace_finalizing) with a copy-back backend whose detached child keeps
  writing into <status_dir>/orphan.log; report "ready", then block until SIGKILLed.
- exit_after_barrier: claim ownership, record a succeeded workspace_finalize barrier, then
  exit abruptly (no cleanup: the receipt stays behind).
- try: attempt ownership once with a trivial action; print the outcome as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

ORPHAN_WRITER = """
import sys, time
path = sys.argv[1]
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    with open(path, "a") as fh:
        fh.write("copy chunk\\n")
    time.sleep(0.05)
"""


STATUS_DIR: Path | None = None


def _start_orphan(status: Path) -> None:
    orphan = subprocess.Popen(
        [sys.executable, "-c", ORPHAN_WRITER, str(status / "orphan.log")],
        start_new_session=True,
    )
    (status / "orphan.pid").write_text(str(orphan.pid))
    # "ready" must mean the orphan is already copying: the test reads orphan.log right after.
    deadline = time.monotonic() + 30
    while not (status / "orphan.log").exists():
        if orphan.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the orphan never started writing orphan.log")
        time.sleep(0.01)  # polling an observable state


class DetachedChildCopyback:
    """A copy-back that hands the copy to a detached child (like tar/rsync) and waits."""

    def copy_back(self, *, run_id: UUID, source: str, destination: str, check: object) -> None:
        assert STATUS_DIR is not None
        _start_orphan(STATUS_DIR)
        (STATUS_DIR / "ready").write_text("ready")
        time.sleep(120)  # the test SIGKILLs us long before this


def main() -> None:
    global STATUS_DIR
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
    django.setup()
    from django.conf import settings

    from paperclip.models import HeartbeatRun, WorkspaceOperation
    from recovery.services import Acquired, run_finalize, with_finalization_ownership

    mode, company_id, run_id, status_dir = sys.argv[1:5]
    status = Path(status_dir)
    STATUS_DIR = status
    if mode == "crash_during_real_copyback":
        settings.PAPERCLIP_COPYBACK_BACKEND = f"{__name__}.DetachedChildCopyback"
        run_finalize(company_id=UUID(company_id), run_id=UUID(run_id))
        return

    def exit_after_barrier(own: object) -> None:
        run = HeartbeatRun.objects.get(pk=run_id)
        WorkspaceOperation.objects.create(
            company_id=run.company_id,
            heartbeat_run_id=run.pk,
            issue_id=run.native_issue_id,
            phase="workspace_finalize",
            status="succeeded",
        )
        (status / "ready").write_text("ready")
        os._exit(0)  # abrupt: no receipt cleanup, no lock release by us

    actions = {"exit_after_barrier": exit_after_barrier}
    outcome = with_finalization_ownership(
        company_id=UUID(company_id),
        run_id=UUID(run_id),
        action=actions.get(mode, lambda own: "ran"),
    )
    if isinstance(outcome, Acquired):
        print(json.dumps({"acquired": True, "value": outcome.value}))
    else:
        print(json.dumps({"acquired": False, "reason": outcome.reason}))


if __name__ == "__main__":
    main()
