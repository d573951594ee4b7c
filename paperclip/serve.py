"""The production HTTP server: `python -m paperclip.serve [--bind HOST:PORT] [--workers N]
[--threads N]`.

It runs granian (a Rust HTTP server for Python apps) on the WSGI application, with the
settings bench/renew_load.py chose (docs/setup.md#serving, docs/performance.md#renew-capacity):
one worker process per CPU the process may run on, a few threads each for the requests that
wait on PostgreSQL, HTTP/1.1 with keep-alive (agents keep their connections open), no
websockets. gunicorn (gthread) serves the same application and stays a dependency; on this
machine's benchmark it sustained less under the same load.

It also serves `/static/` from the collected static files (`manage.py collectstatic`, into
`<PAPERCLIP_DATA_DIR>/static`), so that the console is styled without a proxy in front; a
proxy that serves them itself never sends those requests on. When nothing has been collected
yet it says so on standard error and serves without them.

The process replaces itself with granian (`exec`), so a supervisor's signals reach the server
directly: SIGTERM or SIGINT stops it gracefully, and it exits non-zero when the application
cannot load (for example, a production process missing DATABASE_URL or DJANGO_SECRET_KEY).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from paperclip.datadir import data_dir

DEFAULT_BIND = "127.0.0.1:8000"
DEFAULT_THREADS = 4
# Requests are short: the longest, `POST …/finalize?wait=`, waits at most 30 s.
WORKER_GRACE_SECONDS = 35


def default_workers() -> int:
    """One worker per CPU this process may run on."""
    return max(1, len(os.sched_getaffinity(0)))


def static_root() -> Path:
    """settings.STATIC_ROOT (`<PAPERCLIP_DATA_DIR>/static`), found without loading them."""
    return data_dir() / "static"


def command(
    *,
    bind: str = DEFAULT_BIND,
    workers: int | None = None,
    threads: int | None = None,
    static: Path | None = None,
) -> list[str]:
    """The server's command line; `static` is a directory to serve under `/static/`."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--bind must be HOST:PORT, not {bind!r}")
    static_options = (
        ["--static-path-route=/static", f"--static-path-mount={static}"] if static else []
    )
    return [
        str(Path(sys.executable).with_name("granian")),
        "--interface=wsgi",
        f"--host={host.strip('[]')}",
        f"--port={port}",
        f"--workers={workers or default_workers()}",
        f"--blocking-threads={threads or DEFAULT_THREADS}",
        "--http=1",
        "--no-ws",
        f"--workers-kill-timeout={WORKER_GRACE_SECONDS}",
        # A worker that dies (OOM killer, SIGKILL) is replaced; one that cannot even load the
        # application crash-loops, and granian then exits 1.
        "--respawn-failed-workers",
        "--log-level=warning",
        *static_options,
        "paperclip.wsgi:application",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m paperclip.serve", description=__doc__)
    parser.add_argument("--bind", default=os.environ.get("PAPERCLIP_BIND", DEFAULT_BIND))
    parser.add_argument("--workers", type=int, help="default: one per CPU")
    parser.add_argument("--threads", type=int, help=f"per worker (default {DEFAULT_THREADS})")
    args = parser.parse_args(argv)
    static = static_root()
    if not static.is_dir():
        print(
            f"paperclip.serve: no static files in {static} (run `manage.py collectstatic`);"
            " serving without /static/",
            file=sys.stderr,
        )
    try:
        argv_ = command(
            bind=args.bind,
            workers=args.workers,
            threads=args.threads,
            static=static if static.is_dir() else None,
        )
    except ValueError as exc:
        parser.error(str(exc))
    os.execv(argv_[0], argv_)  # noqa: S606 - replaces this process with the server


if __name__ == "__main__":
    main()
