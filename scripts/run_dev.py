"""`make run`'s last step: the web server and one worker, started and stopped together.

Ctrl-C in the terminal reaches every process of the group: both children stop by themselves
(the worker lets its running job finish first). A SIGTERM to this script alone is passed on as
SIGINT. Either way this script waits for both, passing SIGINT on after 5 s to a child that still
runs, and killing what is left after 60 s. A worker that exits by itself is restarted after 2 s
(as systemd's Restart=always would); when the web server exits, the worker is stopped the same
way and the exit code is the web server's. The metrics directory is emptied first. Usage:
run_dev.py <python> <host:port>
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

received: list[int] = []


def _interrupt(signum: int, frame: object) -> None:
    received.append(signum)
    raise KeyboardInterrupt


def _wait(procs: dict[str, subprocess.Popen[bytes]], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs.values()):
        time.sleep(0.1)


def _empty_metrics_dir() -> None:
    """The counters of an earlier `make run` are not this one's (docs/operations.md#metrics)."""
    data = Path(os.environ.get("PAPERCLIP_DATA_DIR", ".data"))
    directory = Path(os.environ.get("PAPERCLIP_METRICS_DIR", data / "metrics"))
    for stale in directory.glob("*.db"):
        stale.unlink(missing_ok=True)


def main() -> int:
    python, address = sys.argv[1], sys.argv[2]
    _empty_metrics_dir()
    # Handle Ctrl-C and SIGTERM even when started with SIGINT ignored (a background job of a
    # script), and give the children the default SIGINT so that they stop when told to.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)

    def start(*args: str) -> subprocess.Popen[bytes]:
        # Our own interpreter and manage.py, arguments from the Makefile: no untrusted input.
        return subprocess.Popen(  # noqa: S603
            [python, "manage.py", *args],
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )

    procs = {"worker": start("run_worker"), "web": start("runserver", address)}
    code = 0
    try:
        while True:
            if procs["web"].poll() is not None:
                code = procs["web"].returncode
                print(f"run: the web server exited ({code}); stopping the worker", flush=True)
                break
            if procs["worker"].poll() is not None:
                # As a process supervisor would (systemd's Restart=always in production).
                print(
                    f"run: the worker exited ({procs['worker'].returncode}); restarting it in 2 s",
                    flush=True,
                )
                time.sleep(2)
                procs["worker"] = start("run_worker")
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = 130
    # Ignore further signals while we stop the children in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if received[:1] == [signal.SIGINT]:
        _wait(procs, 5)  # a terminal's Ctrl-C reached the children too
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    _wait(procs, 60)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
