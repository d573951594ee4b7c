"""`POST /api/heartbeat-runs/{id}/snapshots`: a run's agent registers the tree of its workdir,
fenced by the workspace's runtime lease; every blob must be stored; a bad tree, a stale owner,
another company's run or a result naming an unregistered tree change nothing
(docs/snapshots.md#registering-a-snapshot)."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from leases.services import RuntimeLeaseOwner, runtime_lease_claim
from paperclip.models import ActivityEvent, CasBlob, HeartbeatRun, RunSnapshot
from paperclip.snapshots.trees import Entry, blob_name, build, canonical_json
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
    NativeRunFactory,
)
from tests.recovery.snapshots import entries_of, put_blob, store_tree

pytestmark = pytest.mark.django_db

FILES = {"README.md": b"hello\n", "src/main.py": b"print('hi')\n", "src/link": "main.py"}


class Runner:
    def __init__(self, make_agent_client: Any) -> None:
        self.company = CompanyFactory()
        self.agent = AgentFactory(company=self.company)
        self.workspace = ExecutionWorkspaceFactory(company=self.company)
        issue = IssueFactory(company=self.company, assignee_agent=self.agent)
        self.run: HeartbeatRun = NativeRunFactory(
            company=self.company,
            agent=self.agent,
            issue=issue,
            native_issue=issue,
            execution_workspace=self.workspace,
            status="running",
        )
        self.client: APIClient = make_agent_client(self.agent)
        self.generation = self.claim(self.run)

    def claim(self, run: HeartbeatRun) -> int:
        claim = runtime_lease_claim(
            company_id=self.company.pk,
            execution_workspace_id=self.workspace.pk,
            action="start",
            owner=RuntimeLeaseOwner.for_agent(self.agent.pk, run_id=run.pk),
        )
        assert claim.lease is not None
        self.fence = claim.lease.fence
        return claim.lease.generation

    def register(self, tree: str, base: str | None = None, **extra: Any) -> Any:
        body = {"tree": tree, "base": base, "generation": self.generation, **extra}
        return self.client.post(f"/api/heartbeat-runs/{self.run.pk}/snapshots", body, format="json")


@pytest.fixture
def runner(make_agent_client: Any) -> Runner:
    return Runner(make_agent_client)


def test_the_runs_agent_registers_a_stored_tree_once(runner: Runner) -> None:
    tree = store_tree(runner.company.pk, FILES)
    first = runner.register(tree)
    assert first.status_code == 201, first.content
    assert first.json() == {"tree": tree, "base": None, "files": 2, "bytes": 18}
    assert ActivityEvent.objects.filter(action="run.snapshot_registered").count() == 1
    again = runner.register(tree)
    assert again.status_code == 200
    assert again.json() == first.json()
    assert ActivityEvent.objects.filter(action="run.snapshot_registered").count() == 1


def test_a_tree_with_blobs_not_stored_is_refused_naming_them(runner: Runner) -> None:
    entries = entries_of(runner.company.pk, FILES, store=False)
    root, blobs = build(entries)
    for data in blobs.values():
        put_blob(runner.company.pk, data)
    refused = runner.register(root)
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert error["code"] == "snapshot_blobs_missing"
    assert sorted(error["details"]["missing"]) == sorted(
        {blob_name(b"hello\n"), blob_name(b"print('hi')\n")}
    )
    assert not RunSnapshot.objects.exists()


def test_a_missing_directory_blob_is_named_too(runner: Runner) -> None:
    refused = runner.register(blob_name(b"never stored"))
    assert refused.json()["error"]["details"]["missing"] == [blob_name(b"never stored")]


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ([{"name": "x", "type": "symlink", "target": "/etc/passwd"}], "absolute_symlink"),
        ([{"name": "x", "type": "symlink", "target": "../outside"}], "escaping_symlink"),
        ([{"name": "..", "type": "symlink", "target": "a"}], "bad_name"),
        ([{"name": "a/b", "type": "symlink", "target": "a"}], "bad_name"),
        (
            [
                {"name": "a", "type": "symlink", "target": "b"},
                {"name": "a", "type": "symlink", "target": "c"},
            ],
            "duplicate_name",
        ),
        ([{"name": "a", "type": "file", "mode": True, "size": 0, "digest": "x"}], "bad_mode"),
    ],
)
def test_a_hostile_tree_is_refused_with_the_path_and_reason(
    runner: Runner, entries: list[dict[str, Any]], reason: str
) -> None:
    data = canonical_json({"schema": "paperclip.dir.v1", "entries": entries})
    root = put_blob(runner.company.pk, data)
    refused = runner.register(root)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "snapshot_tree_invalid"
    assert error["details"]["reason"] == reason
    assert not RunSnapshot.objects.exists()


def test_a_superseded_generation_is_refused(runner: Runner) -> None:
    tree = store_tree(runner.company.pk, FILES)
    refused = runner.register(tree, generation=runner.generation + 1)
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "workspace_runtime_lease_superseded"
    assert not RunSnapshot.objects.exists()


def test_another_run_of_the_same_agent_holding_the_lease_fences_this_one_out(
    runner: Runner,
) -> None:
    tree = store_tree(runner.company.pk, FILES)
    runner.run.status = "interrupted"
    runner.run.save(update_fields=["status"])
    newer = NativeRunFactory(
        company=runner.company,
        agent=runner.agent,
        issue=runner.run.issue,
        native_issue=runner.run.issue,
        execution_workspace=runner.workspace,
        status="running",
    )
    runner.claim(newer)  # reclaims the lane from the interrupted run
    refused = runner.register(tree)
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "workspace_runtime_lease_superseded"


def test_another_companys_run_or_blobs_look_absent(runner: Runner, make_agent_client: Any) -> None:
    tree = store_tree(runner.company.pk, FILES)
    outsider = make_agent_client(AgentFactory())
    body = {"tree": tree, "base": None, "generation": runner.generation}
    foreign = outsider.post(f"/api/heartbeat-runs/{runner.run.pk}/snapshots", body, format="json")
    assert foreign.status_code == 404
    # Blobs stored by another company do not count as stored for this one.
    other = Runner(make_agent_client)
    theirs = runner.register(tree)
    assert theirs.status_code == 201
    mine = other.register(tree)
    assert mine.status_code == 409
    assert mine.json()["error"]["code"] == "snapshot_blobs_missing"


@pytest.mark.parametrize(
    "body",
    [
        {"tree": "sha256:abc", "base": None, "generation": 1},
        {"tree": None, "base": None, "generation": 1},
        {"tree": blob_name(b"x"), "generation": 1},
        {"tree": blob_name(b"x"), "base": None, "generation": "1"},
        {"tree": blob_name(b"x"), "base": None, "generation": 1, "extra": 1},
    ],
)
def test_malformed_bodies_are_400_and_write_nothing(runner: Runner, body: dict[str, Any]) -> None:
    response = runner.client.post(
        f"/api/heartbeat-runs/{runner.run.pk}/snapshots", body, format="json"
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"
    assert not RunSnapshot.objects.exists()


def test_registration_pins_every_blob_against_collection(runner: Runner) -> None:
    tree = store_tree(runner.company.pk, FILES)
    CasBlob.objects.update(referenced_at="2000-01-01T00:00:00Z")
    assert runner.register(tree).status_code == 201
    assert not CasBlob.objects.filter(referenced_at__year=2000).exists()


def test_a_result_must_name_a_tree_the_run_registered(runner: Runner) -> None:
    tree = store_tree(runner.company.pk, FILES)
    body = {
        "result": {},
        "terminal": {"run_terminal_state": "succeeded"},
        "workspace_tree": tree,
    }
    url = f"/api/heartbeat-runs/{runner.run.pk}/results"
    refused = runner.client.post(url, body, format="json")
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "snapshot_not_registered"
    assert runner.register(tree).status_code == 201
    accepted = runner.client.post(url, body, format="json")
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["result_json"]["workspaceTree"] == tree


def test_a_symlink_escaping_through_another_symlink_is_refused(runner: Runner) -> None:
    entries = {
        "s": Entry(name="s", type="dir", mode=0o755),
        "s/up": Entry(name="up", type="symlink", target=".."),
        "x": Entry(name="x", type="symlink", target="s/up/../secret"),
    }
    root, blobs = build(entries)
    for data in blobs.values():
        put_blob(runner.company.pk, data)
    refused = runner.register(root)
    assert refused.json()["error"]["details"] == {"path": "x", "reason": "escaping_symlink"}


def test_a_tree_of_more_files_than_one_store_query_takes_registers(runner: Runner) -> None:
    # 10,001 distinct contents: more names than one find-missing or pin query takes.
    contents = [f"file {i}\n".encode() for i in range(10_001)]
    CasBlob.objects.bulk_create(
        CasBlob(company_id=runner.company.pk, digest=blob_name(data), size=len(data))
        for data in contents
    )
    entries = {
        f"f{i:05d}": Entry(
            name=f"f{i:05d}", type="file", mode=0o644, size=len(data), digest=blob_name(data)
        )
        for i, data in enumerate(contents)
    }
    root, blobs = build(entries)
    for data in blobs.values():
        put_blob(runner.company.pk, data)
    response = runner.register(root)
    assert response.status_code == 201, response.content[:300]
    assert response.json()["files"] == 10_001


def test_a_snapshot_naming_the_leases_fence_registers_and_another_fence_is_superseded(
    runner: Runner,
) -> None:
    tree = store_tree(runner.company.pk, FILES)
    stale = runner.register(tree, fence=runner.fence + 1)
    assert stale.status_code == 409
    assert stale.json()["error"]["details"]["current_fence"] == runner.fence
    assert not RunSnapshot.objects.exists()
    assert runner.register(tree, fence=runner.fence).status_code == 201
