"""The run's workdir against the workspace: the checkout of the head before the command, the
snapshot registered after it (fenced by the runtime lease), and the line naming what the
commit published."""

from __future__ import annotations

import threading
from pathlib import Path

from paperclip_client.cli_output import say, warn
from paperclip_client.client import Client
from paperclip_client.errors import (
    ApiError,
    ConflictError,
    ServerUnreachable,
    SnapshotBlobsMissing,
)
from paperclip_client.keepers import LeaseLost, RuntimeLeaseKeeper
from paperclip_client.workdir import (
    ClientStore,
    SnapshotResult,
    checkout,
    commit_snapshot,
    drop_state,
    snapshot,
)


def checkout_head(
    client: Client,
    head: str | None,
    workdir: Path,
    *,
    workspace: str,
    discard_local_changes: bool,
    transfers: int,
) -> None:
    """Make the workdir hold the workspace head `head` (read with the lease held)."""
    done = checkout(
        ClientStore(client),
        workdir,
        head,
        server=client.base_url,
        workspace=workspace,
        discard_local_changes=discard_local_changes,
        say=say,
        threads=transfers,
    )
    say(f"checkout: {done.tree or 'empty'} {done.files} files, {done.fetched} bytes fetched")


def snapshot_register(
    client: Client,
    run_id: str,
    runtime: RuntimeLeaseKeeper,
    workdir: Path,
    *,
    workspace: str,
    base: str | None,
    transfers: int,
    record_state: bool = True,
    recent: float = 0.0,
) -> SnapshotResult:
    """Snapshot the workdir, upload what the server lacks, register it (fenced) as started from
    the head `base`; the index is written only once the server holds the snapshot, here, or
    by the caller with `record_state=False` (`commit_snapshot`, or a `StateRecording`). The
    renew before the registration is skipped when one was confirmed within `recent` seconds
    (`RuntimeLeaseKeeper.ensure_held`)."""
    trust: tuple[str, str] | None = (client.base_url, workspace)
    while True:
        taken = snapshot(
            ClientStore(client),
            workdir,
            say=say,
            warn=warn,
            threads=transfers,
            trust_index=trust,
        )
        runtime.ensure_held(recent=recent)
        try:
            client.snapshot_register(
                run_id,
                tree=taken.tree,
                base=base,
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
    if record_state:
        commit_snapshot(workdir, taken, server=client.base_url, workspace=workspace)
    say(
        f"snapshot: {taken.tree} {taken.files} files, {taken.bytes} bytes,"
        f" {taken.uploaded} bytes uploaded"
    )
    return taken


class StateRecording:
    """The workdir's state (its index, directory blobs and watcher token) recorded for a
    snapshot the server holds, in a thread of its own: the runner posts its result and waits
    for the finalization meanwhile. The recording rewrites the index, a cost that follows the
    workspace (0.06 to 0.24 s at 50,000 to 200,000 files, profiled), where the requests are
    mostly a wait on the server. `wait()` before the CLI exits. The state is a cache: when the
    recording fails, the index is removed (the next run reads every file, as after a first
    checkout), and the failure is a warning, not a failed run: the work is the server's
    already."""

    def __init__(
        self, workdir: Path, taken: SnapshotResult, *, server: str, workspace: str
    ) -> None:
        self.workdir = workdir
        self.error: Exception | None = None
        self._thread = threading.Thread(
            target=self._record, args=(taken, server, workspace), name="workdir-state"
        )
        self._thread.start()

    def _record(self, taken: SnapshotResult, server: str, workspace: str) -> None:
        try:
            commit_snapshot(self.workdir, taken, server=server, workspace=workspace)
        except Exception as exc:  # taken to the waiting thread
            self.error = exc

    def wait(self) -> None:
        """Until the state is recorded. On a failure the state is dropped, and the failure
        is a warning when the filesystem refused (anything else, a bug, is raised here)."""
        self._thread.join()
        if self.error is None:
            return
        try:
            drop_state(self.workdir)
            after = "the next run reads every file of the workdir"
        except OSError as exc:
            after = (
                f"its index, of the tree before, could not be removed either ({exc}): the next"
                " run's checkout compares the workdir with that tree"
            )
        if not isinstance(self.error, OSError):
            raise self.error
        warn(
            f"could not record the workdir's state ({self.error}); the run's work is on the"
            f" server; {after}"
        )


def published(client: Client, workspace: str, run_id: str, tree: str) -> str:
    """The line naming what the commit published: the workspace head read now. When
    another run moved the head while this one worked, the server published the merge of
    both sides' changes, not this run's tree."""
    try:
        head = client.workspace_head(workspace)
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
