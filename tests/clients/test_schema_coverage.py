"""The client covers the API: every agent-facing operation of the OpenAPI schema has a method,
and every error code an agent operation documents has an exception class.

An operation is agent-facing unless it is listed in BOARD_ONLY below, so a new endpoint fails
this test until it gets a client method (or is listed here as board-only, on purpose).
"""

from __future__ import annotations

import re
from typing import Any

from drf_spectacular.generators import SchemaGenerator

from paperclip_client import ERRORS, Client, operations

BOARD_ONLY = {
    "company_create",
    "agent_create",
    "agent_key_create",
    "agent_key_revoke",
    "issue_create",
    "issue_update",
    "execution_workspace_create",
    "environment_create",
    "environment_lease_list",
    "recovery_source_inspect",
    "issues_recovery_actions_resume_workspace_finalization_create",
    "issues_recovery_actions_resolve_workspace_conflict_create",
    "workspace_conflict_preview",
    "issues_recovery_actions_retry_workspace_export_create",
    "platform_worker_stops_create",  # the worker platform, signed by HMAC
    "heartbeat_run_interrupt",
    "execution_workspace_files",
    "execution_workspace_restore",
}
CODE = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b|\b(?:conflict|not_found)\b")


def schema_operations() -> dict[str, dict[str, Any]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    found: dict[str, dict[str, Any]] = {}
    for item in schema["paths"].values():
        for method, op in item.items():
            if method in {"get", "post", "put", "patch", "delete"}:
                found[op["operationId"]] = op
    return found


def test_every_agent_operation_has_a_client_method() -> None:
    schema = schema_operations()
    agent_ops = set(schema) - BOARD_ONLY
    covered = operations()
    assert sorted(agent_ops - set(covered)) == []
    assert sorted(set(covered) - set(schema)) == []  # no method for a vanished operation
    assert sorted(BOARD_ONLY - set(schema)) == []  # the list stays current
    for name in covered.values():
        assert callable(getattr(Client, name))


def test_every_documented_error_code_of_an_agent_operation_has_a_class() -> None:
    schema = schema_operations()
    missing, seen = set(), set()
    for operation_id, op in schema.items():
        if operation_id in BOARD_ONLY:
            continue
        for status, response in op["responses"].items():
            if not status.startswith(("4", "5")):
                continue
            for code in CODE.findall(response.get("description", "").split("(")[0]):
                seen.add(code)
                if code not in ERRORS:
                    missing.add(f"{operation_id} {status} {code}")
    assert sorted(missing) == []
    assert {"workspace_runtime_lease_superseded", "finalization_failed"} <= seen
    for code, cls in ERRORS.items():
        assert cls.code == code
