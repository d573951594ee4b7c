"""The board puts a workspace's head back to a tree of its history
(docs/snapshots.md#restore): compare-and-set on the head the board saw, audited, recorded as a
move of kind `restore`, and materialized into the cwd like any head move. A run working
meanwhile merges its changes with the restored head when it publishes (its base is no longer
the head), as with any other run's move."""

from __future__ import annotations

from typing import Final
from uuid import UUID

from django.db import connection, transaction

from paperclip import selectors
from paperclip.access import Actor
from paperclip.activity import activity_record
from paperclip.errors import InvalidRequest, PermissionDenied
from paperclip.models import ExecutionWorkspace
from paperclip.snapshots.behind import materialize_defer_in_tx
from paperclip.snapshots.diff import ChangeCounts
from paperclip.snapshots.history import (
    MOVE_COLUMNS,
    Move,
    WorkspaceHeadMoved,
    head_move_record_in_tx,
    is_recorded_tree,
    move_counts,
    tree_name,
)
from paperclip.snapshots.models import WorkspaceHeadMove
from paperclip.snapshots.store.pins import cas_pin
from paperclip.snapshots.store.reads import directory_loader
from paperclip.snapshots.trees import TreeInvalid, walk

MIN_NOTE_CHARS: Final = 20
MAX_NOTE_CHARS: Final = 4000  # kept twice: in the move and in the audit row
AUDIT_ACTION: Final = "workspace.head_restored"


def _head_of(workspace_id: UUID) -> str | None:
    head: str | None = (
        ExecutionWorkspace.objects.filter(pk=workspace_id)
        .values_list("head_tree", flat=True)
        .first()
    )
    return head


def _reached(company_id: UUID, tree: str) -> set[str]:
    """Every blob the tree reaches; InvalidRequest when a directory of it is gone or bad."""
    try:
        walked = walk(tree, load_many=directory_loader(company_id), keep_files=False)
    except TreeInvalid as exc:
        raise InvalidRequest(fields={"tree": [f"The tree cannot be read: {exc}"]}) from exc
    if walked.missing:
        raise InvalidRequest(
            fields={"tree": ["The tree's blobs were collected: it cannot be restored."]}
        )
    return walked.reached()


def _same_restore(
    actor: Actor, workspace_id: UUID, tree: str, expected_head: str | None, note: str
) -> Move | None:
    """The workspace's latest move when it is this very restore (by the same board member, to
    `tree`, from `expected_head`, with `note`) and the head is still `tree`: what a repeat of
    a restore whose answer was lost gets, instead of a 409 naming the tree it asked for.
    Another member's identical restore is theirs, not this one's: 409 as any other move."""
    if _head_of(workspace_id) != tree:
        return None
    row = (
        WorkspaceHeadMove.objects.filter(workspace_id=workspace_id)
        .order_by("-seq")
        .values_list(*MOVE_COLUMNS)
        .first()
    )
    if row is None:
        return None
    move = Move.of_values(row)
    same = (move.kind, move.tree, move.previous_tree, move.note, move.actor_type) == (
        "restore",
        tree,
        expected_head,
        note,
        "board",
    )
    same = same and move.actor_id == actor.actor_id
    return move if same else None


def workspace_restore(
    *,
    actor: Actor,
    workspace_id: UUID,
    tree: str,
    expected_head: str | None,
    note: str,
) -> Move:
    """Move the workspace's head to `tree`, one of the trees its history names, if the head is
    still `expected_head` (None: empty). The board's only (PermissionDenied for an agent);
    NotFound for a workspace the actor may not see; InvalidRequest for a tree the history
    does not name, one already the head, one whose blobs were collected, or a note under 20
    characters (or over 4,000, or holding NUL); WorkspaceHeadMoved (details `head`) when the
    head is no longer the one expected. The same restore again, after it took effect and
    before anything else moved the head, answers its move and writes nothing. In one
    transaction: every blob the tree reaches is pinned (so a collection running meanwhile
    keeps them), the head moves by compare-and-set (row lock on the workspace), the move is
    recorded, one audit row, and the materialization of the cwd is deferred. Returns the new
    move."""
    if not actor.is_board:
        raise PermissionDenied()
    workspace = selectors.execution_workspace_get(actor=actor, workspace_id=workspace_id)
    tree = tree_name(tree, "tree")
    if expected_head is not None:
        expected_head = tree_name(expected_head, "expected_head")
    if len(note.strip()) < MIN_NOTE_CHARS:
        raise InvalidRequest(fields={"note": [f"At least {MIN_NOTE_CHARS} characters."]})
    if len(note) > MAX_NOTE_CHARS or "\0" in note:
        raise InvalidRequest(fields={"note": [f"At most {MAX_NOTE_CHARS} characters, no NUL."]})
    if not is_recorded_tree(workspace_id=workspace.pk, tree=tree):
        raise InvalidRequest(fields={"tree": ["Not a tree of this workspace's history."]})
    repeated = _same_restore(actor, workspace.pk, tree, expected_head, note)
    if repeated is not None:
        return repeated  # the same request again (its answer was lost): nothing written
    reached = _reached(workspace.company_id, tree)
    counts = move_counts(company_id=workspace.company_id, previous_tree=expected_head, tree=tree)
    try:
        return _restore_in_tx(
            actor,
            workspace_id=workspace.pk,
            company_id=workspace.company_id,
            tree=tree,
            expected_head=expected_head,
            note=note,
            reached=reached,
            counts=counts,
        )
    except _Overtaken as twin:
        return twin.move  # this very restore, committed meanwhile by its twin request


class _Overtaken(Exception):
    """The head moved while this restore waited for the workspace row, by this very restore
    sent twice (a double submit, a retry while the first was in flight): its transaction is
    rolled back (its pins), and the twin's move is the answer."""

    def __init__(self, move: Move) -> None:
        super().__init__(move.seq)
        self.move = move


def _restore_in_tx(
    actor: Actor,
    *,
    workspace_id: UUID,
    company_id: UUID,
    tree: str,
    expected_head: str | None,
    note: str,
    reached: set[str],
    counts: ChangeCounts,
) -> Move:
    with transaction.atomic(durable=True):
        if cas_pin(company_id=company_id, digests=reached).missing:
            raise InvalidRequest(
                fields={"tree": ["The tree's blobs were collected: it cannot be restored."]}
            )
        with connection.cursor() as cursor:
            cursor.execute(
                "UPDATE execution_workspaces SET head_tree = %s, head_run_id = NULL,"
                " head_committed_at = now(), updated_at = now()"
                " WHERE id = %s AND head_tree IS NOT DISTINCT FROM %s"
                " AND head_tree IS DISTINCT FROM %s"
                " RETURNING cwd",
                [tree, workspace_id, expected_head, tree],
            )
            row = cursor.fetchone()
        if row is None:
            head = _head_of(workspace_id)
            if head != expected_head:
                # Read after the row lock was let go: a twin that moved it has committed.
                twin = _same_restore(actor, workspace_id, tree, expected_head, note)
                if twin is not None:
                    raise _Overtaken(twin)
                raise WorkspaceHeadMoved(head=head)
            raise InvalidRequest(fields={"tree": ["The tree is already the head."]})
        move = head_move_record_in_tx(
            company_id=company_id,
            workspace_id=workspace_id,
            tree=tree,
            previous_tree=expected_head,
            kind="restore",
            actor_type="board",
            actor_id=actor.actor_id,
            note=note,
            counts=counts,
        )
        activity_record(
            company_id=company_id,
            actor_type=actor.actor_type,
            actor_id=actor.actor_id,
            action=AUDIT_ACTION,
            entity_type="execution_workspace",
            entity_id=workspace_id,
            details={
                "tree": tree,
                "previousHead": expected_head,
                "seq": move.seq,
                "note": note,
                **move.counts.as_json(),
            },
        )
        if row[0]:
            materialize_defer_in_tx(workspace_id=workspace_id)
    return move
