"""Factories and helpers for the checkpoints tests."""

from __future__ import annotations

from uuid import UUID

from django.db import connection

from checkpoints.crypto import generate_key_text
from checkpoints.services import CheckpointOwner, ControllerLease, controller_lease_acquire
from paperclip.models import HeartbeatRun, NativeRunFinalization
from tests.paperclip.factories import NativeRunFinalizationFactory

TEST_KEY = generate_key_text()
OLD_KEY = generate_key_text()


def coordinator() -> NativeRunFinalization:
    """A native running run with its coordinator (phase observed), as the core API makes it."""
    return NativeRunFinalizationFactory()


def lease(run: HeartbeatRun, boot_id: str = "boot-a", ttl_seconds: int = 60) -> ControllerLease:
    return controller_lease_acquire(
        run_id=run.pk, agent_id=run.agent_id, boot_id=boot_id, ttl_seconds=ttl_seconds
    )


def owner_of(grant: ControllerLease, authority_run_id: UUID | None = None) -> CheckpointOwner:
    return CheckpointOwner(
        boot_id=grant.controller_boot_id,
        lease_owner=grant.lease_owner,
        generation=grant.generation,
        authority_run_id=authority_run_id,
    )


def expire_lease(run_id: UUID) -> None:
    """Move the coordinator's lease expiry into the past (database time)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE native_run_finalizations "
            "SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE run_id = %s",
            [run_id],
        )
