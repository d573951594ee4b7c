"""HTTP API: controller lease, checkpoint write/read/header/parts, error paths."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction
from rest_framework.test import APIClient

from checkpoints.models import NativeRunnerCheckpoint
from paperclip.locks import run_lock_with_issue
from paperclip.models import ActivityEvent, Agent, Company, NativeRunFinalization
from paperclip.services import run_finish_in_tx
from tests.checkpoints.factories import coordinator, expire_lease
from tests.helpers import assert_error
from tests.paperclip.factories import AgentFactory, CompanyFactory, HeartbeatRunFactory

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


@pytest.fixture
def fin() -> NativeRunFinalization:
    return coordinator()


@pytest.fixture
def runner(
    fin: NativeRunFinalization, make_agent_client: Callable[[Agent], APIClient]
) -> APIClient:
    return make_agent_client(fin.run.agent)


def url(fin: NativeRunFinalization, suffix: str = "checkpoint") -> str:
    return f"/api/heartbeat-runs/{fin.run_id}/{suffix}"


def acquire(client: APIClient, fin: NativeRunFinalization, **body: Any) -> Any:
    return client.post(url(fin, "controller-lease"), {"boot_id": "boot-a", **body}, format="json")


def put(client: APIClient, fin: NativeRunFinalization, grant: dict[str, Any], **body: Any) -> Any:
    payload = {
        "owner": {
            "boot_id": grant["controller_boot_id"],
            "lease_owner": grant["lease_owner"],
            "generation": grant["generation"],
        },
        "reset": False,
        "changed": {},
        "removed": [],
        "work_command_ids": [],
        "predecessor": None,
        **body,
    }
    return client.put(url(fin), payload, format="json")


def test_runner_round_trip(runner: APIClient, fin: NativeRunFinalization) -> None:
    res = acquire(runner, fin, ttl_seconds=120)
    assert res.status_code == 200, res.json()
    grant = res.json()
    assert set(grant) >= {"lease_owner", "controller_boot_id", "generation", "lease_expires_at"}
    assert grant["generation"] == 1
    renew = acquire(runner, fin, lease_owner=grant["lease_owner"])
    assert renew.json()["generation"] == 1
    assert renew.json()["outcome"] == "renewed"

    res = put(runner, fin, grant, changed={"header": "HEAD-ER", "log": "L"})
    assert res.status_code == 200, res.json()
    assert res.json() == {"parts": 2}
    assert runner.get(url(fin)).json() == {"parts": {"header": "HEAD-ER", "log": "L"}}
    assert runner.get(url(fin, "checkpoint/header")).json() == {"header": "HEAD-ER"}
    res = put(runner, fin, grant, removed=["log"])
    assert res.json() == {"parts": 1}
    listing = runner.get(url(fin, "checkpoint/parts")).json()["results"]
    assert [(p["part"], p["size_bytes"]) for p in listing] == [("header", 7)]
    assert "HEAD-ER" not in json.dumps(listing)


def test_contents_hold_any_text_but_a_nul_like_every_body(
    runner: APIClient, fin: NativeRunFinalization
) -> None:
    grant = acquire(runner, fin).json()
    nul = put(runner, fin, grant, changed={"bin": "log\x00line"})
    error = assert_error(nul, 400, "invalid_request")
    assert error["details"]["fields"] == {"changed.bin": ["NUL characters are not allowed."]}
    contents = "log line\n\u00e9\U0001f600\t\u0001"
    res = put(runner, fin, grant, changed={"bin": contents})
    assert res.status_code == 200, res.json()
    assert runner.get(url(fin)).json() == {"parts": {"bin": contents}}
    listing = runner.get(url(fin, "checkpoint/parts")).json()["results"]
    assert listing[0]["size_bytes"] == len(contents.encode())


def test_unpaired_surrogates_are_400(runner: APIClient, fin: NativeRunFinalization) -> None:
    grant = acquire(runner, fin).json()
    owner = {k: grant[k] for k in ("lease_owner", "generation")}
    owner["boot_id"] = grant["controller_boot_id"]
    for body in (
        {"changed": {"a": "x\ud800"}},
        {"work_command_ids": ["c\ud800"]},
        {"removed": ["a\ud800"]},
    ):
        # Raw JSON: the test client's encoder refuses surrogates itself.
        raw = json.dumps({"owner": owner, "reset": False, **body})
        res = runner.generic("PUT", url(fin), raw, content_type="application/json")
        assert res.status_code == 400, (body, res.content)
        assert_error(res, 400, "invalid_request")
    assert not NativeRunnerCheckpoint.objects.exists()


def test_controller_lease_held_is_409(runner: APIClient, fin: NativeRunFinalization) -> None:
    acquire(runner, fin)
    res = acquire(runner, fin, boot_id="boot-b")
    assert_error(res, 409, "controller_lease_held")


def test_stale_owner_write_is_409_and_changes_nothing(
    runner: APIClient, fin: NativeRunFinalization
) -> None:
    old = acquire(runner, fin).json()
    put(runner, fin, old, changed={"a": "old"})
    expire_lease(fin.run_id)
    new = acquire(runner, fin, boot_id="boot-b").json()
    assert new["generation"] == 2
    events = ActivityEvent.objects.count()
    res = put(runner, fin, old, changed={"a": "stale"})
    assert_error(res, 409, "native_runner_checkpoint_owner_lost")
    assert ActivityEvent.objects.count() == events
    assert runner.get(url(fin)).json() == {"parts": {"a": "old"}}


def test_predecessor_mismatch_is_422(runner: APIClient, fin: NativeRunFinalization) -> None:
    grant = acquire(runner, fin).json()
    res = put(
        runner,
        fin,
        grant,
        changed={"a": "1"},
        predecessor={
            "run_id": str(fin.run_id),
            "normalized_session_id": "5b0a2a5c-8a43-4a4c-9d0e-6f1c1b2f5e11",
        },
    )
    assert_error(res, 422, "native_runner_checkpoint_binding_mismatch")
    assert not NativeRunnerCheckpoint.objects.exists()


def test_unreadable_part_is_422_naming_it_and_header_null(
    runner: APIClient, fin: NativeRunFinalization, settings: Any
) -> None:
    grant = acquire(runner, fin).json()
    put(runner, fin, grant, changed={"header": "H", "body": "B"})
    settings.PAPERCLIP_CHECKPOINT_KEYS = ["A" * 43 + "="]  # a different key: the old one is lost
    res = runner.get(url(fin))
    err = assert_error(res, 422, "native_runner_checkpoint_unreadable")
    assert err["details"]["part"] == "body"
    assert err["details"]["reason"] == "unknown_key"
    assert runner.get(url(fin, "checkpoint/header")).json() == {"header": None}


def test_restore_session_check(runner: APIClient, fin: NativeRunFinalization) -> None:
    grant = acquire(runner, fin).json()
    header = json.dumps({"recoveryEvidence": {"normalizedSessionId": "sess-1"}})
    put(runner, fin, grant, changed={"header": header})
    assert runner.get(url(fin), {"normalized_session_id": "sess-1"}).status_code == 200
    res = runner.get(url(fin), {"normalized_session_id": "sess-2"})
    assert_error(res, 422, "native_runner_checkpoint_binding_mismatch")


def test_a_header_nested_past_the_parsers_depth_is_a_session_mismatch_not_a_500(
    runner: APIClient, fin: NativeRunFinalization
) -> None:
    """The header is the agent's own text: nested 100,000 deep (200 kB, under the part limit)
    the JSON parser gives up with a RecursionError, which was a 500 on the restore read."""
    grant = acquire(runner, fin).json()
    put(runner, fin, grant, changed={"header": "[" * 100_000 + "]" * 100_000})
    res = runner.get(url(fin), {"normalized_session_id": "sess-1"})
    assert_error(res, 422, "native_runner_checkpoint_binding_mismatch")


@pytest.mark.parametrize(
    "body",
    [
        {"changed": {"": "x"}},
        {"changed": {"bad\u0007": "x"}},
        {"changed": {"a": 5}},
        {"changed": ["a"]},
        {"removed": "a"},
        {"removed": [1]},
        {"work_command_ids": [None]},
        {"reset": "maybe"},
        {"predecessor": {"run_id": "nope", "normalized_session_id": "x"}},
        {"owner": {"boot_id": "has:colon", "lease_owner": "x", "generation": 1}},
        {"owner": {"boot_id": "b", "lease_owner": "x", "generation": -1}},
        {"owner": None},
    ],
)
def test_malformed_writes_are_400(
    runner: APIClient, fin: NativeRunFinalization, body: dict[str, Any]
) -> None:
    grant = acquire(runner, fin).json()
    res = put(runner, fin, grant, **body)
    error = assert_error(res, 400, "invalid_request")
    assert "fields" in error["details"]
    assert not NativeRunnerCheckpoint.objects.exists()


def test_oversized_part_is_400(
    runner: APIClient, fin: NativeRunFinalization, settings: Any
) -> None:
    settings.PAPERCLIP_CHECKPOINT_MAX_PART_BYTES = 100
    grant = acquire(runner, fin).json()
    res = put(runner, fin, grant, changed={"big": "x" * 101})
    assert res.status_code == 400
    assert "changed" in res.json()["error"]["details"]["fields"]


def test_oversized_body_is_refused_before_parsing(
    runner: APIClient, fin: NativeRunFinalization, settings: Any
) -> None:
    settings.PAPERCLIP_CHECKPOINT_MAX_WRITE_BYTES = 10
    grant = acquire(runner, fin).json()
    res = put(runner, fin, grant, changed={"big": "x" * (1024 * 1024 + 100)})
    assert res.status_code == 400
    assert "body" in res.json()["error"]["details"]["fields"]


def test_malformed_json_is_400(runner: APIClient, fin: NativeRunFinalization) -> None:
    res = runner.generic("PUT", url(fin), "{not json", content_type="application/json")
    assert_error(res, 400, "invalid_request")


@pytest.mark.parametrize("suffix", ["checkpoint", "checkpoint/header", "controller-lease"])
def test_other_agent_of_same_company_is_403_other_company_is_404(
    fin: NativeRunFinalization, make_agent_client: Callable[[Agent], APIClient], suffix: str
) -> None:
    same = make_agent_client(AgentFactory(company=fin.company))
    foreign = make_agent_client(AgentFactory(company=CompanyFactory()))
    call = (
        (lambda c: c.post(url(fin, suffix), {"boot_id": "b"}, format="json"))
        if suffix == "controller-lease"
        else (lambda c: c.get(url(fin, suffix)))
    )
    assert_error(call(same), 403, "permission_denied")
    assert_error(call(foreign), 404, "not_found")


def test_other_company_cannot_write(
    fin: NativeRunFinalization, runner: APIClient, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    grant = acquire(runner, fin).json()
    foreign = make_agent_client(AgentFactory(company=CompanyFactory()))
    assert put(foreign, fin, grant, changed={"a": "x"}).status_code == 404
    assert not NativeRunnerCheckpoint.objects.exists()


def test_board_sees_metadata_only(
    fin: NativeRunFinalization, runner: APIClient, make_board_client: Callable[..., APIClient]
) -> None:
    grant = acquire(runner, fin).json()
    put(runner, fin, grant, changed={"header": "secret"})
    board = make_board_client(fin.company)
    assert board.get(url(fin)).status_code == 403
    assert board.get(url(fin, "checkpoint/header")).status_code == 403
    listing = board.get(url(fin, "checkpoint/parts"))
    assert listing.status_code == 200
    assert [p["part"] for p in listing.json()["results"]] == ["header"]
    other_board = make_board_client(CompanyFactory())
    assert other_board.get(url(fin, "checkpoint/parts")).status_code == 404


def test_malformed_and_unknown_run_ids_are_404(runner: APIClient) -> None:
    for run_id in ["not-a-uuid", "00000000-0000-0000-0000-000000000000"]:
        res = runner.get(f"/api/heartbeat-runs/{run_id}/checkpoint")
        assert_error(res, 404, "not_found")


def test_legacy_run_is_422(
    company: Company, make_agent_client: Callable[[Agent], APIClient]
) -> None:
    run = HeartbeatRunFactory(company=company)
    client = make_agent_client(run.agent)
    res = client.post(
        f"/api/heartbeat-runs/{run.pk}/controller-lease", {"boot_id": "b"}, format="json"
    )
    assert_error(res, 422, "controller_lease_run_not_native")


def test_ttl_out_of_range_is_400(runner: APIClient, fin: NativeRunFinalization) -> None:
    for ttl in (9, 3601, "x"):
        res = acquire(runner, fin, ttl_seconds=ttl)
        assert res.status_code == 400
        assert "ttl_seconds" in res.json()["error"]["details"]["fields"]


def test_failure_hook_endpoint(runner: APIClient, fin: NativeRunFinalization) -> None:
    grant = acquire(runner, fin).json()
    body = {"boot_id": "boot-a", "lease_owner": grant["lease_owner"]}
    assert runner.post(url(fin, "controller-lease/expire"), body, format="json").json() == {
        "expired": True
    }
    assert runner.post(url(fin, "controller-lease/expire"), body, format="json").json() == {
        "expired": False
    }
    res = put(runner, fin, grant, changed={"a": "1"})
    assert_error(res, 409, "native_runner_checkpoint_owner_lost")


def test_schema_documents_the_endpoints(
    runner: APIClient, make_board_client: Callable[..., APIClient]
) -> None:
    board = make_board_client(superuser=True)
    res = board.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert res.status_code == 200
    text = res.content.decode()
    for path in ["/controller-lease", "/checkpoint", "/checkpoint/header", "/checkpoint/parts"]:
        assert f"/api/heartbeat-runs/{{run_id}}{path}" in text
    assert "native_runner_checkpoint_owner_lost" in text


@pytest.mark.parametrize("source", ["other_run_same_issue", "other_company"])
def test_ciphertext_copied_from_another_row_is_422_naming_the_part(
    fin: NativeRunFinalization,
    runner: APIClient,
    make_agent_client: Callable[[Agent], APIClient],
    source: str,
) -> None:
    if source == "other_company":
        donor = coordinator()
    else:
        donor = NativeRunFinalization.objects.create(
            run=HeartbeatRunFactory(
                company=fin.company,
                agent=fin.run.agent,
                issue=fin.issue,
                native_issue=fin.issue,
                runtime_mode="native",
                status="running",
            ),
            company=fin.company,
            issue=fin.issue,
        )
    donor_client = make_agent_client(donor.run.agent)
    put(donor_client, donor, acquire(donor_client, donor).json(), changed={"log": "theirs"})
    put(runner, fin, acquire(runner, fin).json(), changed={"header": "H", "log": "mine"})
    stolen = NativeRunnerCheckpoint.objects.get(run=donor.run, part="log")
    NativeRunnerCheckpoint.objects.filter(run=fin.run, part="log").update(
        key_id=stolen.key_id, nonce=stolen.nonce, ciphertext=stolen.ciphertext
    )
    res = runner.get(url(fin))
    err = assert_error(res, 422, "native_runner_checkpoint_unreadable")
    assert err["details"]["part"] == "log"
    assert err["details"]["reason"] == "authentication_failed"
    assert "theirs" not in res.content.decode()
    assert runner.get(url(fin, "checkpoint/header")).json() == {"header": "H"}


def test_without_any_key_reads_are_422_and_never_create_the_key_file(
    runner: APIClient, fin: NativeRunFinalization, settings: Any
) -> None:
    grant = acquire(runner, fin).json()
    put(runner, fin, grant, changed={"header": "H"})
    settings.PAPERCLIP_CHECKPOINT_KEYS = []  # and no key file in the (fresh) data directory
    key_file = settings.DATA_DIR / "checkpoint_keys"
    assert not key_file.exists()
    res = runner.get(url(fin))
    assert res.status_code == 422
    assert res.json()["error"]["details"] == {
        "part": "header",
        "reason": "key_unavailable",
        "key_id": NativeRunnerCheckpoint.objects.get(run=fin.run).key_id,
    }
    assert runner.get(url(fin, "checkpoint/header")).json() == {"header": None}
    assert runner.get(url(fin, "checkpoint/parts")).status_code == 200
    assert not key_file.exists()


@pytest.mark.parametrize("status", ["interrupted", "failed", "cancelled", "timed_out", "succeeded"])
def test_a_run_that_became_terminal_takes_no_checkpoint_write(
    runner: APIClient, fin: NativeRunFinalization, status: str
) -> None:
    grant = acquire(runner, fin, ttl_seconds=600).json()
    assert put(runner, fin, grant).status_code == 200
    with transaction.atomic():
        locked = run_lock_with_issue(run_id=fin.run_id)
        run_finish_in_tx(run=locked.run, to_status=status, actor_type="system", actor_id="test")
    fin.refresh_from_db()
    assert fin.lease_expires_at is not None  # ended with the run, in its transaction
    writes = NativeRunnerCheckpoint.objects.count()
    refused = put(runner, fin, grant, changed={"late.txt": "after the end"})
    assert_error(refused, 409, "native_runner_checkpoint_owner_lost")
    assert NativeRunnerCheckpoint.objects.count() == writes


@pytest.mark.parametrize("boot_id", ["boot\n", "boot-a\n", ""])
def test_a_boot_id_ending_in_a_newline_is_refused(
    runner: APIClient, fin: NativeRunFinalization, boot_id: str
) -> None:
    """Python's `$` matches before a final newline: "boot\\n" was taken and stored."""
    assert_error(acquire(runner, fin, boot_id=boot_id), 400, "invalid_request")
