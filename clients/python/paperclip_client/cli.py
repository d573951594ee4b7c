"""`paperclip-agent run`: run one command under the workspace's runtime lease, checkpoint it,
publish its workdir as a snapshot and finalize it.

Steps: create the native run (its `workspace_dir` is where the command runs), claim the
workspace's runtime lease as `run:<id>` (waiting out a live holder until it turns stale),
move the run to `running` (a predecessor run of the same agent and workspace whose lease was
taken over is marked `interrupted`), check the workspace head out into the workdir (the head
read once the lease is held is the snapshot's `base`; local work that checkout would overwrite
stops the run unless `--discard-local-changes`), take the run's controller lease, restore
`--resume`'s checkpoint, record the fenced `start` operation, run the command in its own
process group, checkpoint `--session-dir` every `--checkpoint-every` seconds and at exit,
record the fenced `exit` operation, snapshot the workdir (uploading only the blobs the server
lacks) and register it (fenced by the lease's generation), post the result with that
`workspace_tree` and wait until the run is committed: the server then publishes the tree to
the workspace head (merging it with other runs' changes, or holding the run for the board on
a conflict).

Exit status: the command's own; 75 when a lease was lost (the command is stopped and nothing
more is written); 2 for bad usage; 69 when the server cannot be reached; 70 when the run did
not commit (held for the board included); 1 when a step was refused before the command ran
(local changes in the way of the checkout included).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from paperclip_client import history_cli
from paperclip_client.cas import TRANSFER_THREADS
from paperclip_client.cli_output import (
    EXIT_LOST,
    EXIT_NOT_COMMITTED,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    PROG,
    emit,
    fail,
    say,
    warn,
)
from paperclip_client.client import Client
from paperclip_client.errors import PaperclipError, ServerUnreachable
from paperclip_client.runner import Runner

TTL_MIN, TTL_MAX = 60, 86400


class Usage(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Usage(message)


def parser() -> argparse.ArgumentParser:
    top = Parser(prog=PROG, description="Run commands under a Paperclip runtime lease.")
    sub = top.add_subparsers(dest="verb", required=True, parser_class=Parser)
    run = sub.add_parser(
        "run",
        help="run COMMAND as a fenced native run",
        usage=f"{PROG} run --workspace WS --issue ISSUE [options] -- COMMAND ...",
    )
    run.add_argument("--workspace", required=True, help="execution workspace id")
    run.add_argument("--issue", required=True, help="issue id")
    run.add_argument("--session-dir", help="directory to checkpoint (and restore into)")
    run.add_argument(
        "--checkpoint-every", type=float, default=60.0, metavar="S", help="seconds (default 60)"
    )
    run.add_argument(
        "--lease-ttl", type=int, default=300, metavar="S", help="60..86400 (default 300)"
    )
    run.add_argument("--resume", metavar="RUN", help="restore this run's checkpoint first")
    run.add_argument("--workdir", help="where COMMAND runs (default: the current directory)")
    run.add_argument(
        "--discard-local-changes",
        action="store_true",
        help="let checkout overwrite local changes in the workdir",
    )
    run.add_argument(
        "--transfers",
        type=_transfers,
        default=TRANSFER_THREADS,
        metavar="N",
        help=f"requests to the store at once while uploading or fetching, 1..16"
        f" (default {TRANSFER_THREADS})",
    )
    run.add_argument("--url", default=os.environ.get("PAPERCLIP_URL"), help="$PAPERCLIP_URL")
    run.add_argument(
        "--key", default=os.environ.get("PAPERCLIP_AGENT_KEY"), help="$PAPERCLIP_AGENT_KEY"
    )
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    history_cli.add_parsers(sub)
    watch = sub.add_parser(
        "watch",
        help="watch a workdir so that later runs scan only what changed (Linux)",
        description="Watch every directory of the workdir (inotify) until SIGTERM or SIGINT,"
        " and tell `run` which entries changed since its last snapshot: `run` then looks at"
        " those alone. Whenever the watcher cannot vouch for every change (it was not running,"
        " restarted, its queue overflowed, a directory could not be watched) `run` scans the"
        " whole workdir, as it does without a watcher. One watcher per workdir.",
    )
    watch.add_argument("--workdir", help="the directory to watch (default: the current one)")
    watch.add_argument(
        "--max-pending",
        type=_positive,
        default=50_000,
        metavar="N",
        help="changed directories remembered before the watcher gives up on earlier tokens"
        " (the next run then scans in full; default 50000)",
    )
    return top


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text!r}")
    return value


def _watch(args: argparse.Namespace) -> int:
    """`watch`: its modules (ctypes, inotify) load only here."""
    from pathlib import Path

    from paperclip_client.workdir import watching

    workdir = Path(args.workdir or os.getcwd()).absolute()
    try:
        watching.run(workdir, max_pending=args.max_pending, say=say)
    except (watching.Refused, OSError) as exc:
        fail(f"watch: {exc}")
        return EXIT_REFUSED
    return 0


def _transfers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 16:
        raise argparse.ArgumentTypeError(f"must be a number from 1 to 16, not {text!r}")
    return value


def _run_command(args: argparse.Namespace) -> list[str]:
    """`run`'s COMMAND, once its options are checked (Usage otherwise)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise Usage("no COMMAND given (put it after --)")
    if not TTL_MIN <= args.lease_ttl <= TTL_MAX:
        raise Usage(f"--lease-ttl must be from {TTL_MIN} to {TTL_MAX} seconds")
    if args.checkpoint_every <= 0:
        raise Usage("--checkpoint-every must be positive")
    if args.resume and not args.session_dir:
        raise Usage("--resume needs --session-dir (where to restore)")
    problem = history_cli.usage_problem(args)  # the server URL and key, as every verb
    if problem is not None:
        raise Usage(problem)
    return command


def main(argv: Sequence[str] | None = None) -> int:
    verb = "run"
    try:
        args = parser().parse_args(argv)
        verb = args.verb
        if verb == "watch":
            return _watch(args)
        if verb != "run":
            problem = history_cli.usage_problem(args)
            if problem is not None:
                raise Usage(problem)
            return history_cli.run_verb(args)
        command = _run_command(args)
    except Usage as exc:
        fail(f"{exc} (see {PROG} {verb} --help)")
        return EXIT_USAGE
    try:
        with Client(args.url, args.key) as client:
            return Runner(client, args, command).run()
    except ServerUnreachable as exc:
        fail(f"cannot reach the server at {args.url}: {exc.reason}")
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        fail("interrupted")
        return 130


def entry() -> None:
    """Console-script entry point."""
    try:
        sys.exit(main())
    except PaperclipError as exc:  # anything unforeseen from the library: one line, no trace
        fail(str(exc))
        sys.exit(EXIT_REFUSED)


__all__ = [
    "EXIT_LOST",
    "EXIT_NOT_COMMITTED",
    "EXIT_REFUSED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "PROG",
    "Runner",
    "emit",
    "entry",
    "fail",
    "main",
    "parser",
    "say",
    "warn",
]
