"""What `paperclip-agent` tells its caller: its exit statuses and its lines (one write each,
prefixed with the program's name), and the wording shared by several of them."""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import datetime
from typing import TextIO

EXIT_LOST = 75
EXIT_USAGE = 2
EXIT_UNREACHABLE = 69
EXIT_NOT_COMMITTED = 70
EXIT_REFUSED = 1
PROG = "paperclip-agent"


def emit(stream: TextIO, line: str) -> None:
    """One line in one write: the command's output shares our stdout and stderr, and print()
    writes the text and its newline apart, which an unbuffered stream (PYTHONUNBUFFERED)
    sends as two writes with the command's output free to land between them. A stream whose
    reader went away (`| head`) is silenced: the run goes on without its lines."""
    try:
        stream.write(f"{line}\n")
        stream.flush()
    except BrokenPipeError:
        silence(stream)


def silence(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null (its reader is gone): later writes, and the
    interpreter's flush at exit, go nowhere instead of raising."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)


def say(line: str) -> None:
    emit(sys.stdout, f"{PROG}: {line}")


def warn(line: str) -> None:
    emit(sys.stderr, f"{PROG}: warning: {line}")


def fail(line: str) -> None:
    emit(sys.stderr, f"{PROG}: error: {line}")


def when(moment: datetime | None) -> str:
    return "never" if moment is None else moment.isoformat()


def orphan_clause(orphaned_at: datetime | str | None) -> str:
    if orphaned_at is None:
        return (
            "it holds no lease, so it is never judged orphaned: it must end, or the board "
            "interrupt it"
        )
    when = orphaned_at.isoformat() if isinstance(orphaned_at, datetime) else orphaned_at
    return (
        f"it counts as orphaned from {when} if nothing renews it, and a run start then "
        "takes the issue over"
    )
