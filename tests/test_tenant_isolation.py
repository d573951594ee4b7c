"""Tenant isolation over the whole API (docs/api.md#company-scoping): two companies with every
kind of object; every route that takes an id, called by company A's agent and by a board member
of A only, with company B's ids, answers exactly what it answers for an id that exists nowhere
(a 404, or the same refusal before any lookup) and changes nothing. The routes come from the URL
conf: a new route without a case here fails the test."""

from __future__ import annotations

import hashlib
import io
import json
import re
import uuid
from typing import Any

import pytest
from django.apps import apps
from django.urls import URLPattern, URLResolver, get_resolver

from leases.models import WorkspaceRuntimeLease
from paperclip.credentials import agent_key_create
from paperclip.snapshots.store.uploads import cas_put
from tests.leases.environment.factories import EnvironmentLeaseFactory, ProviderAgentFactory
from tests.leases.factories import claim
from tests.paperclip.factories import ExecutionWorkspaceFactory, IssueFactory
from tests.recovery.factories import RecoveryActionFactory, make_binding

pytestmark = pytest.mark.django_db

BLOB_RE = re.compile(r"sha256:[0-9a-f]{64}")
UUID_RE = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _routes(patterns: list[Any] | None = None, prefix: str = "") -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for entry in patterns if patterns is not None else get_resolver().url_patterns:
        if isinstance(entry, URLResolver):
            found |= _routes(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            view = getattr(entry.callback, "view_class", None)
            route = prefix + str(entry.pattern)
            if view is not None and route.startswith("api/") and "<" in route:
                found[route] = [m for m in ("get", "post", "put", "patch") if hasattr(view, m)]
    return found


def _world(prefix: str) -> dict[str, Any]:
    """One company's objects of every kind, keyed by the URL parameter that names them."""
    b = make_binding()
    workspace = b.run.execution_workspace
    claim(workspace, b.agent, issue_id=b.issue.pk)
    action = RecoveryActionFactory(source_issue=b.issue)
    lease = EnvironmentLeaseFactory(company=b.company, heartbeat_run=b.run, issue=b.issue)
    key = agent_key_create(agent_id=b.agent.pk)
    return {
        "binding": b,
        "provider": ProviderAgentFactory(company=b.company),
        "environment_id": lease.environment_id,
        "company_id": b.company.pk,
        "agent_id": b.agent.pk,
        "key_id": key.id,
        "issue_id": b.issue.pk,
        "workspace_id": workspace.pk,
        "run_id": b.run.pk,
        "action_id": action.pk,
        "lease_id": lease.pk,
        "spare_issue": IssueFactory(company=b.company).pk,
        "spare_workspace": ExecutionWorkspaceFactory(company=b.company).pk,
        "name": _stored_blob(b.company.pk, prefix),
    }


def _stored_blob(company_id: Any, prefix: str) -> str:
    data = f"{prefix}'s blob".encode()
    name = "sha256:" + hashlib.sha256(data).hexdigest()
    cas_put(company_id=company_id, digest=name, stream=io.BytesIO(data), length=len(data))
    return name


def _bodies(ids: dict[str, Any]) -> dict[str, Any]:
    """A well-formed body per write route (naming the same world's ids where a body takes
    some), so that a refusal comes from the lookup, not from validation."""
    run, issue = str(ids["run_id"]), str(ids["issue_id"])
    return {
        "api/companies/<uuid:company_id>/agents": {"name": "x"},
        "api/agents/<uuid:agent_id>/keys": {},
        "api/agent-keys/<uuid:key_id>/revoke": {},
        "api/companies/<uuid:company_id>/issues": {"title": "x"},
        "api/issues/<uuid:issue_id>": {"status": "todo"},
        "api/companies/<uuid:company_id>/execution-workspaces": {"name": "x"},
        "api/heartbeat-runs/<uuid:run_id>": {"status": "running"},
        "api/execution-workspaces/<uuid:workspace_id>/runtime-lease/claim": {"action": "start"},
        "api/execution-workspaces/<uuid:workspace_id>/runtime-lease/release": {},
        "api/execution-workspaces/<uuid:workspace_id>/operations": {
            "generation": 1,
            "phase": "build",
            "status": "running",
        },
        "api/companies/<uuid:company_id>/environments": {"name": "x", "driver": "sandbox"},
        "api/environment-leases/<uuid:lease_id>/heartbeat": {},
        "api/environment-leases/<uuid:lease_id>/release": {"outcome": "succeeded"},
        "api/environment-leases/<uuid:lease_id>/cleanup-claims": {},
        "api/environment-leases/<uuid:lease_id>/cleanup-receipts": {
            "attempt_id": str(uuid.uuid4()),
            "receipt": {"provider_lease_id": "p", "state": "stopped"},
        },
        "api/heartbeat-runs/<uuid:run_id>/results": {
            "result": {},
            "terminal": {"run_terminal_state": "succeeded"},
        },
        "api/heartbeat-runs/<uuid:run_id>/finalize": {},
        "api/issues/<uuid:issue_id>/recovery-actions/resume-workspace-finalization": {
            "action_id": str(ids["action_id"]),
            "run_id": run,
            "owner_token": "t",
            "controller_and_copyback_stopped": True,
            "stop_evidence": "the controller process was stopped by the platform",
        },
        "api/heartbeat-runs/<uuid:run_id>/controller-lease": {"boot_id": str(uuid.uuid4())},
        "api/heartbeat-runs/<uuid:run_id>/controller-lease/expire": {},
        "api/heartbeat-runs/<uuid:run_id>/checkpoint": {
            "owner": {"boot_id": "b", "lease_owner": "o", "generation": 1},
            "reset": False,
            "changed": {},
            "removed": [],
            "work_command_ids": [],
            "predecessor": None,
        },
        "api/heartbeat-runs/<uuid:run_id>/interrupt": {"reason": "its agent is gone"},
        "api/heartbeat-runs/<uuid:run_id>/snapshots": {
            "tree": "sha256:" + "0" * 64,
            "base": None,
            "generation": 1,
        },
        "api/issues/<uuid:issue_id>/recovery-actions/resolve-workspace-conflict": {
            "action_id": str(ids["action_id"]),
            "run_id": run,
            "resolution": "discard",
            "note": "the other run's change wins",
        },
        "api/issues/<uuid:issue_id>/recovery-actions/retry-workspace-export": {
            "action_id": str(ids["action_id"]),
            "run_id": run,
            "repair_note": "freed the disk of the worker's volume",
        },
        # A blob name of the other company, with bytes that are not its: refused alike.
        "api/cas/blobs/<str:name>": {},
        "_issue_for_body": issue,
    }


def _url(route: str, ids: dict[str, Any]) -> str:
    def fill(match: re.Match[str]) -> str:
        value = str(ids.get(match.group(2), uuid.uuid4()))
        if match.group(1) == "str" and not BLOB_RE.fullmatch(value):  # a blob name, anywhere
            value = "sha256:" + hashlib.sha256(value.encode()).hexdigest()
        return value

    return "/" + re.sub(r"<(uuid|str):(\w+)>", fill, route)


def _normalized(response: Any) -> tuple[int, Any]:
    text = BLOB_RE.sub("<blob>", UUID_RE.sub("<id>", response.content.decode()))
    return response.status_code, json.loads(text) if text else None


def _row_counts() -> dict[str, int]:
    return {
        model._meta.label: model.objects.count()
        for model in apps.get_models()
        if model._meta.managed
        and model._meta.app_label in ("paperclip", "leases", "recovery", "checkpoints")
    }


def test_another_companys_ids_look_like_ids_that_exist_nowhere(
    make_agent_client: Any, make_board_client: Any
) -> None:
    mine, theirs = _world("a"), _world("b")
    nowhere = {name: uuid.uuid4() for name in theirs}
    clients = {
        "agent": make_agent_client(mine["binding"].agent),
        "provider": make_agent_client(mine["provider"]),
        "board": make_board_client(mine["binding"].company),
    }
    routes = _routes()
    bodies = _bodies(theirs)
    missing = [r for r, methods in routes.items() if set(methods) - {"get"} and r not in bodies]
    assert missing == [], "routes with writes but no isolation case"
    before = _row_counts()
    checked = 0
    for route, methods in routes.items():
        for method in methods:
            for who, client in clients.items():
                body = bodies.get(route) if method != "get" else None
                send = getattr(client, method)
                foreign = send(_url(route, theirs), body, format="json")
                absent = send(_url(route, nowhere), body, format="json")
                where = (who, method.upper(), route, foreign.content[:300])
                assert foreign.status_code in (400, 403, 404), where
                assert _normalized(foreign) == _normalized(absent), where
                checked += 1
    assert checked > 60
    assert _row_counts() == before
    # B's lease is untouched by everything A tried.
    assert WorkspaceRuntimeLease.objects.filter(
        execution_workspace_id=theirs["workspace_id"]
    ).exists()


def test_another_companys_ids_inside_a_body_are_404(make_agent_client: Any) -> None:
    mine, theirs = _world("a"), _world("b")
    client = make_agent_client(mine["binding"].agent)
    before = _row_counts()
    workspace = mine["spare_workspace"]
    cases = [
        ("/api/heartbeat-runs", {"runtime_mode": "native", "issue_id": str(theirs["issue_id"])}),
        (
            "/api/heartbeat-runs",
            {
                "runtime_mode": "native",
                "issue_id": str(mine["spare_issue"]),
                "execution_workspace_id": str(theirs["workspace_id"]),
            },
        ),
        (
            f"/api/execution-workspaces/{workspace}/runtime-lease/claim",
            {"action": "start", "issue_id": str(theirs["issue_id"])},
        ),
        (
            f"/api/execution-workspaces/{workspace}/runtime-lease/claim",
            {"action": "start", "run_id": str(theirs["run_id"])},
        ),
    ]
    for url, body in cases:
        response = client.post(url, body, format="json")
        assert response.status_code == 404, (url, body, response.content)
    assert _row_counts() == before


def test_another_companys_ids_inside_an_environment_lease_acquire_are_404(
    make_agent_client: Any,
) -> None:
    mine, theirs = _world("a"), _world("b")
    client = make_agent_client(mine["provider"])
    before = _row_counts()

    def body(**ids: Any) -> dict[str, Any]:
        chosen = {
            "environment_id": mine["environment_id"],
            "heartbeat_run_id": mine["run_id"],
            "execution_workspace_id": mine["spare_workspace"],
        }
        chosen.update(ids)
        return {
            **{k: str(v) for k, v in chosen.items()},
            "lease_policy": "ephemeral",
            "provider": "daytona",
            "provider_lease_id": "sbx-x",
        }

    for world in (theirs, {name: uuid.uuid4() for name in theirs}):
        for ids in (
            {"environment_id": world["environment_id"]},
            {"heartbeat_run_id": world["run_id"]},
            {"execution_workspace_id": world["spare_workspace"]},
        ):
            response = client.post("/api/environment-leases", body(**ids), format="json")
            assert response.status_code == 404, (ids, response.content)
            assert response.json()["error"]["code"] == "not_found"
    assert _row_counts() == before
