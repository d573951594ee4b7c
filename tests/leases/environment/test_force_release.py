"""The board's force release (leases.environment.lifecycle `environment_lease_force_release`):
an active lease is released with outcome `failed` through the provider's own release path, so
its policy and the export-resume marker rules decide where it goes; audited with the board's
reason; a lease no longer active writes nothing; another company's is not found."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from leases.environment.errors import EnvironmentLeaseNotFound
from leases.environment.lifecycle import (
    EnvironmentLeaseRelease,
    environment_lease_force_release,
    environment_lease_release,
)
from leases.models import EnvironmentLease
from paperclip.access import agent_actor
from paperclip.models import ActivityEvent, Company
from tests.leases.environment.factories import (
    EnvironmentLeaseFactory,
    ProviderAgentFactory,
    export_marker,
    set_meta,
    sync_reference,
)
from tests.paperclip.factories import CompanyFactory, NativeRunFactory, NativeRunResultFactory

pytestmark = pytest.mark.django_db


def _force(lease: EnvironmentLease, company_ids: Any = None) -> EnvironmentLeaseRelease:
    return environment_lease_force_release(
        company_ids=company_ids,
        lease_id=lease.pk,
        actor_type="user",
        actor_id="7",
        reason="provider crashed, run is over",
    )


def _outcome(lease: EnvironmentLease) -> tuple[Any, ...]:
    lease.refresh_from_db()
    metadata = lease.metadata
    return (
        lease.status,
        lease.cleanup_status,
        lease.failure_reason,
        metadata.get("releaseOutcome"),
        "nativeWorkspaceExportResume" in metadata,
        lease.released_at is not None,
    )


def _actions(lease: EnvironmentLease) -> list[str]:
    return list(
        ActivityEvent.objects.filter(entity_id=str(lease.pk))
        .order_by("created_at", "pk")
        .values_list("action", flat=True)
    )


def _pair(company: Company, **fields: Any) -> tuple[EnvironmentLease, EnvironmentLease]:
    return (
        EnvironmentLeaseFactory(company=company, **fields),
        EnvironmentLeaseFactory(company=company, **fields),
    )


@pytest.mark.parametrize(
    ("policy", "status"),
    [
        ("ephemeral", "pending_cleanup"),
        ("retain_on_failure", "retained"),
        ("reuse_by_environment", "released"),
        ("reuse_by_execution_workspace", "released"),
    ],
)
def test_a_forced_release_follows_the_policy_exactly_as_a_failed_provider_release(
    company: Company, policy: str, status: str
) -> None:
    forced, released = _pair(company, lease_policy=policy)
    answer = _force(forced)
    assert (answer.released, answer.rule) == (True, "policy")
    environment_lease_release(
        actor=agent_actor(ProviderAgentFactory(company=company)),
        lease_id=released.pk,
        outcome="failed",
    )
    assert _outcome(forced) == _outcome(released)
    assert _outcome(forced)[:2] == (status, "pending" if status == "pending_cleanup" else None)
    (event,) = ActivityEvent.objects.filter(action="environment_lease.force_released")
    assert (event.actor_type, event.actor_id) == ("user", "7")
    assert event.details["reason"] == "provider crashed, run is over"
    assert (event.details["outcome"], event.details["status"]) == ("failed", status)


@pytest.mark.parametrize("policy", ["reuse_by_environment", "retain_on_failure"])
def test_a_pending_export_marker_is_kept_and_the_allocation_only_ever_stopped(
    company: Company, policy: str
) -> None:
    run = NativeRunFactory(company=company, status="failed")
    forced, released = _pair(company, lease_policy=policy, heartbeat_run=run)
    for lease in (forced, released):
        set_meta(lease, nativeWorkspaceExportResume=export_marker(lease))
    assert _force(forced).rule == "export_resume_kept"
    environment_lease_release(
        actor=agent_actor(ProviderAgentFactory(company=company)),
        lease_id=released.pk,
        outcome="failed",
    )
    assert _outcome(forced) == _outcome(released)
    expected = "retained" if policy == "retain_on_failure" else "pending_cleanup"
    assert _outcome(forced)[0] == expected
    assert forced.failure_reason == "workspace_export_stop_pending"
    assert forced.metadata["nativeWorkspaceExportResume"]


def test_a_prepared_export_with_an_accepted_result_is_preserved_stop_only(
    company: Company,
) -> None:
    run = NativeRunFactory(company=company, status="failed")
    lease = EnvironmentLeaseFactory(
        company=company, heartbeat_run=run, lease_policy="reuse_by_environment"
    )
    result = NativeRunResultFactory(run=run)
    run.runner_profile_json = {"nativeWorkspaceSync": sync_reference(lease, uuid.uuid4())}
    run.save(update_fields=["runner_profile_json"])
    assert _force(lease).rule == "export_resume_preserved"
    lease.refresh_from_db()
    assert (lease.status, lease.failure_reason) == (
        "pending_cleanup",
        "workspace_export_stop_pending",
    )
    assert lease.metadata["nativeWorkspaceExportResume"]["resultId"] == str(result.pk)
    assert _actions(lease) == [
        "environment_lease.export_resume_preserved",
        "environment_lease.force_released",
    ]


def test_a_lease_no_longer_active_writes_nothing_and_another_companys_is_not_found(
    company: Company,
) -> None:
    lease = EnvironmentLeaseFactory(company=company)
    assert _force(lease).released
    before = _outcome(lease)
    again = _force(lease)
    assert (again.released, again.rule) == (False, None)
    assert _outcome(lease) == before
    assert _actions(lease) == ["environment_lease.force_released"]
    retained = EnvironmentLeaseFactory(company=company, status="retained")
    assert not _force(retained).released
    assert not _actions(retained)
    with pytest.raises(EnvironmentLeaseNotFound):
        _force(
            EnvironmentLeaseFactory(company=company), company_ids=frozenset({CompanyFactory().pk})
        )
