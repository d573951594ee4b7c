"""`Runner`: the steps of one `paperclip-agent run` (see `paperclip_client.cli`): the run and
its leases, the command in its own process group, checkpoints, the result and the wait for
the commit; an unreachable server is waited out where repeating a step is safe."""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from paperclip_client.cli_output import (
    EXIT_LOST,
    EXIT_NOT_COMMITTED,
    EXIT_REFUSED,
    PROG,
    emit,
    fail,
    orphan_clause,
    say,
    silence,
    warn,
    when,
)
from paperclip_client.client import Client
from paperclip_client.errors import (
    ApiError,
    CheckpointError,
    DatabaseUnavailable,
    FinalizationNotAcquired,
    IssueExecutionLocked,
    OutcomeUnknown,
    PaperclipError,
    ServerUnreachable,
    TreeError,
    WorkdirError,
    WorkspaceRuntimeLeaseConflict,
)
from paperclip_client.keepers import (
    RECENT_RENEW_SECONDS,
    ControllerLeaseKeeper,
    LeaseLost,
    RuntimeLeaseKeeper,
)

if TYPE_CHECKING:  # imported where needed, not at the start (issue #42: the CLI's start)
    from paperclip_client.run_workspace import StateRecording
    from paperclip_client.session import SessionCheckpointer

T = TypeVar("T")
CONTROLLER_TTL_MAX = 3600
STOP_GRACE_SECONDS = 10.0
PATIENCE_SECONDS = 600.0
PATIENCE_PAUSE_SECONDS = 2.0
TAIL_BYTES = 4000


class Runner:
    def __init__(self, client: Client, args: argparse.Namespace, command: list[str]) -> None:
        self.client = client
        self.args = args
        self.command = command
        self.lost = threading.Event()
        self.lost_reason = ""
        # Set when a lease is lost or the command exits: what `_wait_child` waits for.
        self.wake = threading.Event()
        self.child: subprocess.Popen[bytes] | None = None
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_size = 0
        self.keepers: list[RuntimeLeaseKeeper | ControllerLeaseKeeper] = []
        self.run_id: str | None = None
        self.session_id: str | None = None
        self.result_posted = False
        self.base: str | None = None  # the workspace head the checkout started from
        # A write within this many seconds of a confirmed renew is not preceded by another.
        self.recent = RECENT_RENEW_SECONDS
        # The workdir's state being recorded for the registered snapshot, while the result
        # and the finalization go on: waited for before `run` returns.
        self.recording: StateRecording | None = None

    def on_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()
        self.wake.set()

    def run(self) -> int:
        try:
            me = self.client.me()
        except ApiError as exc:
            fail(f"the server refused the key: {exc}")
            return EXIT_REFUSED
        # The workdir's modules load while the next requests wait on the network (about 30 ms
        # of imports, taken off the time before the command starts: issue #42).
        threading.Thread(target=_load_workdir_modules, name="imports", daemon=True).start()
        workdir = Path(self.args.workdir or os.getcwd()).resolve()
        try:
            return self._guarded(me.agent_id, workdir)
        finally:
            if self.recording is not None:
                self.recording.wait()

    def _guarded(self, agent_id: str | None, workdir: Path) -> int:
        try:
            workdir.mkdir(parents=True, exist_ok=True)
            self._resume()
            return self._run(agent_id, workdir)
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
        except BaseException:
            # Anything else (the server unreachable past the patience, a bug): never leave the
            # command running without a supervisor renewing its lease.
            self._stop_child()
            raise

    def _resume(self) -> None:
        """Restore `--resume`'s checkpoint into `--session-dir` (before anything is created,
        so a wrong run id or a non-empty directory stops here)."""
        args = self.args
        if not args.resume:
            return
        from paperclip_client.session import restore  # only with --resume: issue #42

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
            import uuid  # with platform, not on the way to the first request (issue #42)

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
            f" {holder.status}), last renewed {when(renewed)}; {orphan_clause(orphaned)}"
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
                        f" {orphan_clause(str(orphaned) if orphaned else None)}"
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
        # The workdir's modules (scan, upload, checkout: pathspec, thread pools), loaded after
        # the CLI's first request (`_load_workdir_modules`), not before it (issue #42).
        from paperclip_client.run_workspace import StateRecording, published, snapshot_register

        args = self.args
        self._checkout(workdir)
        checkpointer: SessionCheckpointer | None = None
        if args.session_dir:
            from paperclip_client.session import SessionCheckpointer  # as in _resume

            session_dir = Path(args.session_dir).resolve()
            session_dir.mkdir(parents=True, exist_ok=True)
            checkpointer = SessionCheckpointer(
                self.client, run_id, session_dir, owner=controller.owner, session_id=self.session_id
            )

        command_text = shlex.join(self.command)
        runtime.operation(
            phase="start", status="running", command=command_text[:20000], recent=self.recent
        )
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
        # What the command left running in its process group would go on changing the
        # workdir while it is snapshotted, and after: stopped first.
        self._stop_group(left_running=True)
        self._record_exit(runtime, controller, checkpointer, code, command_text)
        state = "succeeded" if code == 0 else "failed"
        summary = b"".join(self.tail).decode("utf-8", "replace")
        taken = self._patient(
            "snapshot",
            lambda: snapshot_register(
                self.client,
                run_id,
                runtime,
                workdir,
                workspace=self.args.workspace,
                base=self.base,
                transfers=self.args.transfers,
                record_state=False,
                recent=self.recent,
            ),
            runtime,
        )
        self.recording = StateRecording(
            workdir, taken, server=self.client.base_url, workspace=self.args.workspace
        )

        def post() -> None:
            runtime.ensure_held(recent=self.recent)
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
        say(published(self.client, self.args.workspace, run_id, taken.tree))
        return code

    def _record_exit(
        self,
        runtime: RuntimeLeaseKeeper,
        controller: ControllerLeaseKeeper,
        checkpointer: SessionCheckpointer | None,
        code: int,
        command_text: str,
    ) -> None:
        """The last checkpoint and the `exit` operation. The command's work is done: from
        here on an unreachable server is waited for (as long as the lease may still be ours)
        rather than giving up on the result, and a write whose answer was lost is no reason
        to drop the run's work (neither is sent again: each may have been recorded)."""
        if checkpointer is not None:
            saver = checkpointer
            try:
                self._patient(
                    "checkpoint", lambda: self._checkpoint(runtime, controller, saver), runtime
                )
            except OutcomeUnknown as exc:
                warn(f"the last checkpoint's outcome is unknown ({exc}); going on")
        try:
            self._patient(
                "exit",
                lambda: runtime.operation(
                    phase="exit",
                    status="succeeded" if code == 0 else "failed",
                    command=command_text[:20000],
                    exit_code=code,
                    recent=self.recent,
                ),
                runtime,
            )
        except OutcomeUnknown as exc:  # a record: the result carries the exit status too
            warn(f"the exit operation's outcome is unknown ({exc}); going on")

    def _checkout(self, workdir: Path) -> None:
        """Make the workdir hold the workspace head read now, with the lease held (that head
        is the snapshot's base: what this run's work starts from)."""
        from paperclip_client.run_workspace import checkout_head  # as in _work: issue #42

        head = self.client.workspace_head(self.args.workspace)
        self.base = head.tree
        checkout_head(
            self.client,
            head.tree,
            workdir,
            workspace=self.args.workspace,
            discard_local_changes=self.args.discard_local_changes,
            transfers=self.args.transfers,
        )

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
        """Copy the command's output to ours, keeping its tail for the result. Our stdout
        closed by its reader (`| head`, a lost ssh session) stops the copying, never the
        draining: the command would otherwise block on a full pipe for good while the lease
        is renewed."""
        if stream is None:
            return
        out = sys.stdout.buffer
        copying = True
        for chunk in iter(lambda: stream.read1(65536), b""):  # type: ignore[attr-defined]
            if copying:
                try:
                    out.write(chunk)
                    out.flush()
                except OSError:  # BrokenPipeError among them
                    copying = False
                    silence(sys.stdout)
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
        child = self.child
        if child is None:
            return None
        # A thread blocked in the command's wait wakes this one the moment it exits, rather
        # than at the next tick of a poll (up to 0.1 s added to every run: issue #42).
        threading.Thread(target=self._reap, args=(child,), name="reaper", daemon=True).start()
        every = self.args.checkpoint_every
        next_checkpoint = time.monotonic() + every
        while True:
            if self.lost.is_set():
                return None
            code = child.poll()
            if code is not None:
                return code if code >= 0 else 128 - code
            if checkpointer is not None and time.monotonic() >= next_checkpoint:
                try:
                    self._checkpoint(runtime, controller, checkpointer)
                except LeaseLost:
                    return None
                except (OutcomeUnknown, ServerUnreachable, DatabaseUnavailable) as exc:
                    # A checkpoint is not worth the command: the leases' keepers judge the
                    # outage (until the lease's deadline); the next checkpoint tries again.
                    warn(f"checkpoint: {exc}; the command goes on, the next one in {every:g} s")
                next_checkpoint = time.monotonic() + every
            left = next_checkpoint - time.monotonic() if checkpointer is not None else 1.0
            self.wake.wait(timeout=min(max(left, 0.0), 1.0))

    def _reap(self, child: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ChildProcessError):
            child.wait()
        self.wake.set()

    def _stop_child(self) -> None:
        """SIGTERM the command's process group, SIGKILL what is left of it after the grace
        period: every member, not only the command (which may be gone while a member that
        ignores SIGTERM goes on)."""
        self._stop_group(left_running=False)

    def _stop_group(self, *, left_running: bool) -> None:
        child = self.child
        if child is None or not _group_alive(child.pid):
            if child is not None:
                with contextlib.suppress(ChildProcessError):
                    child.wait()
            return
        if left_running:
            say("the command left processes running in its process group: stopping them")
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=STOP_GRACE_SECONDS)
        while _group_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            child.wait()


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is left (its id stays the group's while one is)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load_workdir_modules() -> None:
    """Import what `_work` will (in a thread, while the main one waits for answers). An
    error is left for `_work`'s own import to raise where it is reported."""
    with contextlib.suppress(Exception):
        importlib.import_module("paperclip_client.run_workspace")
