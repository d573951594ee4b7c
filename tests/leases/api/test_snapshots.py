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
from paperclip.snapshots.trees import Entry, blob_name, build, canonical_json, encode_dir
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
    NativeRunFactory,
)
from tests.paperclip.snapshots.test_tree_bounds import shared_levels
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
        # The agent CLI's state directory: every checkout of such a head refuses it.
        ([{"name": ".paperclip", "type": "symlink", "target": "a"}], "reserved_name"),
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


# --- What materialization could not write is refused at registration --------------------------


def _stored_root(runner: Runner, entries: dict[str, Entry]) -> str:
    root, blobs = build(entries)
    for data in blobs.values():
        put_blob(runner.company.pk, data)
    return root


def _refusal(response: Any) -> dict[str, Any]:
    assert response.status_code == 400, response.content
    error: dict[str, Any] = response.json()["error"]
    assert not RunSnapshot.objects.exists()
    assert not ActivityEvent.objects.filter(action="run.snapshot_registered").exists()
    return error


def test_a_file_whose_size_differs_from_its_stored_blob_is_refused(runner: Runner) -> None:
    content = put_blob(runner.company.pk, b"hello\n")
    lying = Entry(name="README.md", type="file", mode=0o644, size=600, digest=content)
    error = _refusal(runner.register(_stored_root(runner, {"README.md": lying})))
    assert error["code"] == "snapshot_tree_invalid"
    assert error["details"]["path"] == "README.md"
    assert error["details"]["reason"] == "size_mismatch"


def test_one_blob_named_with_two_sizes_is_refused(runner: Runner) -> None:
    content = put_blob(runner.company.pk, b"hello\n")
    entries = {
        "a": Entry(name="a", type="file", mode=0o644, size=6, digest=content),
        "b": Entry(name="b", type="file", mode=0o644, size=7, digest=content),
    }
    error = _refusal(runner.register(_stored_root(runner, entries)))
    assert error["details"] == {"path": "b", "reason": "size_mismatch"}


def test_a_chunked_file_whose_chunks_do_not_add_up_to_its_size_is_refused(
    runner: Runner,
) -> None:
    chunks = (put_blob(runner.company.pk, b"x" * 10), put_blob(runner.company.pk, b"y" * 3))
    good = Entry(name="big", type="file", mode=0o644, size=13, chunks=chunks)
    assert runner.register(_stored_root(runner, {"big": good})).status_code == 201
    RunSnapshot.objects.all().delete()
    ActivityEvent.objects.filter(action="run.snapshot_registered").delete()
    lying = Entry(name="big", type="file", mode=0o644, size=14, chunks=chunks)
    error = _refusal(runner.register(_stored_root(runner, {"big": lying})))
    assert error["details"] == {"path": "big", "reason": "size_mismatch"}


def test_a_size_lie_in_a_tree_registered_against_the_head_is_refused(runner: Runner) -> None:
    files = {f"d{i}/f{j}": b"%d %d\n" % (i, j) for i in range(3) for j in range(3)}
    head = store_tree(runner.company.pk, files)
    assert runner.register(head).status_code == 201
    runner.workspace.head_tree = head
    runner.workspace.save(update_fields=["head_tree"])
    entries = entries_of(runner.company.pk, files)
    # One file of one directory changed, its size a lie; a file the head holds, named again
    # with another size, beside it.
    changed = put_blob(runner.company.pk, b"changed\n")
    entries["d1/f1"] = Entry(name="f1", type="file", mode=0o644, size=80, digest=changed)
    error = _refusal_after(runner, _stored_root(runner, entries), head)
    assert error["details"] == {"path": "d1/f1", "reason": "size_mismatch"}
    entries["d1/f1"] = Entry(name="f1", type="file", mode=0o644, size=8, digest=changed)
    entries["d1/f2"] = Entry(name="f2", type="file", mode=0o644, size=3, digest=blob_name(b"1 2\n"))
    error = _refusal_after(runner, _stored_root(runner, entries), head)
    assert error["details"] == {"path": "d1/f2", "reason": "size_mismatch"}


def test_the_path_bytes_bound_holds_when_registering_against_the_head(
    runner: Runner, settings: Any
) -> None:
    """PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES bounds a registration's memory; the comparison with
    the head must not let a tree whose shared directories name more path bytes through (the
    worker would then expand every path of it)."""
    head = store_tree(runner.company.pk, {"README.md": b"hello\n"})
    assert runner.register(head).status_code == 201
    runner.workspace.head_tree = head
    runner.workspace.save(update_fields=["head_tree"])
    # 8,190 paths of up to 3 KB (about 12 MB of path text) in 13 small blobs
    root = shared_levels(runner.company.pk, 12, name_bytes=255)
    settings.PAPERCLIP_SNAPSHOT_MAX_PATH_BYTES = 1_000_000
    error = _refusal_after(runner, root, head)
    assert error["details"]["reason"] == "too_many_entries"
    assert not RunSnapshot.objects.filter(tree=root).exists()


def _refusal_after(runner: Runner, tree: str, base: str) -> dict[str, Any]:
    before = RunSnapshot.objects.count()
    response = runner.register(tree, base)
    assert response.status_code == 400, response.content
    assert RunSnapshot.objects.count() == before
    error: dict[str, Any] = response.json()["error"]
    assert error["code"] == "snapshot_tree_invalid"
    return error


@pytest.mark.parametrize(
    ("entries", "path"),
    [
        ({"a": "b", "b": "a"}, "a"),
        ({"a": "a"}, "a"),
        ({"d": None, "d/x": "../y", "y": "d/x"}, "y"),
        ({"a": "b/c", "b": None, "b/c": "../a"}, "a"),
    ],
)
def test_symlinks_that_resolve_to_each_other_are_refused(
    runner: Runner, entries: dict[str, str | None], path: str
) -> None:
    tree = {
        where: Entry(name=where.rpartition("/")[2], type="dir", mode=0o755)
        if target is None
        else Entry(name=where.rpartition("/")[2], type="symlink", target=target)
        for where, target in entries.items()
    }
    error = _refusal(runner.register(_stored_root(runner, tree)))
    assert error["code"] == "snapshot_tree_invalid"
    assert error["details"] == {"path": path, "reason": "symlink_loop"}


def test_a_symlink_climbing_out_through_a_chain_of_links_is_refused(runner: Runner) -> None:
    # d/l -> m -> .. is the root; d/x -> l/../.. then climbs above it.
    entries = {
        "d": Entry(name="d", type="dir", mode=0o755),
        "d/l": Entry(name="l", type="symlink", target="m"),
        "d/m": Entry(name="m", type="symlink", target=".."),
        "d/x": Entry(name="x", type="symlink", target="l/../.."),
    }
    error = _refusal(runner.register(_stored_root(runner, entries)))
    assert error["details"] == {"path": "d/x", "reason": "escaping_symlink"}


def test_links_to_links_that_stay_inside_still_register(runner: Runner) -> None:
    entries = {
        "d": Entry(name="d", type="dir", mode=0o755),
        "d/f": Entry(
            name="f",
            type="file",
            mode=0o644,
            size=6,
            digest=put_blob(runner.company.pk, b"hello\n"),
        ),
        "a": Entry(name="a", type="symlink", target="b"),
        "b": Entry(name="b", type="symlink", target="d/f"),
        "c": Entry(name="c", type="symlink", target="a"),
        "up": Entry(name="up", type="symlink", target="d/.."),
    }
    assert runner.register(_stored_root(runner, entries)).status_code == 201


def _links_named_ten_times(runner: Runner, links: int) -> str:
    """One directory blob of `links` links whose 4,094-byte targets `a/a/…/a/` (2,048
    components, the last empty) each climb through the link `a -> .` 2,047 times, named by
    ten entries of the root."""
    target = "a/" * 2047
    own = [Entry(name="a", type="symlink", target=".")] + [
        Entry(name=f"{i:05d}", type="symlink", target=target) for i in range(links)
    ]
    shared = put_blob(runner.company.pk, encode_dir(own))
    named = [Entry(name=f"d{i}", type="dir", mode=0o755, digest=shared) for i in range(10)]
    return put_blob(runner.company.pk, encode_dir(named))


def test_long_link_targets_in_a_shared_directory_are_refused_past_the_step_bound(
    runner: Runner,
) -> None:
    """8 MB of directory blob: 20,000 links to resolve where it stands, 41 million target
    components. Each path resolves its links on its own, so the components resolved count
    path by path against PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS (5 million: about 2 s; it took
    half a minute to register before, and such a tree at the entry limit an hour)."""
    error = _refusal(runner.register(_links_named_ten_times(runner, 2000)))
    assert error["details"]["reason"] == "too_many_entries"
    assert not RunSnapshot.objects.exists()


def test_the_step_bound_is_a_setting_and_the_tree_within_it_registers(
    runner: Runner, settings: Any
) -> None:
    root = _links_named_ten_times(runner, 20)  # 10 * (1 + 20 * 2,048) = 409,610 components
    settings.PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS = 409_609
    error = _refusal(runner.register(root))
    assert error["details"]["reason"] == "too_many_entries"
    settings.PAPERCLIP_SNAPSHOT_MAX_SYMLINK_STEPS = 409_610
    assert runner.register(root).status_code == 201


def _base_refused(runner: Runner, base: str) -> None:
    tree = store_tree(runner.company.pk, FILES)
    response = runner.register(tree, base)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert "base" in error["details"]["fields"]
    assert not RunSnapshot.objects.exists()
    assert not ActivityEvent.objects.filter(action="run.snapshot_registered").exists()


def test_a_base_that_is_a_file_blob_is_refused(runner: Runner) -> None:
    _base_refused(runner, put_blob(runner.company.pk, b"just a file\n"))


def test_a_base_the_store_lacks_is_refused(runner: Runner) -> None:
    _base_refused(runner, blob_name(b"never stored"))


def test_another_companys_tree_as_base_is_refused(runner: Runner) -> None:
    theirs = store_tree(CompanyFactory().pk, {"secret": b"theirs\n"})
    _base_refused(runner, theirs)


def test_a_base_that_is_a_stored_tree_registers(runner: Runner) -> None:
    base = store_tree(runner.company.pk, {"old": b"old\n"})
    tree = store_tree(runner.company.pk, FILES)
    response = runner.register(tree, base)
    assert response.status_code == 201, response.content
    assert response.json()["base"] == base


def test_a_run_owned_lease_whose_run_ended_registers_nothing(runner: Runner) -> None:
    """A lease claimed for the run (`run:<id>`) is judged by that run, as its fenced
    operations are: judged by the run's still-open issue, a run that had ended registered
    snapshots (found in review, shown failing first)."""
    tree = store_tree(runner.company.pk, FILES)
    HeartbeatRun.objects.filter(pk=runner.run.pk).update(status="failed")
    answer = runner.register(tree)
    assert answer.status_code == 409, answer.content
    assert answer.json()["error"]["code"] == "workspace_runtime_lease_owner_ineligible"
    assert not RunSnapshot.objects.filter(tree=tree).exists()
