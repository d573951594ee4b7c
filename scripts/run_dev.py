"""`make run`'s last step: the web server and one worker, started and stopped together.

Ctrl-C (SIGINT to the terminal's process group) or SIGTERM stops both: each gets SIGINT, the
worker finishes its running job first, and this script waits for both (killing what is still
there after 60 s). When either exits by itself, the other is stopped the same way and the exit
code is the first one's. Usage: run_dev.py <python> <host:port>
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    python, address = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGTERM, _interrupt)
    # Our own interpreter and manage.py, with arguments from the Makefile: no untrusted input.
    procs = {
        "worker": subprocess.Popen([python, "manage.py", "run_worker"]),  # noqa: S603
        "web": subprocess.Popen([python, "manage.py", "runserver", address]),  # noqa: S603
    }
    code = 0
    try:
        while True:
            ended = [(name, p.returncode) for name, p in procs.items() if p.poll() is not None]
            if ended:
                name, code = ended[0]
                print(f"run: the {name} process exited ({code}); stopping the rest", flush=True)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        code = 130
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        except KeyboardInterrupt:  # a second Ctrl-C: stop waiting
            proc.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
