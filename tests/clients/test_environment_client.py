"""The client's environment-lease methods (provider agents): acquire, heartbeat, get, release,
then the cleanup claim and receipt, with the conflict classes of each step."""

from __future__ import annotations

import pytest

from paperclip.models import Agent
from paperclip_client import Client, errors
from tests.clients.conftest import World
from tests.paperclip.factories import EnvironmentFactory, NativeRunFactory

pytestmark = pytest.mark.django_db


def test_a_provider_drives_a_lease_from_acquire_to_cleanup(client: Client, world: World) -> None:
    Agent.objects.filter(pk=world.agent.pk).update(role=Agent.Role.PROVIDER)
    company = world.agent.company
    environment = EnvironmentFactory(company=company)
    run = NativeRunFactory(company=company, agent=world.agent, status="running")
    args = {
        "environment_id": str(environment.pk),
        "heartbeat_run_id": str(run.pk),
        "execution_workspace_id": str(world.workspace.pk),
        "lease_policy": "ephemeral",
        "provider": "daytona",
        "provider_lease_id": "sbx-client",
        "remote_cwd": "/workspace",
    }
    lease = client.environment_lease_acquire(**args)
    assert (lease.status, lease.lease_policy, lease.heartbeat_run_id) == (
        "active",
        "ephemeral",
        str(run.pk),
    )
    assert client.environment_lease_acquire(**args).id == lease.id  # a retry is the same lease
    with pytest.raises(errors.EnvironmentLeaseSingleFlight) as held:
        client.environment_lease_acquire(**{**args, "provider_lease_id": "sbx-other"})
    assert held.value.details["lease_id"] == lease.id
    assert client.environment_lease_heartbeat(lease.id).status == "active"
    assert client.environment_lease_get(lease.id).id == lease.id

    released = client.environment_lease_release(lease.id, outcome="succeeded")
    assert (released.status, released.cleanup_status) == ("pending_cleanup", "pending")
    assert client.environment_lease_release(lease.id, outcome="succeeded").id == lease.id
    with pytest.raises(errors.EnvironmentLeaseNotActive):
        client.environment_lease_release(lease.id, outcome="failed")
    with pytest.raises(errors.EnvironmentLeaseNotActive):
        client.environment_lease_heartbeat(lease.id)

    claim = client.cleanup_claim(lease.id)
    assert claim.stop_only is False
    settled = client.cleanup_receipt(
        lease.id, attempt_id=claim.attempt_id, provider_lease_id="sbx-client", state="destroyed"
    )
    assert (settled.status, settled.cleanup_status) == ("released", "success")


def test_a_worker_agent_is_refused(client: Client, world: World) -> None:
    environment = EnvironmentFactory(company=world.agent.company)
    run = NativeRunFactory(company=world.agent.company, status="running")
    with pytest.raises(errors.PermissionDenied):
        client.environment_lease_acquire(
            environment_id=str(environment.pk),
            heartbeat_run_id=str(run.pk),
            lease_policy="ephemeral",
            provider="daytona",
            provider_lease_id="sbx-1",
        )
