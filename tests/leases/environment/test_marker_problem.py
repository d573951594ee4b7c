"""An invalid stop-only intent says which check failed; the explanation and the strict reader
share their checks, so "invalid" and "has a problem" can never disagree."""

from __future__ import annotations

from typing import Any

import pytest

from leases.environment.export_resume.markers import (
    export_resume_read,
    stop_only_cleanup_problem,
    stop_only_cleanup_read,
)
from tests.leases.environment.factories import EnvironmentLeaseFactory, export_marker, set_meta
from tests.paperclip.factories import AgentFactory, HeartbeatRunFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def lease(company):
    run = HeartbeatRunFactory(company=company, agent=AgentFactory(company=company))
    return EnvironmentLeaseFactory(company=company, status="pending_cleanup", heartbeat_run=run)


def retain_intent(lease: Any, **changes: Any) -> dict[str, Any]:
    intent = {
        "schema": "paperclip.sandbox-stop-and-retain.v1",
        "requestId": "req-1",
        "companyId": str(lease.company_id),
        "runId": str(lease.heartbeat_run_id),
        "leaseId": str(lease.pk),
        "provider": lease.provider,
        "providerLeaseId": lease.provider_lease_id,
        "pluginId": lease.metadata["pluginId"],
    }
    intent.update(changes)
    return intent


EXPORT_CASES = [
    ({}, None),
    ({"schema": "v0"}, "unknown schema 'v0'"),
    ({"companyId": "x"}, "companyId does not equal the lease's"),
    ({"runId": "x"}, "runId does not equal the lease's"),
    ({"leaseId": "x"}, "leaseId does not equal the lease's"),
    ({"provider": "x"}, "provider does not equal the lease's"),
    ({"providerLeaseId": "x"}, "providerLeaseId does not equal the lease's"),
    ({"requestId": ""}, "requestId is missing or empty"),
    ({"resultId": None}, "resultId is missing or empty"),
    ({"pluginId": ""}, "the plugin pin (pluginId) is missing or empty"),
    ({"pluginId": "other-plugin"}, "the plugin pin 'other-plugin' does not equal"),
]


@pytest.mark.parametrize(("changes", "expected"), EXPORT_CASES)
def test_export_resume_marker_problem(lease, changes, expected) -> None:
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease, **changes))
    problem = stop_only_cleanup_problem(lease)
    assert (export_resume_read(lease) is None) == (problem is not None)
    assert (stop_only_cleanup_read(lease) is None) == (problem is not None)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert problem.startswith("nativeWorkspaceExportResume: ")
        assert expected in problem


RETAIN_CASES = [
    ({}, None),
    ({"schema": "nope"}, "unknown schema"),
    ({"leaseId": "x"}, "leaseId does not equal"),
    ({"requestId": ""}, "requestId is missing or empty"),
    ({"pluginId": None}, "names no owner"),
    ({"pluginId": "other"}, "pluginId 'other' does not equal"),
    ({"builtinProvider": "daytona"}, "names both a built-in provider and a plugin"),
]


@pytest.mark.parametrize(("changes", "expected"), RETAIN_CASES)
def test_stop_and_retain_intent_problem(lease, changes, expected) -> None:
    set_meta(lease, sandboxStopAndRetain=retain_intent(lease, **changes))
    problem = stop_only_cleanup_problem(lease)
    assert (stop_only_cleanup_read(lease) is None) == (problem is not None)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None
        assert expected in problem


def test_no_intent_has_no_problem(lease) -> None:
    assert stop_only_cleanup_problem(lease) is None


def test_a_lease_without_a_run_fails_the_first_binding_check(company) -> None:
    bare = EnvironmentLeaseFactory(company=company, status="pending_cleanup")
    set_meta(bare, nativeWorkspaceExportResume=export_marker(bare))
    assert stop_only_cleanup_problem(bare) == "nativeWorkspaceExportResume: the lease has no run"
