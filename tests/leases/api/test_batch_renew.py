"""`POST /api/leases/renew`: runtime and controller leases renewed in one request, each item
fenced and answered on its own (docs/leases.md#batch-renew)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from django.db import connection

from checkpoints.services import controller_lease_acquire
from leases.models import WorkspaceRuntimeLease
from paperclip.models import ActivityEvent, HeartbeatRun, NativeRunFinalization
from tests.checkpoints.factories import TEST_KEY, expire_lease
from tests.leases.factories import claim, expire, lease_row, running_run
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory, NativeRunFactory

pytestmark = pytest.mark.django_db
URL = "/api/leases/renew"
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@pytest.fixture(autouse=True)
def checkpoint_keys(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]


def both_leases(company: Any = None) -> dict[str, Any]:
    """A running native run holding its workspace's runtime lease (as `run:<id>`) and its
    controller lease; the two batch items that renew them."""
    run, granted = running_run(company=company)
    assert granted is not None
    assert granted.lease is not None
    controller = controller_lease_acquire(
        run_id=run.pk, agent_id=run.agent_id, boot_id="boot-a", ttl_seconds=60
    )
    return {
        "run": run,
        "agent": run.agent,
        "runtime": granted.lease,
        "controller": controller,
        "runtime_item": {
            "kind": "runtime",
            "execution_workspace_id": str(run.execution_workspace_id),
            "run_id": str(run.pk),
            "generation": granted.lease.generation,
            "ttl_seconds": 3600,
        },
        "controller_item": {
            "kind": "controller",
            "run_id": str(run.pk),
            "boot_id": "boot-a",
            "lease_owner": controller.lease_owner,
            "ttl_seconds": 600,
        },
    }


def audit_count() -> int:
    return ActivityEvent.objects.count()


def coordinator_expiry(run_id: Any) -> Any:
    return NativeRunFinalization.objects.get(pk=run_id).lease_expires_at


def post(client: Any, body: Any) -> Any:
    return client.post(URL, body, format="json")


def codes(response: Any) -> list[Any]:
    assert response.status_code == 200, response.content
    return [r["lease"] if r["ok"] else r["error"]["code"] for r in response.json()["results"]]


def test_both_kinds_renew_in_one_request_as_their_single_endpoints_answer(
    make_agent_client: Any,
) -> None:
    world = both_leases()
    client = make_agent_client(world["agent"])
    before_runtime = lease_row(world["run"].execution_workspace)
    before_audit = audit_count()

    response = post(client, {"leases": [world["runtime_item"], world["controller_item"]]})

    assert response.status_code == 200, response.content
    runtime, controller = response.json()["results"]
    assert runtime["ok"] is True
    assert controller["ok"] is True
    after_runtime = lease_row(world["run"].execution_workspace)
    assert after_runtime is not None
    assert before_runtime is not None
    # The single claim's renew: same generation, fence, claimed_at and action; expiry moved.
    for column in ("generation", "fence", "claimed_at", "last_action", "owner_key"):
        assert after_runtime[column] == before_runtime[column]
    assert after_runtime["expires_at"] > before_runtime["expires_at"]
    ttl = (after_runtime["expires_at"] - after_runtime["renewed_at"]).total_seconds()
    assert ttl == pytest.approx(3600)
    # The lease JSON is the claim endpoint's (the same serializer, the same keys and values).
    claimed = client.post(
        f"/api/execution-workspaces/{world['run'].execution_workspace_id}/runtime-lease/claim",
        {"action": "start", "run_id": str(world["run"].pk), "ttl_seconds": 3600},
        format="json",
    ).json()["lease"]
    assert set(runtime["lease"]) == set(claimed)
    same = {k for k in claimed if k not in ("renewed_at", "expires_at")}
    assert {k: runtime["lease"][k] for k in same} == {k: claimed[k] for k in same}
    # The controller lease JSON is the controller-lease endpoint's renew.
    assert controller["lease"]["outcome"] == "renewed"
    assert controller["lease"]["lease_owner"] == world["controller"].lease_owner
    assert controller["lease"]["generation"] == world["controller"].generation
    assert set(controller["lease"]) == {
        "lease_owner",
        "controller_boot_id",
        "generation",
        "lease_expires_at",
        "outcome",
    }
    assert coordinator_expiry(world["run"].pk) > world["controller"].lease_expires_at
    # Renewals write no audit row (the claim above was a renew too).
    assert audit_count() == before_audit


def test_a_stale_item_fails_alone_and_the_answers_keep_request_order(
    make_agent_client: Any,
) -> None:
    world = both_leases()
    other = both_leases(company=world["run"].company)  # another agent of the same company
    client = make_agent_client(world["agent"])
    superseded = {**world["runtime_item"], "generation": world["runtime"].generation + 1}
    unknown_ws = {"kind": "runtime", "execution_workspace_id": str(uuid.uuid4()), "generation": 1}
    before = audit_count()
    response = post(
        client,
        {
            "leases": [
                superseded,
                other["controller_item"],
                unknown_ws,
                other["runtime_item"],
                world["controller_item"],
            ]
        },
    )
    answers = codes(response)
    assert answers[:4] == [
        "workspace_runtime_lease_superseded",
        "permission_denied",  # another agent's run, as on the controller-lease endpoint
        "not_found",
        "permission_denied",  # another agent's run as owner, as on the claim
    ]
    assert isinstance(answers[4], dict)
    assert answers[4]["outcome"] == "renewed"
    details = response.json()["results"][0]["error"]["details"]
    assert details["current_generation"] == world["runtime"].generation
    assert details["requested_generation"] == world["runtime"].generation + 1
    assert audit_count() == before
    row = lease_row(world["run"].execution_workspace)  # the refused lease was not touched
    assert row is not None
    assert row["renewed_at"] == world["runtime"].renewed_at
    other_row = lease_row(other["run"].execution_workspace)
    assert other_row is not None
    assert other_row["renewed_at"] == other["runtime"].renewed_at


def test_only_renews_an_item_that_would_create_or_reclaim_fails(make_agent_client: Any) -> None:
    world = both_leases()
    client = make_agent_client(world["agent"])
    run = world["run"]
    bare = ExecutionWorkspaceFactory(company=run.company)
    expire_lease(run.pk)
    expired_at = coordinator_expiry(run.pk)
    before = audit_count()
    response = post(
        client,
        {
            "leases": [
                {"kind": "runtime", "execution_workspace_id": str(bare.pk), "generation": 1},
                world["controller_item"],
            ]
        },
    )
    results = response.json()["results"]
    assert [r["error"]["code"] for r in results] == [
        "workspace_runtime_lease_superseded",
        "controller_lease_held",
    ]
    assert results[0]["error"]["details"]["current_generation"] is None
    assert results[1]["error"]["details"]["generation"] == world["controller"].generation
    assert not WorkspaceRuntimeLease.objects.filter(execution_workspace=bare).exists()
    assert coordinator_expiry(run.pk) == expired_at  # not minted again, not renewed
    assert audit_count() == before


def test_an_expired_runtime_lease_nobody_reclaimed_still_renews(make_agent_client: Any) -> None:
    world = both_leases()
    expire(world["run"].execution_workspace)
    response = post(make_agent_client(world["agent"]), {"leases": [world["runtime_item"]]})
    (answer,) = codes(response)
    assert isinstance(answer, dict)
    assert answer["generation"] == world["runtime"].generation


def test_a_fence_that_moved_is_superseded(make_agent_client: Any) -> None:
    world = both_leases()
    client = make_agent_client(world["agent"])
    right = {**world["runtime_item"], "fence": world["runtime"].fence}
    assert isinstance(codes(post(client, {"leases": [right]}))[0], dict)
    wrong = {**world["runtime_item"], "fence": world["runtime"].fence + 1}
    response = post(client, {"leases": [wrong]})
    assert codes(response) == ["workspace_runtime_lease_superseded"]
    assert response.json()["results"][0]["error"]["details"]["current_fence"] == (
        world["runtime"].fence
    )


def test_a_terminal_run_is_ineligible_for_both_kinds(make_agent_client: Any) -> None:
    world = both_leases()
    HeartbeatRun.objects.filter(pk=world["run"].pk).update(status="failed")
    before = lease_row(world["run"].execution_workspace)
    response = post(
        make_agent_client(world["agent"]),
        {"leases": [world["runtime_item"], world["controller_item"]]},
    )
    assert codes(response) == [
        "workspace_runtime_lease_owner_ineligible",
        "controller_lease_run_terminal",
    ]
    assert response.json()["results"][0]["error"]["details"]["reason"] == "owner_run_terminal"
    assert lease_row(world["run"].execution_workspace) == before


def test_a_legacy_run_is_not_native(make_agent_client: Any) -> None:
    agent = AgentFactory()
    legacy = NativeRunFactory(agent=agent, company=agent.company, runtime_mode="legacy")
    item = {"kind": "controller", "run_id": str(legacy.pk), "boot_id": "b", "lease_owner": "o"}
    assert codes(post(make_agent_client(agent), {"leases": [item]})) == [
        "controller_lease_run_not_native"
    ]


def _normalized(response: Any) -> Any:
    return json.loads(UUID_RE.sub("<id>", response.content.decode()))


def test_another_companys_leases_look_like_leases_that_exist_nowhere(
    make_agent_client: Any,
) -> None:
    mine, theirs = both_leases(), both_leases()
    client = make_agent_client(mine["agent"])
    rows_before = lease_row(theirs["run"].execution_workspace)
    expiry_before = coordinator_expiry(theirs["run"].pk)
    nowhere_runtime = {**theirs["runtime_item"], "execution_workspace_id": str(uuid.uuid4())}
    nowhere_runtime["run_id"] = str(uuid.uuid4())
    nowhere_controller = {**theirs["controller_item"], "run_id": str(uuid.uuid4())}
    foreign = post(client, {"leases": [theirs["runtime_item"], theirs["controller_item"]]})
    absent = post(client, {"leases": [nowhere_runtime, nowhere_controller]})
    assert codes(foreign) == ["not_found", "not_found"]
    assert _normalized(foreign) == _normalized(absent)
    assert lease_row(theirs["run"].execution_workspace) == rows_before
    assert coordinator_expiry(theirs["run"].pk) == expiry_before


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({}, "leases"),
        ({"leases": []}, "leases"),
        ({"leases": "x"}, "leases"),
        ({"leases": [{}] * 501}, "leases"),
        ({"leases": [], "extra": 1}, "extra"),
        ([], "non_field_errors"),
    ],
)
def test_a_malformed_body_is_a_400(make_agent_client: Any, body: Any, where: str) -> None:
    world = both_leases()
    response = post(make_agent_client(world["agent"]), body)
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert where in error["details"]["fields"]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"generation": True}, "generation"),
        ({"generation": 1.0}, "generation"),
        ({"generation": "1"}, "generation"),
        ({"generation": 0}, "generation"),
        ({"execution_workspace_id": "not-a-uuid"}, "execution_workspace_id"),
        ({"ttl_seconds": 10**9}, "ttl_seconds"),
        ({"fence": -1}, "fence"),
        ({"action": "start"}, "action"),
        ({"kind": "lock"}, "kind"),
        ({"kind": None}, "kind"),
    ],
)
def test_one_malformed_item_renews_nothing(
    make_agent_client: Any, bad: dict[str, Any], field: str
) -> None:
    world = both_leases()
    before = lease_row(world["run"].execution_workspace)
    controller_before = coordinator_expiry(world["run"].pk)
    response = post(
        make_agent_client(world["agent"]),
        {
            "leases": [
                world["runtime_item"],
                world["controller_item"],
                {**world["runtime_item"], **bad},
            ]
        },
    )
    assert response.status_code == 400, response.content
    fields = response.json()["error"]["details"]["fields"]
    assert field in fields["leases"]["2"], fields
    assert lease_row(world["run"].execution_workspace) == before
    assert coordinator_expiry(world["run"].pk) == controller_before


def test_a_lease_named_twice_is_malformed(make_agent_client: Any) -> None:
    world = both_leases()
    item = world["controller_item"]
    response = post(make_agent_client(world["agent"]), {"leases": [item, {**item}]})
    assert response.status_code == 400
    assert "1" in response.json()["error"]["details"]["fields"]["leases"]


def test_controller_items_are_validated_as_the_single_endpoint(make_agent_client: Any) -> None:
    world = both_leases()
    client = make_agent_client(world["agent"])
    for bad, field in (
        ({"boot_id": "has space"}, "boot_id"),
        ({"ttl_seconds": 5}, "ttl_seconds"),
        ({"lease_owner": None}, "lease_owner"),
        ({"lease_owner": "x" * 401}, "lease_owner"),
        ({"generation": 1}, "generation"),
    ):
        response = post(client, {"leases": [{**world["controller_item"], **bad}]})
        assert response.status_code == 400, (bad, response.content)
        assert field in response.json()["error"]["details"]["fields"]["leases"]["0"]
    missing = {k: v for k, v in world["controller_item"].items() if k != "lease_owner"}
    response = post(client, {"leases": [missing]})
    assert response.status_code == 400


def test_a_board_member_or_no_key_is_refused(
    make_board_client: Any, make_agent_client: Any, client: Any
) -> None:
    world = both_leases()
    body = {"leases": [world["runtime_item"]]}
    board = post(make_board_client(world["run"].company), body)
    assert board.status_code == 403
    assert client.post(URL, body, content_type="application/json").status_code == 401
    row = lease_row(world["run"].execution_workspace)
    assert row is not None
    assert row["renewed_at"] == world["runtime"].renewed_at


def test_many_leases_renew_in_one_statement_per_kind(
    make_agent_client: Any, django_assert_max_num_queries: Any
) -> None:
    agent = AgentFactory()
    workspaces = [ExecutionWorkspaceFactory(company=agent.company) for _ in range(60)]
    grants = [claim(workspace, agent) for workspace in workspaces]
    items = [
        {
            "kind": "runtime",
            "execution_workspace_id": str(g.lease.execution_workspace_id),
            "generation": g.lease.generation,
            "ttl_seconds": 3600,
        }
        for g in grants
        if g.lease is not None
    ]
    client = make_agent_client(agent)
    post(client, {"leases": items[:1]})  # the key's first use updates last_used_at
    with django_assert_max_num_queries(3):  # the key, the renew (and nothing per item)
        response = post(client, {"leases": items})
    assert all(isinstance(answer, dict) for answer in codes(response))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM execution_workspace_runtime_leases"
            " WHERE expires_at - renewed_at <> interval '3600 s' AND company_id = %s",
            [agent.company_id],
        )
        (untouched,) = cursor.fetchone()
    assert untouched == 0
