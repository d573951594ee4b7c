"""seed_demo's environment leases: a provider agent with a working key, a demo environment and
one lease in each interesting state, the console tiles they light, a recovery source the
console can inspect, and a second run that adds nothing."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from leases.environment.export_resume.markers import export_resume_read, stop_only_cleanup_problem
from leases.models import EnvironmentLease
from paperclip.models import ActivityEvent, Agent, Environment
from recovery.console.attention import attention_summary
from recovery.models import IssueRecoveryAction
from recovery.services import recovery_source_inspect
from tests.paperclip.helpers import bearer_client

pytestmark = pytest.mark.django_db


def _seed() -> list[str]:
    out = io.StringIO()
    call_command("seed_demo", stdout=out)
    return out.getvalue().splitlines()


def test_seed_demo_shows_environment_leases_in_every_state() -> None:
    lines = _seed()
    provider = Agent.objects.get(name="demo-provider")
    assert provider.role == Agent.Role.PROVIDER
    (line,) = [line for line in lines if line.startswith("Agent demo-provider")]
    key = line.rsplit(" ", 1)[-1]
    leases = {
        lease.provider_lease_id: lease
        for lease in EnvironmentLease.objects.filter(company=provider.company)
    }
    states = {pid: (lease.status, lease.cleanup_status) for pid, lease in leases.items()}
    assert states == {
        "sbx-demo-active": ("active", None),
        "sbx-demo-pending": ("pending_cleanup", "pending"),
        "sbx-demo-claimed": ("pending_cleanup", "pending"),
        "sbx-demo-failed": ("pending_cleanup", "failed"),
        "sbx-demo-overdue": ("pending_cleanup", "pending"),
        "sbx-demo-retained": ("retained", None),
        "sbx-demo-bad-marker": ("pending_cleanup", "pending"),
        "sbx-demo-reused": ("released", None),
        "sbx-demo-cleaned": ("released", "success"),
        "sbx-demo-source": ("retained", None),
    }
    assert leases["sbx-demo-claimed"].metadata["pendingCleanupInFlight"] is True
    assert leases["sbx-demo-failed"].metadata["pendingCleanupRetryAttempts"] == 1
    assert export_resume_read(leases["sbx-demo-retained"]) is not None
    assert stop_only_cleanup_problem(leases["sbx-demo-bad-marker"]) is not None
    # The console lights the failed cleanup, the claim that ran out and the invalid marker.
    tiles = {
        tile.kind: tile.count
        for tile in attention_summary(company_ids=None, include_jobs=False).tiles
    }
    assert tiles["cleanup_failed"] == 1
    assert tiles["cleanup_claim_overdue"] == 1
    assert tiles["cleanup_marker_invalid"] == 1

    # The failed run's retained sandbox is a recovery source the console can inspect.
    action = IssueRecoveryAction.objects.get(cause="sandbox_run_failed")
    inspection = recovery_source_inspect(
        company_id=action.company_id,
        issue_id=action.source_issue_id,
        run_id=action.evidence["runId"],
        action_id=action.pk,
    )
    assert [source.lease.provider_lease_id for source in inspection.sources] == ["sbx-demo-source"]

    # The provider's printed key works on the provider endpoints.
    client = bearer_client(key)
    read = client.get(f"/api/environment-leases/{leases['sbx-demo-active'].pk}")
    assert read.status_code == 200
    assert any(line.strip().startswith("export PAPERCLIP_URL=") for line in lines)

    counts = (
        EnvironmentLease.objects.count(),
        Environment.objects.count(),
        Agent.objects.count(),
        ActivityEvent.objects.filter(entity_type="environment_lease").count(),
    )
    _seed()
    assert (
        EnvironmentLease.objects.count(),
        Environment.objects.count(),
        Agent.objects.count(),
        ActivityEvent.objects.filter(entity_type="environment_lease").count(),
    ) == counts
