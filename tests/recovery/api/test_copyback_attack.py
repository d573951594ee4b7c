"""The legacy copy-back is confined (docs/security.md#the-legacy-copy-back): an agent that names
another company's workspace `cwd` (or `/`) as its run's directory and posts a result without
a tree gets 409 `workspace_copyback_not_allowed` and nothing is written; a directory replaced
by a link into another workspace after its result was accepted is refused by the worker.
Everything through the API, the worker a real one (`run_worker --once`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from paperclip.models import (
    ActivityEvent,
    ExecutionWorkspace,
    NativeRunFinalization,
    NativeRunResult,
    WorkspaceOperation,
)
from recovery.adapters.copyback import LocalDirectoryCopyback
from recovery.models import IssueRecoveryAction
from tests.helpers import assert_error, run_jobs
from tests.recovery.snapshots import store_tree

pytestmark = pytest.mark.django_db(transaction=True)

RESULT = {"result": {"summary": "done"}, "terminal": {"run_terminal_state": "succeeded"}}
SECRET = "company B's secret\n"


class Tenant:
    """A company made through the API by a superuser: one agent (with its key), one issue
    assigned to it and one execution workspace whose `cwd` is `cwd`."""

    def __init__(self, board: APIClient, name: str, cwd: Path) -> None:
        self.board = board
        company = board.post("/api/companies", {"name": name}, format="json").json()
        self.company_id = company["id"]
        agent = board.post(
            f"/api/companies/{self.company_id}/agents", {"name": f"{name} agent"}, format="json"
        ).json()
        self.agent_id = agent["id"]
        key = board.post(f"/api/agents/{self.agent_id}/keys", format="json").json()["key"]
        self.agent = APIClient()
        self.agent.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
        cwd.mkdir(parents=True, exist_ok=True)
        self.cwd = cwd
        workspace = board.post(
            f"/api/companies/{self.company_id}/execution-workspaces",
            {"name": f"{name} workspace", "cwd": str(cwd)},
            format="json",
        )
        assert workspace.status_code == 201, workspace.json()
        self.workspace_id = workspace.json()["id"]
        issue = board.post(
            f"/api/companies/{self.company_id}/issues",
            {"title": f"{name} issue", "assignee_agent_id": self.agent_id},
            format="json",
        )
        assert issue.status_code == 201, issue.json()
        self.issue_id = issue.json()["id"]

    def run(self, workspace_dir: str) -> str:
        """A native run of the agent on its issue and workspace, with `workspace_dir`."""
        created = self.agent.post(
            "/api/heartbeat-runs",
            {
                "runtime_mode": "native",
                "issue_id": self.issue_id,
                "execution_workspace_id": self.workspace_id,
                "workspace_dir": workspace_dir,
            },
            format="json",
        )
        assert created.status_code == 201, created.json()
        run_id: str = created.json()["id"]
        return run_id

    def post_result(self, run_id: str) -> Any:
        return self.agent.post(f"/api/heartbeat-runs/{run_id}/results", RESULT, format="json")


@pytest.fixture
def tenants(make_board_client: Any, tmp_path: Path) -> tuple[Tenant, Tenant]:
    board = make_board_client(superuser=True)
    a = Tenant(board, "Company A", tmp_path / "workspaces" / "a")
    b = Tenant(board, "Company B", tmp_path / "workspaces" / "b" / "work")
    (b.cwd / "secret.txt").write_text(SECRET)
    return a, b


def _written() -> tuple[int, int, int]:
    return (
        ActivityEvent.objects.count(),
        NativeRunResult.objects.count(),
        NativeRunFinalization.objects.exclude(phase="observed").count(),
    )


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("b_cwd", "execution_workspace"),
        ("b_cwd_link", "execution_workspace"),
        ("/", "outside_copyback_roots"),
        ("a_cwd_parent", "contains_execution_workspace"),
    ],
)
def test_another_companys_workspace_is_never_copied_back(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, target: str, reason: str
) -> None:
    a, b = tenants
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "innocent").symlink_to(b.cwd)
    workspace_dir = {
        "b_cwd": str(b.cwd),
        "b_cwd_link": str(tmp_path / "runs" / "innocent"),
        "/": "/",
        "a_cwd_parent": str(tmp_path / "workspaces"),
    }[target]
    run_id = a.run(workspace_dir)
    before = _written()
    error = assert_error(a.post_result(run_id), 409, "workspace_copyback_not_allowed")
    assert error["details"] == {"reason": reason}
    assert _written() == before
    run_jobs()
    assert _files(a.cwd) == []
    assert (b.cwd / "secret.txt").read_text() == SECRET


def test_with_no_roots_the_copy_back_is_off(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any
) -> None:
    a, _b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = []
    own = tmp_path / "runs" / "own"
    own.mkdir(parents=True)
    run_id = a.run(str(own))
    before = _written()
    error = assert_error(a.post_result(run_id), 409, "workspace_copyback_not_allowed")
    assert error["details"] == {"reason": "copyback_disabled"}
    assert _written() == before


def test_a_run_directory_inside_the_roots_is_copied_back(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any
) -> None:
    a, _b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "runs")]
    own = tmp_path / "runs" / "run-a"
    own.mkdir(parents=True)
    (own / "out.txt").write_text("A's work\n")
    run_id = a.run(str(own))
    assert a.post_result(run_id).status_code == 201
    run_jobs()
    assert (a.cwd / "out.txt").read_text() == "A's work\n"
    assert a.agent.get(f"/api/heartbeat-runs/{run_id}").json()["finalization"]["state"] == (
        "committed"
    )


def test_the_worker_refuses_a_directory_replaced_by_a_link_since_its_result(
    tenants: tuple[Tenant, Tenant], tmp_path: Path
) -> None:
    """The run's directory `runs/run-a/work` was A's own when its result was accepted; then
    `runs/run-a` became a link to B's workspace's parent, so the same path names B's `cwd`. The
    worker checks again before it copies: nothing of B's reaches A's workspace, the run is held
    for the board with the reason, and an explicit finalize is refused the same way."""
    a, b = tenants
    own = tmp_path / "runs" / "run-a" / "work"
    own.mkdir(parents=True)
    (own / "out.txt").write_text("A's work\n")
    run_id = a.run(str(own))
    assert a.post_result(run_id).status_code == 201
    (tmp_path / "runs" / "run-a").rename(tmp_path / "runs" / "moved-away")
    (tmp_path / "runs" / "run-a").symlink_to(b.cwd.parent)
    assert os.path.realpath(own) == str(b.cwd)
    run_jobs()
    assert _files(a.cwd) == []
    coordinator = NativeRunFinalization.objects.get(run_id=run_id)
    assert coordinator.phase == "retryable_failure"
    assert coordinator.failure_code == "workspace_copyback_not_allowed"
    assert coordinator.attempt == 1  # no retry spent on it: a retry cannot mend it
    assert coordinator.failure_detail["code"] == "workspace_copyback_not_allowed"
    assert coordinator.failure_detail["detail"].startswith("execution_workspace:")
    state = a.agent.get(f"/api/heartbeat-runs/{run_id}").json()["finalization"]
    assert state["state"] in ("failed", "held")
    assert state["last_error"].startswith("workspace_copyback_not_allowed")
    hold = IssueRecoveryAction.objects.get(
        evidence__runId=run_id, status__in=("active", "escalated")
    )
    assert hold.owner_type == "board"
    assert hold.evidence["failure"]["code"] == "workspace_copyback_not_allowed"
    # The board's explicit finalize makes one more attempt: refused the same way.
    board = b.board
    assert board.post(f"/api/heartbeat-runs/{run_id}/finalize").status_code == 202
    run_jobs()
    assert _files(a.cwd) == []
    coordinator.refresh_from_db()
    assert (coordinator.failure_code, coordinator.attempt) == ("workspace_copyback_not_allowed", 2)


def test_a_run_without_a_directory_or_a_tree_commits_with_nothing_copied(
    tenants: tuple[Tenant, Tenant],
) -> None:
    a, _b = tenants
    created = a.agent.post(
        "/api/heartbeat-runs",
        {
            "runtime_mode": "native",
            "issue_id": a.issue_id,
            "execution_workspace_id": a.workspace_id,
        },
        format="json",
    )
    run_id = created.json()["id"]
    assert a.post_result(run_id).status_code == 201
    run_jobs()
    assert _files(a.cwd) == []
    assert a.agent.get(f"/api/heartbeat-runs/{run_id}").json()["finalization"]["state"] == (
        "committed"
    )


def test_a_workspace_with_a_head_takes_no_copy_back(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any
) -> None:
    """Its cwd is made from the head: a copy-back wrote the run's files there, the commit
    forgot which tree the cwd held, and the next materialization removed them (in no tree).
    Refused when the result comes (nothing accepted), and by the worker when the workspace got
    a head after the result was accepted (nothing copied, the run held for the board)."""
    a, _b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "runs")]
    own = tmp_path / "runs" / "run-a"
    own.mkdir(parents=True)
    (own / "out.txt").write_text("A's work\n")
    late = a.run(str(own))
    assert a.post_result(late).status_code == 201  # accepted: no head yet
    head = store_tree(a.company_id, {"README.md": b"the head\n"})
    ExecutionWorkspace.objects.filter(pk=a.workspace_id).update(head_tree=head)
    run_jobs()
    assert not (a.cwd / "out.txt").exists()
    coordinator = NativeRunFinalization.objects.get(run_id=late)
    assert coordinator.failure_code == "workspace_copyback_not_allowed"
    assert coordinator.failure_detail["detail"].startswith("workspace_has_head:")
    assert coordinator.attempt == 1
    # A run whose result comes now is refused at once, nothing written.
    early = a.run(str(own))
    before = _written()
    error = assert_error(a.post_result(early), 409, "workspace_copyback_not_allowed")
    assert error["details"] == {"reason": "workspace_has_head"}
    assert _written() == before


SWAP: dict[str, Path] = {}


class SwappedWhenTheCopyStarts(LocalDirectoryCopyback):
    """The real backend, but the agent wins its race the moment the copy starts, after the
    worker's last check accepted the run's directory: a directory along its path becomes a
    link to another company's workspace."""

    def copy_back(self, **kwargs: Any) -> Any:
        link, target = SWAP["link"], SWAP["target"]
        link.rename(link.with_name("moved-away"))
        link.symlink_to(target)
        return super().copy_back(**kwargs)


class SwappedDuringTheCopy(LocalDirectoryCopyback):
    """As above, the swap made once the copy has opened the source (its first check)."""

    def copy_back(self, **kwargs: Any) -> Any:
        check = kwargs.pop("check")
        swapped: list[bool] = []

        def swap_then_check() -> None:
            if not swapped:
                swapped.append(True)
                link, target = SWAP["link"], SWAP["target"]
                link.rename(link.with_name("moved-away"))
                link.symlink_to(target)
            check()

        return super().copy_back(check=swap_then_check, **kwargs)


@pytest.mark.parametrize("backend", ["SwappedWhenTheCopyStarts", "SwappedDuringTheCopy"])
def test_a_directory_along_the_path_swapped_after_the_last_check_is_never_followed(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any, backend: str
) -> None:
    """The worker judges `runs/run-a/work` (A's own) and copies from that resolved path alone,
    checking where every directory and file it opens lies: `runs/run-a` swapped for a link to
    B's workspace's parent after the check copies nothing of B's. It re-resolved the agent's
    path, and copied B's cwd into A's."""
    a, b = tenants
    settings.PAPERCLIP_COPYBACK_BACKEND = f"{__name__}.{backend}"
    own = tmp_path / "runs" / "run-a" / "work"
    own.mkdir(parents=True)
    (own / "out.txt").write_text("A's work\n")
    run_id = a.run(str(own))
    assert a.post_result(run_id).status_code == 201
    SWAP.update(link=tmp_path / "runs" / "run-a", target=b.cwd.parent)
    run_jobs()
    assert not (a.cwd / "secret.txt").exists()
    assert SECRET not in [
        p.read_text() for p in a.cwd.rglob("*") if p.is_file() and not p.is_symlink()
    ]
    coordinator = NativeRunFinalization.objects.get(run_id=run_id)
    # A failed attempt, retried later; the retry's check then refuses the path for good
    # (it now names B's cwd), as above.
    assert coordinator.phase == "workspace_finalizing"
    assert coordinator.failure_code == "workspace_copyback_failed"
    assert coordinator.failure_detail["code"] == "copyback_source_missing"


def test_links_that_leave_the_copy_through_other_links_are_not_copied(
    tenants: tuple[Tenant, Tenant], tmp_path: Path
) -> None:
    """`l1 -> .` and `l2 -> l1/..` each stay inside by their text; together `l2` names the
    directory holding every workspace's cwd, and `b_secret -> l2/<B's cwd>/secret.txt` reads
    B's file from A's cwd. The copy keeps `l1` and drops (reports) the others."""
    a, b = tenants
    own = tmp_path / "runs" / "run-a"
    own.mkdir(parents=True)
    (own / "out.txt").write_text("A's work\n")
    (own / "l1").symlink_to(".")
    (own / "l2").symlink_to("l1/..")
    (own / "b_secret").symlink_to("l2/" + os.path.relpath(b.cwd / "secret.txt", a.cwd.parent))
    run_id = a.run(str(own))
    assert a.post_result(run_id).status_code == 201
    run_jobs()
    assert NativeRunFinalization.objects.get(run_id=run_id).phase == "committed"
    assert (a.cwd / "out.txt").read_text() == "A's work\n"
    assert os.readlink(a.cwd / "l1") == "."
    assert not (a.cwd / "l2").is_symlink()
    assert not (a.cwd / "b_secret").is_symlink()
    operation = WorkspaceOperation.objects.get(
        heartbeat_run_id=run_id, phase=WorkspaceOperation.PHASE_WORKSPACE_FINALIZE
    )
    assert sorted(operation.metadata["copied"]["skipped"]) == ["b_secret", "l2"]
    assert operation.metadata["copied"]["symlinks"] == 1


@pytest.mark.parametrize("target", ["theirs", "theirs_link", "inside_theirs", "holds_theirs"])
def test_another_companys_run_directory_is_never_copied_back(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any, target: str
) -> None:
    """B's runner made B's run directory under the shared copy-back root; A's agent names that
    directory (or a link to it, a directory inside it, one holding it) as its own run's. The
    worker (often root) must not copy B's work into A's workspace: refused with a reason that
    says nothing about B, nothing written."""
    a, b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "runs")]
    theirs = tmp_path / "runs" / "host" / "run-b"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "b-work.txt").write_text("company B's unpublished work\n")
    (tmp_path / "runs" / "innocent").symlink_to(theirs)
    b.run(str(theirs))
    workspace_dir = {
        "theirs": str(theirs),
        "theirs_link": str(tmp_path / "runs" / "innocent"),
        "inside_theirs": str(theirs / "sub"),
        "holds_theirs": str(tmp_path / "runs" / "host"),
    }[target]
    run_id = a.run(workspace_dir)
    before = _written()
    error = assert_error(a.post_result(run_id), 409, "workspace_copyback_not_allowed")
    assert error["details"] == {"reason": "another_company_run"}
    assert _written() == before
    run_jobs()
    assert _files(a.cwd) == []


def test_a_run_directory_recorded_through_a_link_is_matched_by_where_it_points(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any
) -> None:
    """B's run names its directory through a link (`runs/b-link -> runs/real-b`); A names the
    real directory. Compared as written, the two differ."""
    a, b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "runs")]
    real = tmp_path / "runs" / "real-b"
    real.mkdir(parents=True)
    (real / "b-work.txt").write_text("company B's unpublished work\n")
    (tmp_path / "runs" / "b-link").symlink_to(real)
    b.run(str(tmp_path / "runs" / "b-link"))
    run_id = a.run(str(real))
    error = assert_error(a.post_result(run_id), 409, "workspace_copyback_not_allowed")
    assert error["details"] == {"reason": "another_company_run"}


def test_a_directory_another_company_names_outside_the_roots_refuses_nothing(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any
) -> None:
    """B's agent names `/` (or the root itself) as its run's directory: the copy-back never
    reads it, so it is no run directory of B's, and A's own run directory is copied back."""
    a, b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "runs")]
    own = tmp_path / "runs" / "run-a"
    own.mkdir(parents=True)
    (own / "out.txt").write_text("A's work\n")
    b.run("/")
    b.run(str(tmp_path / "runs"))
    run_id = a.run(str(own))
    assert a.post_result(run_id).status_code == 201
    run_jobs()
    assert (a.cwd / "out.txt").read_text() == "A's work\n"


def test_the_worker_refuses_a_directory_another_company_named_since_the_result(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any
) -> None:
    """A's result was accepted while no other company named its directory; B's run names it
    before the worker copies. The worker checks again and copies nothing: the run is held for
    the board with the reason."""
    a, b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "runs")]
    shared = tmp_path / "runs" / "run-x"
    shared.mkdir(parents=True)
    (shared / "out.txt").write_text("whose work?\n")
    run_id = a.run(str(shared))
    assert a.post_result(run_id).status_code == 201
    b.run(str(shared))
    run_jobs()
    assert _files(a.cwd) == []
    coordinator = NativeRunFinalization.objects.get(run_id=run_id)
    assert coordinator.failure_code == "workspace_copyback_not_allowed"
    assert coordinator.failure_detail["detail"].startswith("another_company_run:")
    assert coordinator.attempt == 1


def test_a_copy_back_never_makes_a_setuid_or_setgid_file_or_directory(
    tenants: tuple[Tenant, Tenant], tmp_path: Path, settings: Any
) -> None:
    """The agent's run directory holds a program it made setuid, in a setgid directory: the
    worker (often root) writes the copy as its own, so with its source's mode the cwd got a
    setuid-root program. Only the permission bits are copied, as materialization does."""
    a, _b = tenants
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "runs")]
    own = tmp_path / "runs" / "run-a"
    (own / "bin").mkdir(parents=True)
    tool = own / "bin" / "tool"
    tool.write_text("#!/bin/sh\nid\n")
    if os.geteuid() == 0:  # as an agent would: its own file, not root's
        os.chown(tool, 65534, 65534)
    tool.chmod(0o4755)
    (own / "bin").chmod(0o2755)
    run_id = a.run(str(own))
    assert a.post_result(run_id).status_code == 201
    run_jobs()
    copied = a.cwd / "bin" / "tool"
    assert copied.read_text() == "#!/bin/sh\nid\n"
    assert stat.S_IMODE(copied.stat().st_mode) == 0o755
    assert stat.S_IMODE((a.cwd / "bin").stat().st_mode) == 0o755
