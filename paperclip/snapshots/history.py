"""A workspace's history: every move of its head, recorded in the transaction that moves it
(docs/snapshots.md#history), and reading it back, page by page and as diffs.

Writers call `head_move_record_in_tx` right after the statement that moved the head (the
publisher, the board's resolution, the adoption of a cwd, a restore); the row lock that
statement took on the workspace orders the moves, so `seq` counts them without a gap.
Readers: `workspace_history` (newest first, by `seq`), `workspace_diff` (two trees of the
company, path by path), and `move_of` for one move.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal
from uuid import UUID

from django.db.models import Max

from paperclip import selectors
from paperclip.access import Actor
from paperclip.db.locking import require_transaction
from paperclip.db.prepared import prepared_cursor
from paperclip.errors import ConflictError, InvalidRequest, NotFoundError
from paperclip.ids import parse_uuid
from paperclip.models import HeartbeatRun
from paperclip.snapshots.diff import ChangeCounts, TreeDiff, TreeUnreadable, tree_diff
from paperclip.snapshots.models import WorkspaceHeadMove
from paperclip.snapshots.store.reads import cas_rows
from paperclip.snapshots.trees import BLOB_NAME

type MoveKind = Literal["publish", "merge", "resolution", "adoption", "restore"]
type ActorType = Literal["agent", "board", "system"]

HISTORY_LIMIT_DEFAULT: Final = 50
HISTORY_LIMIT_MAX: Final = 500
DIFF_LIMIT_DEFAULT: Final = 1000
DIFF_LIMIT_MAX: Final = 10_000
EMPTY_TREE: Final = "empty"  # the diff's name for the empty tree (`from=empty`)
SYSTEM_ACTOR: Final = "workspace_publisher"


class WorkspaceHeadMoved(ConflictError):
    code = "workspace_head_moved"
    message = "The workspace head moved since it was read (details.head is the head of now)."
    remediation = "Read the history again, then decide against the head of now."


class TreeNotFound(NotFoundError):
    message = "The company's store does not hold this tree (never stored, or collected)."


# The columns a move is read from, in `Move.of_values`'s order.
MOVE_COLUMNS: Final = (
    "seq",
    "tree",
    "previous_tree",
    "kind",
    "run_id",
    "action_id",
    "actor_type",
    "actor_id",
    "at",
    "note",
    "added",
    "removed",
    "modified",
)


@dataclass(frozen=True, slots=True)
class Move:
    """One recorded move of a head, as the history shows it."""

    seq: int
    tree: str
    previous_tree: str | None
    kind: MoveKind
    run_id: UUID | None
    action_id: UUID | None
    actor_type: ActorType
    actor_id: str
    at: datetime
    note: str | None
    counts: ChangeCounts

    @classmethod
    def of(cls, row: WorkspaceHeadMove) -> Move:
        return cls.of_values(tuple(getattr(row, name) for name in MOVE_COLUMNS))

    @classmethod
    def of_values(cls, row: tuple[Any, ...]) -> Move:
        """A move of a row read as `values_list(*MOVE_COLUMNS)` (no model instance built)."""
        seq, tree, previous, kind, run, action, actor_type, actor_id, at, note, *counts = row
        return cls(
            seq=seq,
            tree=tree,
            previous_tree=previous,
            kind=kind,
            run_id=run,
            action_id=action,
            actor_type=actor_type,
            actor_id=actor_id,
            at=at,
            note=note,
            counts=ChangeCounts(*counts),
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "tree": self.tree,
            "previous_tree": self.previous_tree,
            "kind": self.kind,
            "run_id": str(self.run_id) if self.run_id is not None else None,
            "action_id": str(self.action_id) if self.action_id is not None else None,
            "actor": {"type": self.actor_type, "id": self.actor_id},
            "at": self.at.isoformat().replace("+00:00", "Z"),
            "note": self.note,
            "counts": self.counts.as_json(),
        }


def move_counts(*, company_id: UUID, previous_tree: str | None, tree: str) -> ChangeCounts:
    """The paths a move adds, removes and modifies (directories included, as the diff lists
    them). A previous tree the store no longer holds counts as empty (everything added); a
    tree that cannot be read counts nothing: a record is never refused for its counts."""
    try:
        return tree_diff(company_id=company_id, before=previous_tree, after=tree).counts
    except TreeUnreadable:
        pass
    try:
        return tree_diff(company_id=company_id, before=None, after=tree).counts
    except TreeUnreadable:
        return ChangeCounts()


def head_move_record_in_tx(
    *,
    company_id: UUID,
    workspace_id: UUID,
    tree: str,
    previous_tree: str | None,
    kind: MoveKind,
    actor_type: ActorType,
    actor_id: str,
    run_id: UUID | None = None,
    action_id: UUID | None = None,
    note: str | None = None,
    counts: ChangeCounts | None = None,
) -> Move:
    """Record that the head of `workspace_id` moved from `previous_tree` to `tree`, as the next
    `seq` of its history. Must run in the transaction that moved the head, after the statement
    that moved it (its row lock on the workspace orders concurrent moves). `counts` are computed
    here when not given (reading the directories that differ)."""
    require_transaction()
    if counts is None:
        counts = move_counts(company_id=company_id, previous_tree=previous_tree, tree=tree)
    last = WorkspaceHeadMove.objects.filter(workspace_id=workspace_id).aggregate(seq=Max("seq"))
    row = WorkspaceHeadMove.objects.create(
        company_id=company_id,
        workspace_id=workspace_id,
        seq=(last["seq"] or 0) + 1,
        tree=tree,
        previous_tree=previous_tree,
        kind=kind,
        run_id=run_id,
        action_id=action_id,
        actor_type=actor_type,
        actor_id=actor_id,
        added=counts.added,
        removed=counts.removed,
        modified=counts.modified,
        note=note,
    )
    row.refresh_from_db(fields=["at"])
    return Move.of(row)


@dataclass(frozen=True, slots=True)
class HistoryPage:
    moves: list[Move]  # newest first
    next: int | None  # pass as `before` for the following page; None: no more


def workspace_history(
    *,
    actor: Actor,
    workspace_id: UUID,
    limit: int = HISTORY_LIMIT_DEFAULT,
    before: int | None = None,
) -> HistoryPage:
    """The moves of the workspace's head, newest first, at most `limit` (1..500), those with a
    `seq` below `before` when given. NotFound for a workspace the actor may not see. Reads
    only: one prepared statement (an index scan of the workspace's newest moves, the
    workspace's company checked in the same statement) whatever the history's length; a second
    query only when it finds no move, to tell an empty page from a workspace the actor may not
    see."""
    if not 1 <= limit <= HISTORY_LIMIT_MAX:
        raise InvalidRequest(fields={"limit": [f"Must be 1..{HISTORY_LIMIT_MAX}."]})
    found = [Move.of_values(row) for row in _history_rows(actor, workspace_id, limit + 1, before)]
    if not found:  # NotFound unless the actor may see the workspace
        selectors.execution_workspace_get(actor=actor, workspace_id=workspace_id)
    more = len(found) > limit
    moves = found[:limit]
    return HistoryPage(moves=moves, next=moves[-1].seq if more else None)


# The page's statement, prepared once per connection for each of its four shapes (an actor
# scoped to companies or not, a `before` or not): the ORM would build and the server plan it
# afresh for every page, about half of the page's time in process.
_HISTORY_SELECT: Final = (  # MOVE_COLUMNS, in order
    "SELECT m.seq, m.tree, m.previous_tree, m.kind, m.run_id, m.action_id, m.actor_type,"
    " m.actor_id, m.at, m.note, m.added, m.removed, m.modified FROM workspace_head_moves m"
)
_HISTORY_SCOPED: Final = (
    " JOIN execution_workspaces w ON w.id = m.workspace_id AND w.company_id = ANY(%s::uuid[])"
    " AND m.company_id = w.company_id"  # a move stays its company's, wherever the row went
)


def _history_rows(
    actor: Actor, workspace_id: UUID, count: int, before: int | None
) -> list[tuple[Any, ...]]:
    """Up to `count` moves of the workspace, newest first, below `before` when given, as rows
    of MOVE_COLUMNS; none when the actor's companies do not hold the workspace."""
    sql, params = _HISTORY_SELECT, list[Any]()
    if actor.company_ids is not None:
        sql += _HISTORY_SCOPED
        params.append(list(actor.company_ids))
    sql += " WHERE m.workspace_id = %s"
    params.append(parse_uuid(workspace_id))
    if before is not None:
        sql += " AND m.seq < %s"
        params.append(before)
    sql += " ORDER BY m.seq DESC LIMIT %s"
    params.append(count)
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        rows: list[tuple[Any, ...]] = cursor.fetchall()
    return rows


def workspace_move(*, actor: Actor, workspace_id: UUID, seq: int) -> Move:
    """One move of the workspace's history; NotFound when there is no such move."""
    workspace = selectors.execution_workspace_get(actor=actor, workspace_id=workspace_id)
    row = WorkspaceHeadMove.objects.filter(workspace_id=workspace.pk, seq=seq).first()
    if row is None:
        raise NotFoundError("No such move in the workspace's history.")
    return Move.of(row)


def tree_name(value: str, field: str) -> str:
    """A tree's name as a request gives it: InvalidRequest unless `sha256:<64 hex>`."""
    if not BLOB_NAME.fullmatch(value):
        raise InvalidRequest(fields={field: ["Must be a tree name: sha256:<64 hex digits>."]})
    return value


def workspace_diff(
    *,
    actor: Actor,
    workspace_id: UUID,
    from_tree: str | None,
    to_tree: str,
    limit: int = DIFF_LIMIT_DEFAULT,
) -> TreeDiff:
    """The changes from `from_tree` (None: the empty tree) to `to_tree`, two trees of the
    workspace's company, sorted by path, at most `limit` (1..10,000; `truncated` says there
    were more; the counts count them all). NotFound for a workspace the actor may not see, or
    a tree the company's store lacks (TreeNotFound, details `tree`). Reads only."""
    workspace = selectors.execution_workspace_get(actor=actor, workspace_id=workspace_id)
    if not 1 <= limit <= DIFF_LIMIT_MAX:
        raise InvalidRequest(fields={"limit": [f"Must be 1..{DIFF_LIMIT_MAX}."]})
    trees_stored(workspace.company_id, from_tree, to_tree)
    try:
        return tree_diff(
            company_id=workspace.company_id, before=from_tree, after=to_tree, limit=limit
        )
    except TreeUnreadable as exc:
        raise TreeNotFound(tree=exc.tree, path=exc.path) from exc


def trees_stored(company_id: UUID, *trees: str | None) -> None:
    """TreeNotFound for the first of `trees` (None: the empty tree) whose root blob the
    company's store no longer holds (never stored, or collected): asked of the rows, not of
    the process's cache of directory blobs, which may still hold a collected tree's
    directories; and asked even of a tree compared with itself, which needs no walk."""
    names = [tree for tree in trees if tree is not None]
    found = cas_rows(company_id=company_id, digests=names)
    for tree in names:
        if tree not in found:
            raise TreeNotFound(tree=tree, path="")


def recorded_trees(*, workspace_id: UUID) -> set[str]:
    """Every tree the workspace's history names (each move's tree and previous tree)."""
    pairs = WorkspaceHeadMove.objects.filter(workspace_id=workspace_id).values_list(
        "tree", "previous_tree"
    )
    return {tree for pair in pairs for tree in pair if tree}


def is_recorded_tree(*, workspace_id: UUID, tree: str) -> bool:
    """Whether the workspace's history names `tree` (as a move's tree or previous tree)."""
    rows = WorkspaceHeadMove.objects.filter(workspace_id=workspace_id)
    return rows.filter(tree=tree).exists() or rows.filter(previous_tree=tree).exists()


# The publisher's kinds of plan that move the head, as the history names them.
PUBLISHED_KINDS: Final[dict[str, MoveKind]] = {
    "fast_forward": "publish",
    "merged": "merge",
    "resolved": "resolution",
}


def head_published_record_in_tx(
    *,
    company_id: UUID,
    workspace_id: UUID,
    run_id: UUID,
    plan_kind: str,
    tree: str,
    previous_tree: str | None,
    action_id: UUID | None = None,
    decided_by: str | None = None,
) -> Move:
    """Record a move by the publisher (`plan_kind`: fast_forward, merged or resolved): by the
    run's agent, or for the board's resolution by the board member who decided it."""
    kind = PUBLISHED_KINDS[plan_kind]
    actor: tuple[ActorType, str]
    if kind == "resolution" and decided_by:
        actor = ("board", decided_by)
    else:
        agent = HeartbeatRun.objects.filter(pk=run_id).values_list("agent_id", flat=True).first()
        actor = ("agent", str(agent)) if agent is not None else ("system", SYSTEM_ACTOR)
    return head_move_record_in_tx(
        company_id=company_id,
        workspace_id=workspace_id,
        tree=tree,
        previous_tree=previous_tree,
        kind=kind,
        actor_type=actor[0],
        actor_id=actor[1],
        run_id=run_id,
        action_id=action_id,
    )
