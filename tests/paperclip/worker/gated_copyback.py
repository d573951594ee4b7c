"""A copy-back backend for worker-process tests: it announces that copying started, then waits
(checking ownership) while a `hold` file exists beside the run's workspace directory, then copies
like the default backend. The test controls it through those two files."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from uuid import UUID

from recovery.adapters.copyback import CopybackReport, LocalDirectoryCopyback


class GatedCopyback(LocalDirectoryCopyback):
    def copy_back(
        self, *, run_id: UUID, source: str, destination: str, check: Callable[[], None]
    ) -> CopybackReport:
        base = Path(source).parent
        (base / f"copy-started-{os.getpid()}").write_text(str(os.getpid()))
        while (base / "hold").exists():
            check()
            time.sleep(0.05)
        return super().copy_back(run_id=run_id, source=source, destination=destination, check=check)


class SlowCopyback(LocalDirectoryCopyback):
    """Announces the copy like GatedCopyback, then copies like the default backend after a
    pause of PAPERCLIP_TEST_COPY_SECONDS (default 1.5 s), checking ownership every 50 ms
    meanwhile: a window for faults mid copy-back."""

    def copy_back(
        self, *, run_id: UUID, source: str, destination: str, check: Callable[[], None]
    ) -> CopybackReport:
        (Path(source).parent / f"copy-started-{os.getpid()}").write_text(str(os.getpid()))
        deadline = time.monotonic() + float(os.environ.get("PAPERCLIP_TEST_COPY_SECONDS", "1.5"))
        while time.monotonic() < deadline:
            check()
            time.sleep(0.05)
        return super().copy_back(run_id=run_id, source=source, destination=destination, check=check)
