"""The run's workdir against the workspace: the checkout of the head before the command, the
snapshot registered after it (fenced by the runtime lease), and the line naming what the
commit published."""

from __future__ import annotations

from pathlib import Path

from paperclip_client.cli_output import say, warn
from paperclip_client.client import Client
from paperclip_client.errors import (
    ApiError,
    ConflictError,
    ServerUnreachable,
    SnapshotBlobsMissing,
)
from paperclip_client.keepers import RECENT_RENEW_SECONDS, LeaseLost, RuntimeLeaseKeeper
from paperclip_client.workdir import (
    ClientStore,
    SnapshotResult,
    checkout,
    commit_snapshot,
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
    recent: float = RECENT_RENEW_SECONDS,
) -> SnapshotResult:
    """Snapshot the workdir, upload what the server lacks, register it (fenced) as started from
    the head `base`, after a renew unless one was confirmed within `recent` seconds
    (`RuntimeLeaseKeeper.ensure_held`); the index is written only once the server holds the
    snapshot."""
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
    commit_snapshot(workdir, taken, server=client.base_url, workspace=workspace)
    say(
        f"snapshot: {taken.tree} {taken.files} files, {taken.bytes} bytes,"
        f" {taken.uploaded} bytes uploaded"
    )
    return taken


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
