"""Admin pages of the core models, the key-revocation action, health check and API schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from django.contrib import admin
from django.test import Client
from django.urls import reverse

from paperclip.credentials import agent_key_create
from paperclip.models import (
    ActivityEvent,
    AgentApiKey,
    BoardMembership,
    Company,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
    WorkspaceOperation,
)
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
    UserFactory,
)

pytestmark = pytest.mark.django_db

CORE_MODELS = [m for m in admin.site._registry if m._meta.app_label == "paperclip"]


@pytest.fixture
def populated() -> None:
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    agent_key_create(agent_id=agent.pk)
    ws = ExecutionWorkspaceFactory(company=company)
    IssueFactory(company=company, assignee_agent=agent, execution_workspace=ws)
    result = NativeRunResultFactory(run__company=company, run__agent=agent)
    NativeRunFinalizationFactory(run=result.run, result=result, phase="result_accepted")
    WorkspaceOperation.objects.create(company=company, execution_workspace=ws, phase="x")


def test_every_core_model_is_registered() -> None:
    expected = {
        Company,
        BoardMembership,
        AgentApiKey,
        Issue,
        ExecutionWorkspace,
        HeartbeatRun,
        NativeRunFinalization,
        NativeRunResult,
        WorkspaceOperation,
        ActivityEvent,
    }
    assert expected <= set(CORE_MODELS)


@pytest.mark.parametrize("model", CORE_MODELS, ids=lambda m: m.__name__)
def test_changelist_and_search_pages_render(
    superuser_client: Client, populated: None, model
) -> None:
    url = reverse(f"admin:paperclip_{model._meta.model_name}_changelist")
    assert superuser_client.get(url).status_code == 200
    assert superuser_client.get(url, {"q": "not-a-uuid"}).status_code == 200
    obj = model.objects.first()
    if obj is not None:
        change = reverse(f"admin:paperclip_{model._meta.model_name}_change", args=[obj.pk])
        assert superuser_client.get(change).status_code == 200


@pytest.mark.parametrize(
    "model",
    [
        HeartbeatRun,
        NativeRunFinalization,
        NativeRunResult,
        WorkspaceOperation,
        ActivityEvent,
        AgentApiKey,
    ],
)
def test_service_owned_records_are_read_only(model) -> None:
    model_admin = admin.site._registry[model]
    request = type("R", (), {"user": UserFactory(is_superuser=True)})()
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)
    assert not model_admin.has_delete_permission(request)


def test_revoke_action_revokes_keys_and_audits(superuser_client: Client) -> None:
    agent = AgentFactory()
    issued = [agent_key_create(agent_id=agent.pk) for _ in range(2)]
    url = reverse("admin:paperclip_agentapikey_changelist")
    response = superuser_client.post(
        url,
        {"action": "revoke_selected", "_selected_action": [str(i.id) for i in issued]},
        follow=True,
    )
    assert response.status_code == 200
    assert AgentApiKey.objects.filter(revoked_at__isnull=True).count() == 0
    assert ActivityEvent.objects.filter(action="agent_key.revoked").count() == 2


def test_admin_add_issue_writes_audit_and_checks_company(superuser_client: Client) -> None:
    company, other = CompanyFactory(), CompanyFactory()
    foreign_agent = AgentFactory(company=other)
    url = reverse("admin:paperclip_issue_add")
    bad = superuser_client.post(
        url,
        {"company": company.pk, "title": "t", "status": "todo", "assignee_agent": foreign_agent.pk},
    )
    assert bad.status_code == 200  # form redisplayed with an error
    assert not Issue.objects.exists()
    good = superuser_client.post(url, {"company": company.pk, "title": "t", "status": "todo"})
    assert good.status_code == 302
    issue = Issue.objects.get()
    assert ActivityEvent.objects.filter(action="issue.created", entity_id=str(issue.pk)).exists()


WORKSPACE_FORM = {
    "name": "w",
    "status": "active",
    "mode": "shared_workspace",
    "strategy_type": "local_directory",
    "provider_type": "local_fs",
    "metadata": "null",
}


def _member_client(company: Company) -> Client:
    """A staff board member of `company` alone, with every model permission."""
    from django.contrib.auth.models import Permission

    user = UserFactory()
    user.user_permissions.set(Permission.objects.all())
    BoardMembership.objects.create(user=user, company=company)
    client = Client()
    client.force_login(user)
    return client


def test_admin_refuses_a_board_member_another_companys_cwd(tmp_path: Path) -> None:
    """As the API does: the add form and the change form of a workspace refuse, for anyone
    but a superuser, a cwd that is, holds or lies inside another company's workspace cwd."""
    company = CompanyFactory()
    theirs = tmp_path / "workspaces" / "b"
    ExecutionWorkspaceFactory(cwd=str(theirs))
    client = _member_client(company)
    before = ActivityEvent.objects.count()
    fields = {"company": company.pk, **WORKSPACE_FORM}
    added = client.post(
        reverse("admin:paperclip_executionworkspace_add"), {**fields, "cwd": str(theirs)}
    )
    assert added.status_code == 200  # form redisplayed with the error
    assert "another company" in added.context["adminform"].form.errors["cwd"][0]
    assert not ExecutionWorkspace.objects.filter(company=company).exists()
    mine = ExecutionWorkspaceFactory(company=company, cwd=str(tmp_path / "workspaces" / "a"))
    changed = client.post(
        reverse("admin:paperclip_executionworkspace_change", args=[mine.pk]),
        {**fields, "cwd": str(tmp_path / "workspaces")},
    )
    assert changed.status_code == 200
    assert "cwd" in changed.context["adminform"].form.errors
    mine.refresh_from_db()
    assert mine.cwd == str(tmp_path / "workspaces" / "a")
    assert ActivityEvent.objects.count() == before


def test_admin_lets_a_superuser_give_any_cwd(superuser_client: Client, tmp_path: Path) -> None:
    company = CompanyFactory()
    ExecutionWorkspaceFactory(cwd=str(tmp_path / "workspaces" / "b"))
    response = superuser_client.post(
        reverse("admin:paperclip_executionworkspace_add"),
        {"company": company.pk, **WORKSPACE_FORM, "cwd": str(tmp_path / "workspaces")},
    )
    assert response.status_code == 302
    assert ExecutionWorkspace.objects.filter(company=company).exists()


def test_staff_member_sees_only_their_companies() -> None:
    mine, _theirs = CompanyFactory(name="Mine"), CompanyFactory(name="Theirs")
    user = UserFactory()
    from django.contrib.auth.models import Permission

    user.user_permissions.add(Permission.objects.get(codename="view_company"))
    BoardMembership.objects.create(user=user, company=mine)
    client = Client()
    client.force_login(user)
    body = client.get(reverse("admin:paperclip_company_changelist")).content.decode()
    assert "Mine" in body
    assert "Theirs" not in body


def test_healthz(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json()["database"] == "ok"


def test_schema_documents_every_core_endpoint(client: Client) -> None:
    response = client.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    import json

    schema = json.loads(response.content)
    paths = schema["paths"]
    expected = {
        "/api/me": {"get"},
        "/api/companies": {"post"},
        "/api/companies/{company_id}/agents": {"post"},
        "/api/agents/{agent_id}/keys": {"post"},
        "/api/agent-keys/{key_id}/revoke": {"post"},
        "/api/companies/{company_id}/issues": {"post"},
        "/api/issues/{issue_id}": {"get", "patch"},
        "/api/companies/{company_id}/execution-workspaces": {"post"},
        "/api/execution-workspaces/{workspace_id}": {"get"},
        "/api/heartbeat-runs": {"post"},
        "/api/heartbeat-runs/{run_id}": {"get", "patch"},
    }
    for path, methods in expected.items():
        assert methods <= set(paths[path]), path
    run = schema["components"]["schemas"]["RunOutput"]["properties"]
    assert {"finalization_owner", "native_phase", "execution_workspace_id"} <= set(run)
    patch = paths["/api/heartbeat-runs/{run_id}"]["patch"]
    assert {"200", "400", "404", "409", "422"} <= set(patch["responses"])
    assert {"agentKey", "boardToken"} <= set(schema["components"]["securitySchemes"])


def test_swagger_ui(client: Client) -> None:
    assert client.get("/api/docs/").status_code == 200
