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
import collections
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import IO, Any, NoReturn, TextIO, TypeVar

from paperclip_client.client import Client
from paperclip_client.errors import (
    ApiError,
    ConflictError,
    DatabaseUnavailable,
    FinalizationNotAcquired,
    IssueExecutionLocked,
    OutcomeUnknown,
    PaperclipError,
    ServerUnreachable,
    SnapshotBlobsMissing,
    WorkspaceRuntimeLeaseConflict,
)
from paperclip_client.keepers import ControllerLeaseKeeper, LeaseLost, RuntimeLeaseKeeper
from paperclip_client.session import CheckpointError, SessionCheckpointer, restore
from paperclip_client.trees import TreeError
from paperclip_client.workdir import (
    TRANSFER_THREADS,
    ClientStore,
    SnapshotResult,
    WorkdirError,
    checkout,
    commit_snapshot,
    snapshot,
)

T = TypeVar("T")
EXIT_LOST = 75
EXIT_USAGE = 2
EXIT_UNREACHABLE = 69
EXIT_NOT_COMMITTED = 70
EXIT_REFUSED = 1
TTL_MIN, TTL_MAX = 60, 86400
CONTROLLER_TTL_MAX = 3600
STOP_GRACE_SECONDS = 10.0
PATIENCE_SECONDS = 600.0
PATIENCE_PAUSE_SECONDS = 2.0
TAIL_BYTES = 4000
PROG = "paperclip-agent"


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
    return top


def _transfers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 16:
        raise argparse.ArgumentTypeError(f"must be a number from 1 to 16, not {text!r}")
    return value


def emit(stream: TextIO, line: str) -> None:
    """One line in one write: the command's output shares our stdout and stderr, and print()
    writes the text and its newline apart, which an unbuffered stream (PYTHONUNBUFFERED)
    sends as two writes with the command's output free to land between them."""
    stream.write(f"{line}\n")
    stream.flush()


def say(line: str) -> None:
    emit(sys.stdout, f"{PROG}: {line}")


def warn(line: str) -> None:
    emit(sys.stderr, f"{PROG}: warning: {line}")


def fail(line: str) -> None:
    emit(sys.stderr, f"{PROG}: error: {line}")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
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
        if not args.url:
            raise Usage("no server URL: give --url or set PAPERCLIP_URL")
        if not args.key:
            raise Usage("no agent key: give --key or set PAPERCLIP_AGENT_KEY")
        if not args.url.startswith(("http://", "https://")):
            raise Usage(f"--url must start with http:// or https:// (got {args.url!r})")
    except Usage as exc:
        fail(f"{exc} (see {PROG} run --help)")
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


class Runner:
    def __init__(self, client: Client, args: argparse.Namespace, command: list[str]) -> None:
        self.client = client
        self.args = args
        self.command = command
        self.lost = threading.Event()
        self.lost_reason = ""
        self.child: subprocess.Popen[bytes] | None = None
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_size = 0
        self.keepers: list[RuntimeLeaseKeeper | ControllerLeaseKeeper] = []
        self.run_id: str | None = None
        self.session_id: str | None = None
        self.result_posted = False
        self.base: str | None = None  # the workspace head the checkout started from

    def on_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()

    def run(self) -> int:
        try:
            me = self.client.me()
        except ApiError as exc:
            fail(f"the server refused the key: {exc}")
            return EXIT_REFUSED
        workdir = Path(self.args.workdir or os.getcwd()).resolve()
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            self._resume()
            return self._run(me.agent_id, workdir)
        except LeaseLost as exc:
            return self._lost(str(exc))
        except KeyboardInterrupt:
            self._stop_child()
            fail("interrupted")
            self._abort_run()
            return 130
        except (ApiError, OutcomeUnknown, CheckpointError, WorkdirError, TreeError, OSError) as exc:
            if self.lost.is_set():
                return self._lost(self.lost_reason)
            self._stop_child()
            fail(str(exc))
            self._abort_run()
            return EXIT_REFUSED

    def _resume(self) -> None:
        """Restore `--resume`'s checkpoint into `--session-dir` (before anything is created,
        so a wrong run id or a non-empty directory stops here)."""
        args = self.args
        if not args.resume:
            return
        session_dir = Path(args.session_dir).resolve()
        try:
            header = restore(self.client, args.resume, session_dir)
        except ApiError as exc:
            raise CheckpointError(f"--resume {args.resume}: {exc}") from exc
        session = header.get("recoveryEvidence", {}).get("normalizedSessionId")
        self.session_id = session if isinstance(session, str) else None
        say(
            f"resume: restored {len(header.get('files', {}))} file(s) of run {args.resume}"
            f" into {session_dir}"
        )

    def _abort_run(self) -> None:
        """A step failed before the result: end our run (best effort) so that it does not
        keep holding its issue."""
        if self.run_id is None or self.result_posted:
            return
        with contextlib.suppress(PaperclipError):
            self.client.run_update(self.run_id, status="failed")
            say(f"run {self.run_id} marked failed")

    def _lost(self, reason: str) -> int:
        for keeper in self.keepers:
            keeper.abandon()
        self._stop_child()
        fail(f"lost the lease: {self.lost_reason or reason}; the command was stopped")
        return EXIT_LOST

    def _run(self, agent_id: str | None, workdir: Path) -> int:
        args = self.args
        run = self._patient(
            "run",
            lambda: self.client.run_create(
                issue_id=args.issue,
                execution_workspace_id=args.workspace,
                workspace_dir=str(workdir),
            ),
            None,
        )
        self.run_id = run.id
        emit(sys.stdout, f"run: {run.id}")
        self._say_issue_holder(run.id, agent_id)

        shown: list[object] = []

        def waiting(conflict: WorkspaceRuntimeLeaseConflict) -> None:
            d = conflict.details
            holder = (d.get("owner_key"), d.get("generation"), d.get("expires_at"))
            if shown and shown[-1] == holder:
                return  # said already; a renewing holder moves expires_at and is shown again
            shown.append(holder)
            say(
                f"waiting: workspace lease held by {d.get('owner_key')} (generation"
                f" {d.get('generation')}) until {d.get('expires_at')}"
            )

        runtime = RuntimeLeaseKeeper(
            self.client,
            args.workspace,
            run_id=run.id,
            ttl_seconds=args.lease_ttl,
            on_lost=self.on_lost,
            wait=True,
            on_wait=waiting,
        )
        self.keepers.append(runtime)
        with runtime:
            claim = runtime.claim
            if claim is None:
                raise LeaseLost("not claimed")
            origin = ""
            if claim.reclaimed_from is not None:
                origin = (
                    f", reclaimed from {claim.reclaimed_from.owner_key}"
                    f" ({claim.reclaimed_from.reason})"
                )
            say(f"lease: runtime lease {claim.outcome}, generation {runtime.generation}{origin}")
            self._start_run(run.id, agent_id)
            controller = ControllerLeaseKeeper(
                self.client,
                run.id,
                boot_id=str(uuid.uuid4()),
                ttl_seconds=min(args.lease_ttl, CONTROLLER_TTL_MAX),
                on_lost=self.on_lost,
            )
            controller.renew_with(runtime)  # one request renews both leases
            self.keepers.append(controller)
            with controller:
                return self._supervise(run.id, runtime, controller, workdir)

    def _say_issue_holder(self, run_id: str, agent_id: str | None) -> None:
        """Say who holds the issue's execution lock before waiting for the workspace lease:
        the run cannot start while another live run holds the issue, and the wait for the
        lease would otherwise hide that. Advisory only: the run start decides."""
        try:
            issue = self.client.issue_get(self.args.issue)
            holder_id = issue.execution_run_id or issue.checkout_run_id
            if holder_id is None or holder_id == run_id:
                return
            holder = self.client.run_get(holder_id)
        except ApiError as exc:
            warn(f"could not read the issue's execution lock: {exc}")
            return
        if holder.is_terminal:
            return
        liveness = holder.liveness
        renewed = liveness.last_renewed_at if liveness else None
        orphaned = liveness.orphaned_at if liveness else None
        ours = holder.agent_id == agent_id and holder.execution_workspace_id == self.args.workspace
        say(
            f"issue: {issue.id} is held by run {holder.id} (agent {holder.agent_id},"
            f" {holder.status}), last renewed {_when(renewed)}; {_orphan_clause(orphaned)}"
            + (
                " (our own predecessor in this workspace: fenced out once we hold the"
                " workspace lease)"
                if ours
                else ""
            )
        )

    def _start_run(self, run_id: str, agent_id: str | None) -> None:
        """Move the run to running. A live run of this agent in this workspace that still
        holds the issue lost the workspace's lease to us: it is fenced out, so mark it
        interrupted (its later writes are refused) and take the issue."""
        for _ in range(3):
            try:
                self._patient(
                    "run start", lambda: self.client.run_update(run_id, status="running"), None
                )
                return
            except IssueExecutionLocked as exc:
                holder_id = str(exc.details.get("holder_run_id") or "")
                holder = self.client.run_get(holder_id) if holder_id else None
                # A holder whose result was accepted has done its work and waits only for its
                # finalization (maybe for the board): never ours to interrupt.
                waiting = holder.finalization if holder is not None else None
                done = waiting is not None and waiting.state not in ("none", "committed")
                if (
                    holder is None
                    or done
                    or holder.agent_id != agent_id
                    or holder.execution_workspace_id != self.args.workspace
                ):
                    d = exc.details
                    orphaned = d.get("orphaned_at")
                    say(
                        f"issue: held by run {holder_id} (agent {d.get('holder_agent_id')}),"
                        f" last renewed {d.get('last_renewed_at') or 'never'};"
                        f" {_orphan_clause(str(orphaned) if orphaned else None)}"
                    )
                    raise
                self.client.run_update(holder_id, status="interrupted")
                say(
                    f"predecessor: run {holder_id} still held the issue without the workspace"
                    " lease; marked interrupted"
                )
        self.client.run_update(run_id, status="running")

    def _supervise(
        self,
        run_id: str,
        runtime: RuntimeLeaseKeeper,
        controller: ControllerLeaseKeeper,
        workdir: Path,
    ) -> int:
        def resumed(_signum: int, _frame: object) -> None:
            # After a pause (SIGSTOP, a suspended VM) ask the server at once whether the
            # leases are still ours rather than at the next scheduled renew.
            runtime.wake()
            controller.wake()

        previous_sigcont = signal.signal(signal.SIGCONT, resumed)
        try:
            return self._work(run_id, runtime, controller, workdir)
        finally:
            signal.signal(signal.SIGCONT, previous_sigcont)

    def _work(
        self,
        run_id: str,
        runtime: RuntimeLeaseKeeper,
        controller: ControllerLeaseKeeper,
        workdir: Path,
    ) -> int:
        args = self.args
        self._checkout(workdir)
        checkpointer: SessionCheckpointer | None = None
        if args.session_dir:
            session_dir = Path(args.session_dir).resolve()
            session_dir.mkdir(parents=True, exist_ok=True)
            checkpointer = SessionCheckpointer(
                self.client, run_id, session_dir, owner=controller.owner, session_id=self.session_id
            )

        command_text = shlex.join(self.command)
        runtime.operation(phase="start", status="running", command=command_text[:20000])
        child = self._spawn(workdir)
        say(f"started: pid {child.pid} in {workdir}: {command_text}")
        forward = self._forward_signals()
        try:
            code = self._wait_child(runtime, controller, checkpointer)
        finally:
            for sig, previous in forward.items():
                signal.signal(sig, previous)
        if code is None:
            return self._lost(self.lost_reason)
        say(f"exit: {code}")
        # The command's work is done: from here on an unreachable server is waited for (as
        # long as the lease may still be ours) rather than giving up on the result.
        if checkpointer is not None:
            saver = checkpointer
            self._patient(
                "checkpoint", lambda: self._checkpoint(runtime, controller, saver), runtime
            )
        self._patient(
            "exit",
            lambda: runtime.operation(
                phase="exit",
                status="succeeded" if code == 0 else "failed",
                command=command_text[:20000],
                exit_code=code,
            ),
            runtime,
        )
        state = "succeeded" if code == 0 else "failed"
        summary = b"".join(self.tail).decode("utf-8", "replace")
        taken = self._patient("snapshot", lambda: self._snapshot(run_id, runtime, workdir), runtime)

        def post() -> None:
            runtime.ensure_held()
            self.client.result_post(
                run_id,
                result={"summary": summary, "exit_code": code, "command": command_text[:20000]},
                run_terminal_state=state,
                caller_result_id=f"{PROG}:{run_id}",
                workspace_tree=taken.tree,
            )

        self._patient("result", post, runtime)
        self.result_posted = True
        say(f"result: accepted ({state}); waiting for finalization")
        runtime.stop()
        controller.stop()
        try:
            self._patient(
                "finalization",
                lambda: self.client.wait_committed(
                    run_id,
                    timeout=600,
                    progress=lambda f: say(
                        f"finalization: {f.status}"
                        + (f" (attempt {f.finalization.attempts})" if f.finalization else "")
                    ),
                ),
                None,
            )
        except FinalizationNotAcquired as exc:
            reason = exc.details.get("reason") or "held"
            say(
                f"finalization: held for the board ({reason}); the run's tree {taken.tree} is"
                " not published until the board resolves it"
            )
            if exc.remediation:
                say(f"finalization: the board's next step: {exc.remediation}")
            return EXIT_NOT_COMMITTED
        except (ApiError, TimeoutError, ServerUnreachable) as exc:
            fail(f"run {run_id} did not commit: {exc}")
            return EXIT_NOT_COMMITTED
        say(self._published(run_id, taken.tree))
        return code

    def _published(self, run_id: str, tree: str) -> str:
        """The line naming what the commit published: the workspace head read now. When
        another run moved the head while this one worked, the server published the merge of
        both sides' changes, not this run's tree."""
        try:
            head = self.client.workspace_head(self.args.workspace)
        except (ApiError, ServerUnreachable) as exc:
            return (
                f"finalization: committed; the workspace head could not be read to name the"
                f" tree published ({exc}); the run's tree is {tree}"
            )
        if head.tree == tree:
            return f"finalization: committed; the run's tree {tree} published to the workspace head"
        if head.run_id == run_id:
            return (
                f"finalization: committed; published {head.tree} to the workspace head: the"
                f" run's tree {tree} merged with another run's changes"
            )
        # Another run (or the board) moved the head after this commit: what this run
        # published, its tree or a merge, is no longer the head and is not named here.
        return (
            f"finalization: committed; the workspace head has moved on since (now"
            f" {head.tree or 'empty'}, run {head.run_id or 'none'}); the run's tree was {tree}"
        )

    def _checkout(self, workdir: Path) -> None:
        """Make the workdir hold the workspace head read now, with the lease held (that head
        is the snapshot's base: what this run's work starts from)."""
        head = self.client.workspace_head(self.args.workspace)
        self.base = head.tree
        done = checkout(
            ClientStore(self.client),
            workdir,
            head.tree,
            server=self.client.base_url,
            workspace=self.args.workspace,
            discard_local_changes=self.args.discard_local_changes,
            say=say,
            threads=self.args.transfers,
        )
        say(f"checkout: {done.tree or 'empty'} {done.files} files, {done.fetched} bytes fetched")

    def _snapshot(self, run_id: str, runtime: RuntimeLeaseKeeper, workdir: Path) -> SnapshotResult:
        """Snapshot the workdir, upload what the server lacks, register it (fenced); the
        index is written only once the server holds the snapshot."""
        trust: tuple[str, str] | None = (self.client.base_url, self.args.workspace)
        while True:
            taken = snapshot(
                ClientStore(self.client),
                workdir,
                say=say,
                warn=warn,
                threads=self.args.transfers,
                trust_index=trust,
            )
            runtime.ensure_held()
            try:
                self.client.snapshot_register(
                    run_id,
                    tree=taken.tree,
                    base=self.base,
                    generation=runtime.generation,
                    fence=runtime.fence,
                )
                break
            except SnapshotBlobsMissing:
                if trust is None:
                    raise
                # The store no longer holds blobs the index vouched for: ask about them all.
                say("snapshot: the server lacks blobs the workdir's index named; uploading them")
                trust = None
            except ConflictError as exc:
                if exc.code.startswith("workspace_runtime_lease_"):
                    runtime.mark_lost(f"the snapshot was refused: {exc.code}")
                    raise LeaseLost(runtime.lost_reason or exc.code) from exc
                raise
        commit_snapshot(workdir, taken, server=self.client.base_url, workspace=self.args.workspace)
        say(
            f"snapshot: {taken.tree} {taken.files} files, {taken.bytes} bytes,"
            f" {taken.uploaded} bytes uploaded"
        )
        return taken

    def _patient(self, what: str, step: Callable[[], T], keeper: RuntimeLeaseKeeper | None) -> T:
        """`step()`, repeated while the server cannot be reached (the request never got
        through) or its database is away (a failover: the server answers 503 and guarantees
        the request changed nothing), after the client's own retries ran out; so repeating is
        safe: until the lease's local deadline, after which `ensure_held` declares the lease
        lost, or for 10 minutes without a lease."""
        give_up = time.monotonic() + PATIENCE_SECONDS
        while True:
            try:
                return step()
            except (ServerUnreachable, DatabaseUnavailable) as exc:
                if keeper is not None and keeper.lost:
                    raise LeaseLost(keeper.lost_reason or "lost") from exc
                if keeper is None and time.monotonic() >= give_up:
                    raise
                why = (
                    f"server unreachable ({exc.reason})"
                    if isinstance(exc, ServerUnreachable)
                    else "the server's database is unavailable"
                )
                say(f"{what}: {why}; retrying")
                time.sleep(PATIENCE_PAUSE_SECONDS)

    def _checkpoint(
        self,
        runtime: RuntimeLeaseKeeper,
        controller: ControllerLeaseKeeper,
        checkpointer: SessionCheckpointer,
    ) -> None:
        runtime.ensure_held()
        controller.ensure_held()
        try:
            stats = checkpointer.save()
        except ApiError as exc:
            if exc.code == "native_runner_checkpoint_owner_lost":
                controller.mark_lost(f"checkpoint refused: {exc.code}")
                raise LeaseLost(exc.code) from exc
            raise
        if stats.writes == 0:
            return  # nothing changed since the last checkpoint
        say(
            f"checkpoint: {stats.changed_files} changed, {stats.removed_files} removed file(s);"
            f" {stats.parts_stored} part(s) stored"
        )

    def _spawn(self, workdir: Path) -> subprocess.Popen[bytes]:
        child = self.child = subprocess.Popen(  # noqa: S603 - running the user's command is the point
            self.command,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole
        )
        threading.Thread(target=self._pump, args=(child.stdout,), daemon=True).start()
        return child

    def _pump(self, stream: IO[bytes] | None) -> None:
        if stream is None:
            return
        out = sys.stdout.buffer
        for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]
            out.write(chunk)
            out.flush()
            self.tail.append(chunk)
            self.tail_size += len(chunk)
            while self.tail_size - len(self.tail[0]) >= TAIL_BYTES and len(self.tail) > 1:
                self.tail_size -= len(self.tail.popleft())

    def _forward_signals(self) -> dict[signal.Signals, Any]:
        def forward(signum: int, _frame: object) -> None:
            if self.child is not None and self.child.poll() is None:
                say(f"signal {signal.Signals(signum).name}: passing it to the command")
                os.killpg(self.child.pid, signal.SIGTERM)

        previous: dict[signal.Signals, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, forward)
        return previous

    def _wait_child(
        self,
        runtime: RuntimeLeaseKeeper,
        controller: ControllerLeaseKeeper,
        checkpointer: SessionCheckpointer | None,
    ) -> int | None:
        """The command's exit status, or None when a lease was lost first."""
        if self.child is None:
            return None
        every = self.args.checkpoint_every
        next_checkpoint = time.monotonic() + every
        while True:
            if self.lost.is_set():
                return None
            code = self.child.poll()
            if code is not None:
                return code if code >= 0 else 128 - code
            if checkpointer is not None and time.monotonic() >= next_checkpoint:
                try:
                    self._checkpoint(runtime, controller, checkpointer)
                except LeaseLost:
                    return None
                next_checkpoint = time.monotonic() + every
            self.lost.wait(timeout=0.1)

    def _stop_child(self) -> None:
        """SIGTERM the command's process group, SIGKILL it after the grace period."""
        child = self.child
        if child is None or child.poll() is not None:
            return
        try:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        except ProcessLookupError:
            pass


def _when(moment: datetime | None) -> str:
    return "never" if moment is None else moment.isoformat()


def _orphan_clause(orphaned_at: datetime | str | None) -> str:
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


def entry() -> None:
    """Console-script entry point."""
    try:
        sys.exit(main())
    except PaperclipError as exc:  # anything unforeseen from the library: one line, no trace
        fail(str(exc))
        sys.exit(EXIT_REFUSED)
