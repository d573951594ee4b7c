"""A model-based test of workspace snapshots: a hypothesis state machine drives the public
services an agent and the board reach through the API (the runtime lease, snapshot
registration, result acceptance, finalization, the board's conflict resolution and the
materialization of the head), and checks them against a model of what the head must hold
(docs/testing.md#the-workspace-snapshot-model).

The model is a dict path -> entry per tree (directories explicit, as a workdir has them).
Runs check out the head of their moment, edit a few of four paths in two directories (a
file's content or mode, a symlink, a file becoming a directory, a directory becoming a file,
removals) and publish. After every step:

- the head holds, at each path, what the last committed change to that path made it: a run's
  publish (a fast-forward or a merge of the two sides' changes since its base), or a board
  decision; nothing committed disappears without a later recorded move of the head (one
  audit row per move);
- a held run has exactly one live hold, its own, until the board decides;
- once materialization settles, the cwd holds exactly the head, and a materialization that
  fails part way (a rename failing once) leaves every unchanged entry in place and no file
  partly written.

Conflicts are the paths changed on both sides to different entries, and the paths whose
parent one side removed or turned into a file while the other side changed something inside
it (with their parent). The board's `publish` takes the run's side of each conflicting path,
`keep_head` the head's side, both keeping every other change of both sides (merged against
the head as it is when the board decides); `discard` publishes nothing. A path left without a
directory above it by a resolution joins the conflict with its parent until the tree holds.

`keep_head` is drawn only when the resolution service accepts it (RESOLUTIONS below, read
from the service's own type). PAPERCLIP_MODEL_EXAMPLES sets the number of examples (default
20) and PAPERCLIP_MODEL_STEPS the steps per example (default 20).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal
from unittest import mock
from uuid import UUID

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from leases.services import RuntimeLeaseOwner, runtime_lease_claim, runtime_lease_release
from leases.services.snapshots import run_snapshot_register
from paperclip.access import Actor
from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    ExecutionWorkspace,
    HeartbeatRun,
    NativeRunFinalization,
)
from paperclip.snapshots.dirfd import is_temp_name
from paperclip.snapshots.disk_tree import read_tree
from paperclip.snapshots.head import tree_entries, workspace_materialize
from paperclip.snapshots.store.reads import cas_load
from paperclip.snapshots.trees import Entry, build
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.services import Acquired, run_finalize
from recovery.services import conflicts as conflict_service
from recovery.services.finalization.acceptance import result_accept
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
    NativeRunFactory,
    UserFactory,
)
from tests.recovery.snapshots import put_blob

pytestmark = pytest.mark.django_db(transaction=True)

EXAMPLES = int(os.environ.get("PAPERCLIP_MODEL_EXAMPLES", "20"))
STEPS = int(os.environ.get("PAPERCLIP_MODEL_STEPS", "20"))
MAX_OPEN_RUNS: Final = 3  # runs with a result not yet committed (waiting or held)

CONFLICT_CAUSE: Final = "workspace_head_conflict"


def _supported_resolutions() -> tuple[str, ...]:
    """The resolutions the board's service accepts: its `RESOLUTIONS` if it names them, else
    the values of its `Resolution` type, else the choices of the API's body."""
    named = getattr(conflict_service, "RESOLUTIONS", None)
    if named:
        return tuple(named)
    alias: Any = getattr(conflict_service, "Resolution", None)
    if alias is not None and (values := typing.get_args(getattr(alias, "__value__", alias))):
        return tuple(values)
    from recovery.api.views import WorkspaceConflictResolveApi

    field = WorkspaceConflictResolveApi.InputSerializer().fields["resolution"]
    return tuple(field.choices)


RESOLUTIONS: Final = _supported_resolutions()

# --- the model ------------------------------------------------------------------------------

# ("d", mode) a directory, ("f", content, mode) a file, ("l", target) a symlink.
type Value = tuple[Any, ...]
type Tree = dict[str, Value]

DIR: Final[Value] = ("d", 0o755)
LEAVES: Final = ("a/x", "a/y", "b/x", "b/y")
CONTENTS: Final = (b"one\n", b"two\n", b"three\n")


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _below(path: str, ancestor: str) -> bool:
    return path.startswith(ancestor + "/")


def _remove(tree: Tree, path: str) -> None:
    for other in [p for p in tree if p == path or _below(p, path)]:
        del tree[other]


def _ensure_dirs(tree: Tree, directory: str) -> None:
    parts = directory.split("/") if directory else []
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        if tree.get(prefix, ("",))[0] != "d":
            _remove(tree, prefix)
            tree[prefix] = DIR


type Edit = tuple[str, ...]


def apply_edit(tree: Tree, edit: Edit) -> None:
    """One edit of a run's workdir, as a shell would make it."""
    kind, path = edit[0], edit[1]
    if kind == "rm":
        _remove(tree, path)
        return
    if kind == "chmod":
        value = tree.get(path)
        if value is not None and value[0] == "f":
            tree[path] = ("f", value[1], 0o755 if value[2] == 0o644 else 0o644)
        return
    _ensure_dirs(tree, _parent(path))
    _remove(tree, path)
    if kind == "write":
        tree[path] = ("f", CONTENTS[int(edit[2])], 0o644)
    elif kind == "link":
        tree[path] = ("l", "x")  # a sibling, never itself a link: no loop, nothing escapes
    elif kind == "mkdir":  # a file becomes a directory
        tree[path] = DIR
        tree[f"{path}/z"] = ("f", b"deep\n", 0o644)
    elif kind == "file":  # a directory becomes a file
        tree[path] = ("f", b"was a directory\n", 0o644)
    else:  # pragma: no cover - the strategy draws only the kinds above
        raise AssertionError(edit)


EDITS = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(LEAVES), st.sampled_from(("0", "1", "2"))),
    st.tuples(st.just("write"), st.sampled_from(LEAVES), st.sampled_from(("0", "1", "2"))),
    st.tuples(st.just("rm"), st.sampled_from(LEAVES)),
    st.tuples(st.just("rm"), st.sampled_from(("a", "b"))),
    st.tuples(st.just("chmod"), st.sampled_from(LEAVES)),
    st.tuples(st.just("link"), st.sampled_from(("a/y", "b/y"))),
    st.tuples(st.just("mkdir"), st.just("a/x")),
    st.tuples(st.just("file"), st.just("b")),
)


def changes(base: Tree, side: Tree) -> dict[str, Value | None]:
    """Paths added, removed, or changed in type, mode or content (a directory by type and
    mode: what is inside it is compared path by path)."""
    return {p: side.get(p) for p in base.keys() | side.keys() if base.get(p) != side.get(p)}


def _orphans(tree: Tree) -> list[str]:
    return sorted(p for p in tree if _parent(p) and tree.get(_parent(p), ("",))[0] != "d")


@dataclass(frozen=True)
class Merge:
    clean: Tree  # each path changed on one side (or alike on both) takes that side's entry
    conflicts: frozenset[str]


def merge(base: Tree, run: Tree, head: Tree) -> Merge:
    """The run's and the head's changes since `base`, path by path."""
    ours, theirs = changes(base, run), changes(base, head)
    merged: Tree = {}
    conflicts: set[str] = set()
    for path in base.keys() | run.keys() | head.keys():
        if path in ours and path in theirs and ours[path] != theirs[path]:
            conflicts.add(path)
            continue
        value = ours[path] if path in ours else head.get(path)
        if value is not None:
            merged[path] = value
    for path in _orphans(merged):
        conflicts.update({path, _parent(path)})
    return Merge(merged, frozenset(conflicts))


def resolve(base: Tree, run: Tree, head: Tree, resolution: str) -> Tree:
    """The head the board's resolution makes, merged against `head` (the head of now)."""
    if resolution == "discard":
        return dict(head)
    side = run if resolution == "publish" else head
    merged = merge(base, run, head)
    conflicting = set(merged.conflicts)
    while True:
        tree = {p: v for p, v in merged.clean.items() if p not in conflicting}
        tree.update({p: side[p] for p in conflicting if p in side})
        orphans = _orphans(tree)
        if not orphans:
            return tree
        for path in orphans:  # left without a directory above it: the conflict grows
            conflicting.add(path if _parent(path) in conflicting else _parent(path))


# --- between the model and the services -----------------------------------------------------


def store_model_tree(company_id: UUID, tree: Tree) -> str:
    entries: dict[str, Entry] = {}
    for path, value in tree.items():
        name = path.rpartition("/")[2]
        if value[0] == "d":
            entries[path] = Entry(name=name, type="dir", mode=int(value[1]))
        elif value[0] == "l":
            entries[path] = Entry(name=name, type="symlink", target=str(value[1]))
        else:
            data = value[1]
            assert isinstance(data, bytes)
            digest = put_blob(company_id, data)
            entries[path] = Entry(
                name=name, type="file", mode=int(value[2]), size=len(data), digest=digest
            )
    root, blobs = build(entries)
    for data in blobs.values():
        put_blob(company_id, data)
    return root


def _as_value(company_id: UUID, entry: Entry) -> Value:
    if entry.type == "dir":
        return ("d", entry.mode)
    if entry.type == "symlink":
        return ("l", entry.target or "")
    assert entry.digest is not None
    data = cas_load(company_id=company_id, digest=entry.digest, max_bytes=1 << 20)
    assert data is not None, entry
    return ("f", data, entry.mode)


def stored_tree(company_id: UUID, tree: str | None) -> Tree:
    return {p: _as_value(company_id, e) for p, e in tree_entries(company_id, tree).items()}


def disk_tree(root: str) -> Tree:
    """What a directory holds, as the model has it (temporary siblings left out)."""
    if not os.path.isdir(root):
        return {}
    found: Tree = {}
    for path, entry in read_tree(root).items():
        if any(is_temp_name(part) for part in path.split("/")):
            continue
        if entry.type == "file":
            with open(os.path.join(root, path), "rb") as handle:
                found[path] = ("f", handle.read(), entry.mode)
        elif entry.type == "symlink":
            found[path] = ("l", entry.target or "")
        else:
            found[path] = ("d", entry.mode)
    return found


class InjectedFault(OSError):
    """The rename the test made fail."""


@contextlib.contextmanager
def rename_fails(nth: int) -> Iterator[Callable[[], bool]]:
    """os.rename and os.replace fail once, at the nth call (as a full disk would)."""
    calls = {"n": 0, "fired": False}
    real_rename, real_replace = os.rename, os.replace

    def wrap(real: Callable[..., None]) -> Callable[..., None]:
        def failing(*args: Any, **kwargs: Any) -> None:
            calls["n"] += 1
            if calls["n"] == nth and not calls["fired"]:
                calls["fired"] = True
                raise InjectedFault(errno.ENOSPC, "No space left on device (injected)")
            real(*args, **kwargs)

        return failing

    with (
        mock.patch("os.rename", wrap(real_rename)),
        mock.patch("os.replace", wrap(real_replace)),
    ):
        yield lambda: bool(calls["fired"])


def _caused_by_fault(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, InjectedFault):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# --- the state machine ----------------------------------------------------------------------


@dataclass
class ModelRun:
    run: HeartbeatRun
    issue_id: UUID
    base: Tree
    tree_model: Tree
    tree: str
    state: Literal["accepted", "held", "done"] = "accepted"
    label: str = ""
    edits: list[Edit] = field(default_factory=list)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # a draw, as hypothesis prints it
        printer.text(self.label)


class SnapshotModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="snapshot-model-")
        self.cwd = os.path.join(self.tmp, "cwd")
        self.company = CompanyFactory()
        self.agent = AgentFactory(company=self.company)
        self.workspace = ExecutionWorkspaceFactory(company=self.company, cwd=self.cwd)
        self.issues = [
            IssueFactory(company=self.company, assignee_agent=self.agent) for _ in range(2)
        ]
        user = UserFactory()
        BoardMembership.objects.create(user=user, company=self.company)
        self.board = Actor(type="board", user=user, company_ids=frozenset({self.company.pk}))
        self.head: Tree = {}  # what the head must hold
        self.cwd_at: str | None = None  # the head materialization last settled at
        self.head_name: str | None = None  # the head the last step left
        self.has_head = False  # no tree at all yet (the head is none, not an empty tree)
        self.cwd_holds: Tree = {}  # what the cwd held when materialization last settled
        self.moves = 0  # head moves the model expects to be recorded
        self.open: list[ModelRun] = []
        self.count = 0

    def teardown(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- helpers --

    def real_head(self) -> str | None:
        return (
            ExecutionWorkspace.objects.filter(pk=self.workspace.pk)
            .values_list("head_tree", flat=True)
            .get()
        )

    def commit_expected(self, tree: Tree, why: str, *, moves: bool = True) -> None:
        if tree != self.head or (moves and not self.has_head):
            self.moves += 1  # the first publish moves a head that was none, even to {}
            self.has_head = True
        self.head = tree
        note(f"{why}: head -> {render(tree)}")

    def live_holds(self, model_run: ModelRun) -> list[IssueRecoveryAction]:
        return list(
            IssueRecoveryAction.objects.filter(
                company_id=self.company.pk,
                cause=CONFLICT_CAUSE,
                evidence__runId=str(model_run.run.pk),
                status__in=LIVE_STATUSES,
            )
        )

    # -- rules --

    @precondition(lambda self: len(self.open) < MAX_OPEN_RUNS)
    @rule(
        edits=st.lists(EDITS, min_size=1, max_size=3),
        issue=st.sampled_from((0, 1)),
    )
    def start_run(self, edits: list[Edit], issue: int) -> None:
        """A run checks out the head, edits its workdir, registers the tree under the
        workspace's lease (released after) and reports its result with it."""
        self.count += 1
        base_name = self.real_head()
        tree_model = dict(self.head)
        for edit in edits:
            apply_edit(tree_model, edit)
        tree = store_model_tree(self.company.pk, tree_model)
        chosen = self.issues[issue]
        run = NativeRunFactory(
            company=self.company,
            agent=self.agent,
            issue=chosen,
            native_issue=chosen,
            execution_workspace=self.workspace,
            status=HeartbeatRun.Status.RUNNING,
        )
        chosen.execution_run = run
        chosen.checkout_run = run
        chosen.save(update_fields=["execution_run", "checkout_run"])
        owner = RuntimeLeaseOwner.for_agent(self.agent.pk, run_id=run.pk)
        claim = runtime_lease_claim(
            company_id=self.company.pk,
            execution_workspace_id=self.workspace.pk,
            action="start",
            owner=owner,
        )
        assert claim.lease is not None, claim
        try:
            run_snapshot_register(
                company_id=self.company.pk,
                run_id=run.pk,
                agent_id=self.agent.pk,
                tree=tree,
                base=base_name,
                generation=claim.lease.generation,
            )
        finally:
            runtime_lease_release(
                company_id=self.company.pk, execution_workspace_id=self.workspace.pk, owner=owner
            )
        result_accept(
            company_id=self.company.pk,
            run_id=run.pk,
            agent_id=self.agent.pk,
            result={"summary": f"run {self.count}"},
            run_terminal_state="succeeded",
            workspace_tree=tree,
        )
        model_run = ModelRun(
            run=run,
            issue_id=chosen.pk,
            base=dict(self.head),
            tree_model=tree_model,
            tree=tree,
            label=f"run{self.count}",
            edits=list(edits),
        )
        self.open.append(model_run)
        note(f"{model_run.label} on issue {issue} from {render(self.head)}: {edits}")

    @precondition(lambda self: any(r.state == "accepted" for r in self.open))
    @rule(data=st.data())
    def finalize(self, data: st.DataObject) -> None:
        """The worker finalizes a run: its tree is published (fast-forward or merged with
        the head of now), or it is held for the board when its changes overlap."""
        accepted = [r for r in self.open if r.state == "accepted"]
        model_run = data.draw(st.sampled_from(accepted), label="run")
        expected = merge(model_run.base, model_run.tree_model, self.head)
        outcome = run_finalize(company_id=self.company.pk, run_id=model_run.run.pk)
        assert isinstance(outcome, Acquired), outcome
        status = outcome.value.status
        note(f"{model_run.label} finalized: {status}")
        event(f"finalized: {status}")
        if expected.conflicts:
            assert status == "held", (
                f"{model_run.label} overlaps the head at {sorted(expected.conflicts)} "
                f"but finalization answered {status}"
            )
            model_run.state = "held"
            assert len(self.live_holds(model_run)) == 1
        else:
            assert status == "committed", (
                f"{model_run.label} changes nothing the head changed, yet {status}"
            )
            model_run.state = "done"
            self.open.remove(model_run)
            self.commit_expected(expected.clean, f"{model_run.label} published")

    @precondition(lambda self: any(r.state == "held" for r in self.open))
    @rule(data=st.data())
    def board_resolves(self, data: st.DataObject) -> None:
        """The board decides a held run, against the head as it is now; the decision is
        finalized at once."""
        held = [r for r in self.open if r.state == "held"]
        model_run = data.draw(st.sampled_from(held), label="held run")
        resolution = data.draw(st.sampled_from(RESOLUTIONS), label="resolution")
        holds = self.live_holds(model_run)
        assert len(holds) == 1, f"{model_run.label} is held but has {len(holds)} live hold(s)"
        conflict_service.workspace_conflict_resolve(
            actor=self.board,
            issue_id=model_run.issue_id,
            action_id=holds[0].pk,
            run_id=model_run.run.pk,
            resolution=resolution,
            note=f"the board chose {resolution}",
        )
        outcome = run_finalize(company_id=self.company.pk, run_id=model_run.run.pk)
        assert isinstance(outcome, Acquired), outcome
        assert outcome.value.status == "committed", outcome.value
        event(f"resolved: {resolution}")
        model_run.state = "done"
        self.open.remove(model_run)
        expected = resolve(model_run.base, model_run.tree_model, self.head, resolution)
        self.commit_expected(
            expected,
            f"{model_run.label} resolved by the board: {resolution}",
            moves=resolution != "discard",
        )

    @precondition(lambda self: self.cwd_at != self.head_name)
    @rule(fault=st.sampled_from((0, 1, 1, 2)))
    def materialize(self, fault: int) -> None:
        """The worker materializes the head into the cwd; with `fault`, the fault-th rename
        fails once (a full disk): the cwd keeps every unchanged entry and no partly written
        file, and the next attempts finish the head."""
        if fault:
            with rename_fails(fault) as fired:
                failed: BaseException | None = None
                try:
                    workspace_materialize(workspace_id=self.workspace.pk)
                except Exception as exc:  # only the injected fault may escape: re-raised below
                    failed = exc
                if failed is not None and not _caused_by_fault(failed):
                    raise failed
                if fired():
                    event("materialization failed part way")
                    note(f"materialization: rename {fault} failed")
                    self.check_partial_cwd()
        self.settle()

    # -- checks --

    def check_partial_cwd(self) -> None:
        before, after, disk = self.cwd_holds, self.head, disk_tree(self.cwd)
        for path, value in disk.items():
            allowed = [v for v in (before.get(path), after.get(path)) if v is not None]
            if value[0] == "d":
                assert any(v[0] == "d" for v in allowed), (path, value, allowed)
            else:
                assert value in allowed, f"{path} holds {value!r}, neither {allowed!r}"

        def kept(path: str) -> bool:
            parts = path.split("/")
            prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
            return all(
                before.get(p) is not None and before.get(p) == after.get(p) for p in prefixes
            )

        for path in before:
            if kept(path) and before[path][0] != "d":
                assert disk.get(path) == before[path], f"unchanged {path} gone from the cwd"

    def settle(self) -> None:
        for _ in range(3):
            head = self.real_head()
            row = ExecutionWorkspace.objects.filter(pk=self.workspace.pk).values("cwd_tree").get()
            if head is None or row["cwd_tree"] == head:
                break
            workspace_materialize(workspace_id=self.workspace.pk)
        head = self.real_head()
        cwd_tree = (
            ExecutionWorkspace.objects.filter(pk=self.workspace.pk)
            .values_list("cwd_tree", flat=True)
            .get()
        )
        if head is None:
            return
        assert cwd_tree == head, "materialization did not settle at the head"
        disk = disk_tree(self.cwd)
        assert disk == self.head, (
            f"the cwd holds {render(disk)}, the head must be {render(self.head)}"
        )
        assert build(read_tree(self.cwd))[0] == head
        self.cwd_holds = dict(self.head)
        self.cwd_at = head

    @invariant()
    def head_holds_every_committed_change(self) -> None:
        head = self.head_name = self.real_head()
        actual = stored_tree(self.company.pk, head)
        assert actual == self.head, (
            f"the head holds {render(actual)}, the committed changes make {render(self.head)}"
        )
        recorded = ActivityEvent.objects.filter(
            entity_id=str(self.workspace.pk), action__startswith="workspace.head"
        ).count()
        assert recorded == self.moves, f"{recorded} recorded head moves, {self.moves} made"

    @invariant()
    def each_held_run_waits_for_the_board(self) -> None:
        for model_run in self.open:
            coordinator = NativeRunFinalization.objects.get(run_id=model_run.run.pk)
            assert coordinator.phase != NativeRunFinalization.Phase.COMMITTED, model_run.label
            run = HeartbeatRun.objects.get(pk=model_run.run.pk)
            # Running, or the status its result said: never ended by a later run or hold.
            assert run.status in ("running", "succeeded"), (model_run.label, run.status)
            if model_run.state == "held":
                holds = self.live_holds(model_run)
                assert len(holds) == 1, (
                    f"{model_run.label} waits for the board but has {len(holds)} live hold(s)"
                )

    @initialize()
    def nothing_yet(self) -> None:
        assert self.real_head() is None


def render(tree: Tree) -> str:
    def one(value: Value) -> str:
        if value[0] == "d":
            return "/" if value[1] == 0o755 else f"/{oct(int(value[1]))}"
        if value[0] == "l":
            return f"->{value[1]}"
        data = value[1]
        assert isinstance(data, bytes)
        mode = "" if value[2] == 0o644 else f"({oct(int(value[2]))})"
        return repr(data.decode().strip()) + mode

    return "{" + ", ".join(f"{p}{one(tree[p])}" for p in sorted(tree)) + "}"


def note(text: str) -> None:
    from hypothesis import note as hypothesis_note

    hypothesis_note(text)


# Until the board's resolutions merge (`keep_head` accepted), `publish` replaces the head with
# the run's tree and the model catches it: the test is an expected failure there, reported
# unshrunk (shrinking a stateful failure over the database takes minutes).
RESOLUTIONS_MERGE: Final = "keep_head" in RESOLUTIONS

MODEL_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    phases=list(Phase) if RESOLUTIONS_MERGE else [Phase.explicit, Phase.generate],
)


# Marked slow for its length (about 45 s), not for processes: it starts first among the tests
# and stays out of the fast subset.
@pytest.mark.slow
@pytest.mark.xfail(
    not RESOLUTIONS_MERGE,
    reason="the board's publish replaces the head instead of merging (issue 38)",
    strict=True,
)
def test_the_head_holds_every_committed_change_and_the_cwd_follows_it() -> None:
    run_state_machine_as_test(SnapshotModel, settings=MODEL_SETTINGS)


# --- the model's own rules, as plain functions ------------------------------------------------

BASE: Tree = {"a": DIR, "a/x": ("f", b"one\n", 0o644), "b": DIR, "b/x": ("f", b"one\n", 0o644)}


def test_the_model_merges_disjoint_changes_and_finds_overlapping_ones() -> None:
    run = {**BASE, "a/x": ("f", b"run\n", 0o644)}
    head = {**BASE, "b/y": ("f", b"head\n", 0o644)}
    assert merge(BASE, run, head) == Merge({**run, "b/y": ("f", b"head\n", 0o644)}, frozenset())
    alike = merge(BASE, run, {**head, "a/x": ("f", b"run\n", 0o644)})
    assert alike.conflicts == frozenset()  # both sides made the same change
    assert merge(BASE, run, {**BASE, "a/x": ("f", b"head\n", 0o644)}).conflicts == {"a/x"}
    # The head turned b into a file while the run changed something inside it.
    inside = {**BASE, "b/x": ("f", b"run\n", 0o644)}
    turned = {"a": DIR, "a/x": ("f", b"one\n", 0o644), "b": ("f", b"file\n", 0o644)}
    assert merge(BASE, inside, turned).conflicts == {"b/x"}


def test_each_resolution_keeps_every_change_outside_the_conflict() -> None:
    run = {**BASE, "a/x": ("f", b"run\n", 0o644), "a/y": ("l", "x")}
    head = {**BASE, "a/x": ("f", b"head\n", 0o644), "b/y": ("f", b"later\n", 0o644)}
    published = resolve(BASE, run, head, "publish")
    assert published == {**head, "a/x": ("f", b"run\n", 0o644), "a/y": ("l", "x")}
    assert resolve(BASE, run, head, "keep_head") == {**head, "a/y": ("l", "x")}
    assert resolve(BASE, run, head, "discard") == head
    # The run removed b while the head added inside it: publish removes b whole; keep_head
    # keeps b and what the head put there, and the run's removal of b/x (no conflict) lands.
    gone = {"a": DIR, "a/x": ("f", b"run\n", 0o644)}
    added = {**BASE, "b/y": ("f", b"later\n", 0o644)}
    assert resolve(BASE, gone, added, "publish") == gone
    kept = {"a": DIR, "a/x": ("f", b"run\n", 0o644), "b": DIR, "b/y": ("f", b"later\n", 0o644)}
    assert resolve(BASE, gone, added, "keep_head") == kept
