"""Management commands: create_agent_key, create_board_token, seed_demo."""

from __future__ import annotations

import io

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from leases.models import WorkspaceRuntimeLease
from leases.selectors import with_stale_reason
from paperclip.models import (
    ActivityEvent,
    Agent,
    AgentApiKey,
    Company,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
)
from paperclip.receipts import raw_owner
from paperclip.worker.jobs import pending_jobs
from recovery.locks import finalization_queueing_lock
from tests.paperclip.factories import AgentFactory, UserFactory
from tests.paperclip.helpers import bearer_client

pytestmark = pytest.mark.django_db


def _run(*args: str) -> list[str]:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue().strip().splitlines()


def _me(secret: str) -> dict:
    response = bearer_client(secret).get("/api/me")
    assert response.status_code == 200, response.content
    return response.json()


def test_create_agent_key_prints_a_working_secret_last() -> None:
    agent = AgentFactory()
    lines = _run("create_agent_key", "--agent", str(agent.pk))
    secret = lines[-1]
    assert secret.startswith("pcak_")
    assert " " not in secret
    assert _me(secret)["agent_id"] == str(agent.pk)


@pytest.mark.parametrize("value", ["nope", "00000000-0000-0000-0000-000000000000"])
def test_create_agent_key_rejects_bad_agents(value: str) -> None:
    with pytest.raises(CommandError):
        _run("create_agent_key", "--agent", value)
    assert not AgentApiKey.objects.exists()


def test_create_board_token_for_a_new_user(company) -> None:
    lines = _run("create_board_token", "--user", "operator")
    user = get_user_model().objects.get(username="operator")
    assert user.is_staff
    assert not user.is_superuser
    assert not user.has_usable_password()
    me = _me(lines[-1])
    assert me["actor_type"] == "board"
    assert me["company_ids"] == []


def test_create_board_token_superuser_sees_everything(company) -> None:
    UserFactory(username="boss", is_staff=False)
    lines = _run("create_board_token", "--user", "boss", "--superuser")
    assert lines[-1].startswith("pcbt_")
    me = _me(lines[-1])
    assert me["user"]["is_superuser"] is True
    assert me["company_ids"] == [str(company.pk)]
    assert ActivityEvent.objects.filter(action="board_user.updated").count() == 1


def test_create_board_token_rejects_inactive_users() -> None:
    UserFactory(username="gone", is_active=False)
    with pytest.raises(CommandError):
        _run("create_board_token", "--user", "gone")


def _counts() -> dict[str, int]:
    return {
        "companies": Company.objects.count(),
        "agents": Agent.objects.count(),
        "issues": Issue.objects.count(),
        "workspaces": ExecutionWorkspace.objects.count(),
        "runs": HeartbeatRun.objects.count(),
        "coordinators": NativeRunFinalization.objects.count(),
        "active_keys": AgentApiKey.objects.filter(revoked_at__isnull=True).count(),
        "users": get_user_model().objects.count(),
    }


def _printed_keys(lines: list[str]) -> list[str]:
    return [line.rsplit(" ", 1)[-1] for line in lines if " key: pcak_" in line]


def _printed_password(lines: list[str]) -> str:
    (line,) = [line for line in lines if line.startswith("Admin login:")]
    return line.rsplit(" ", 1)[-1]


def test_seed_demo_is_idempotent_and_prints_working_credentials() -> None:
    first = _run("seed_demo")
    counts = _counts()
    assert counts["companies"] == 1
    assert counts["agents"] == 3  # two workers and a provider
    assert counts["issues"] >= 5
    assert counts["workspaces"] == 4
    assert counts["runs"] >= 3
    assert counts["coordinators"] >= 1
    assert counts["active_keys"] == 3
    statuses = set(Issue.objects.values_list("status", flat=True))
    assert {"backlog", "in_progress", "done"} <= statuses
    for running in HeartbeatRun.objects.filter(status="running"):
        assert Issue.objects.get(execution_run=running).status == "in_progress"
    # The run whose controller "died" mid copy-back: its result waits, with a job deferred.
    held = HeartbeatRun.objects.get(native_issue__title="Publish the nightly export")
    assert held.native_phase == "result_accepted"
    assert raw_owner(held.runner_profile_json) is not None
    assert [job.args["run_id"] for job in pending_jobs(finalization_queueing_lock(held.pk))] == [
        str(held.pk)
    ]

    # A runtime lease whose issue was closed: the dashboard's stale-lease tile has one.
    stale = with_stale_reason(WorkspaceRuntimeLease.objects.all()).get()
    assert stale.stale_reason == "owner_issue_terminal"  # type: ignore[attr-defined]

    second = _run("seed_demo")
    assert _counts() == counts

    old_keys, new_keys = _printed_keys(first), _printed_keys(second)
    assert len(new_keys) == 3
    agent_ids = {_me(key)["agent_id"] for key in new_keys}
    assert agent_ids == {str(pk) for pk in Agent.objects.values_list("pk", flat=True)}
    for key in old_keys:  # superseded by the fresh ones
        assert bearer_client(key).get("/api/me").status_code == 401

    client = APIClient()
    assert client.login(username="demo-board", password=_printed_password(second))
    assert client.get("/admin/").status_code == 200
