"""Which machine boot this process runs under: the kernel boot id.

Linux mints `/proc/sys/kernel/random/boot_id` afresh at every boot, so together with the host
name it tells a process of this boot from one of an earlier boot (or of another machine that
happens to carry the same name) whose PID may since have been reused
(docs/recovery.md#controller-identity). Containers on one kernel share it, so it adds nothing
there, and they keep being told apart by their host names.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Final

BOOT_ID_PATH: Final = Path("/proc/sys/kernel/random/boot_id")


def read_kernel_boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """The kernel boot id stored at `path`, or None when it can't be read or is empty (not
    Linux, a sandbox hiding /proc)."""
    try:
        value = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value or None


@functools.cache
def kernel_boot_id() -> str | None:
    """This machine's kernel boot id, read once per process (a fork keeps the same kernel)."""
    return read_kernel_boot_id()
