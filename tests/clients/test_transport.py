"""Transport rules of the client, with scripted HTTP answers (no database involved): what is
retried, what is never repeated, timeouts, and the error classes of transport failures."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from paperclip_client import Client, OutcomeUnknown, ServerUnreachable, errors

Handler = Callable[[httpx.Request], httpx.Response]


def scripted(*steps: Exception | httpx.Response) -> tuple[Client, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    queue = list(steps)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        step = queue.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    client = Client(
        "http://paperclip.test", "pcak_x.y", transport=httpx.MockTransport(handle), backoff=0.001
    )
    return client, seen


def error(status: int, code: str, **details: object) -> httpx.Response:
    body = {"error": {"code": code, "message": code, "details": details}}
    return httpx.Response(status, json=body)


ME = httpx.Response(200, json={"actor_type": "agent", "agent_id": "a", "company_ids": []})
OP = "/api/execution-workspaces/w/operations"


def test_reads_are_retried_after_a_timeout_and_a_lost_database() -> None:
    client, seen = scripted(httpx.ReadTimeout("slow"), error(503, "database_unavailable"), ME)
    assert client.me().agent_id == "a"
    assert len(seen) == 3
    assert seen[0].headers["Authorization"] == "Bearer pcak_x.y"


def test_a_fenced_write_without_an_answer_is_never_repeated() -> None:
    client, seen = scripted(httpx.ReadTimeout("slow"), ME)
    with pytest.raises(OutcomeUnknown):
        client.workspace_operation_create("w", generation=1, phase="p", status="running")
    assert [r.url.path for r in seen] == [OP]


def test_a_request_that_never_left_is_retried_even_for_a_fenced_write() -> None:
    created = httpx.Response(
        201,
        json={
            "id": "o", "execution_workspace_id": "w", "heartbeat_run_id": None, "issue_id": None,
            "phase": "p", "command": None, "status": "running", "exit_code": None,
            "lease_generation": 1, "started_at": "2026-01-01T00:00:00Z", "finished_at": None,
        },
    )  # fmt: skip
    client, seen = scripted(httpx.ConnectError("refused"), error(409, "resource_busy"), created)
    op = client.workspace_operation_create("w", generation=1, phase="p", status="running")
    assert op.lease_generation == 1
    assert op.started_at.tzinfo is not None
    assert len(seen) == 3


def test_results_are_repeated_only_with_a_caller_result_id() -> None:
    client, seen = scripted(httpx.RemoteProtocolError("dropped"))
    with pytest.raises(OutcomeUnknown):
        client.result_post("r", result={}, run_terminal_state="succeeded")
    client, seen = scripted(httpx.RemoteProtocolError("dropped"), error(409, "run_not_finalizable"))
    with pytest.raises(errors.RunNotFinalizable):
        client.result_post("r", result={}, run_terminal_state="succeeded", caller_result_id="c")
    assert len(seen) == 2


def test_a_controller_lease_is_repeated_only_when_renewing() -> None:
    client, seen = scripted(httpx.ReadTimeout("slow"))
    with pytest.raises(OutcomeUnknown):
        client.controller_lease_acquire("r", boot_id="b")
    client, seen = scripted(httpx.ReadTimeout("slow"), error(409, "controller_lease_held"))
    with pytest.raises(errors.ControllerLeaseHeld):
        client.controller_lease_acquire("r", boot_id="b", lease_owner="o")
    assert len(seen) == 2


def test_unreachable_after_the_retries_and_conflicts_are_not_retried() -> None:
    client, seen = scripted(*[httpx.ConnectError("refused")] * 5)
    with pytest.raises(ServerUnreachable, match="refused"):
        client.me()
    assert len(seen) == 5
    client, seen = scripted(error(409, "workspace_runtime_lease_conflict", owner_key="run:x"))
    with pytest.raises(errors.WorkspaceRuntimeLeaseConflict) as conflict:
        client.runtime_lease_claim("w", run_id="r")
    assert conflict.value.details == {"owner_key": "run:x"}
    assert len(seen) == 1


def test_unknown_codes_fall_back_to_their_status_kind() -> None:
    client, _ = scripted(error(409, "something_new"), httpx.Response(502, text="bad gateway"))
    with pytest.raises(errors.ConflictError) as new:
        client.me()
    assert new.value.code == "something_new"
    with pytest.raises(errors.ApiError) as gateway:
        client.me()
    assert gateway.value.code == "http_502"


def test_finalize_waits_longer_than_its_wait() -> None:
    timeouts: list[object] = []

    def handle(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"]["read"])
        body = {"run_id": "r", "status": "committed", "finalization": None}
        return httpx.Response(200, json=body)

    client = Client("http://p.test", "k", timeout=10, transport=httpx.MockTransport(handle))
    assert client.finalize("r", wait=30).committed
    assert timeouts == [40]
