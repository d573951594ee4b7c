"""The lease's JSON, rendered straight from its attributes on the hot path, and by PostgreSQL
from the row for the batch renew, is exactly what DRF's field-by-field rendering of
LeaseSerializer gives (and the controller lease's, its single endpoint's serializer's)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from uuid import uuid4

import pytest
from django.db import connection
from rest_framework import serializers

from checkpoints.api.views import ControllerLeaseAcquireApi
from checkpoints.services import controller_lease_acquire
from checkpoints.services.controller_lease import ControllerLease
from checkpoints.services.controller_lease_batch import (
    CONTROLLER_JSON_KEYS,
    ControllerRenewItem,
    controller_leases_renew,
)
from leases.api.views import LeaseSerializer
from leases.models import WorkspaceRuntimeLease
from leases.selectors import LEASE_JSON_KEYS, LEASE_TABLE, RuntimeLease, lease_json_sql
from paperclip.db.sql import iso_json_sql
from paperclip.models import NativeRunFinalization
from tests.checkpoints.factories import TEST_KEY
from tests.leases.factories import claim, running_run
from tests.paperclip.factories import AgentFactory, ExecutionWorkspaceFactory


def _lease(**changes: object) -> RuntimeLease:
    now = datetime(2026, 12, 1, 17, 5, 49, 994894, tzinfo=UTC)
    values: dict[str, object] = {
        "id": uuid4(),
        "company_id": uuid4(),
        "execution_workspace_id": uuid4(),
        "owner_key": "issue:x",
        "owner_issue_id": uuid4(),
        "owner_run_id": None,
        "owner_agent_id": uuid4(),
        "last_action": "start",
        "generation": 2**40,
        "claimed_at": now,
        "renewed_at": now.replace(microsecond=0),  # isoformat drops a zero fraction
        "expires_at": (now + timedelta(minutes=30)).astimezone(timezone(timedelta(hours=5))),
        "metadata": {"reclaimedFromOwnerKey": "run:y", "reclaimReason": "lease_expired"},
    }
    values.update(changes)
    return RuntimeLease(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "lease",
    [
        _lease(),
        _lease(owner_issue_id=None, owner_run_id=uuid4(), owner_agent_id=None, metadata=None),
        _lease(last_action="repair", generation=1, metadata={"nested": [1, None, "é"]}),
    ],
)
def test_the_fast_rendering_is_drfs(lease: RuntimeLease) -> None:
    serializer = LeaseSerializer()
    fast = serializer.to_representation(lease)
    generic = serializers.Serializer.to_representation(serializer, lease)
    assert fast == dict(generic)
    assert list(fast) == list(generic)  # same keys, same order
    assert fast["expires_at"].endswith("Z")


# --- the batch renew's rendering, by PostgreSQL from the row ------------------------------


def test_postgresqls_keys_are_the_serializers_in_its_order() -> None:
    """A field added to LeaseSerializer and not to LEASE_JSON_KEYS (or the other way) fails
    here: the batch renew would otherwise answer leases without it."""
    assert [key for key, _ in LEASE_JSON_KEYS] == list(LeaseSerializer().fields)
    assert [key for key, _ in CONTROLLER_JSON_KEYS] == list(
        ControllerLeaseAcquireApi.OutputSerializer().fields
    )


def _rendered_by_postgresql(lease_id: object) -> str:
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {lease_json_sql('l')} FROM {LEASE_TABLE} l WHERE l.id = %s",  # noqa: S608
            [lease_id],
        )
        row = cursor.fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.django_db
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"renewed_at": datetime(2026, 12, 1, 17, 5, 49, tzinfo=UTC)},  # a zero fraction
        {"expires_at": datetime(2026, 12, 1, 17, 5, 49, 10, tzinfo=UTC)},  # leading zeros
        {"metadata": {"nested": [1, None, "é", 2.5, {"k": True}]}, "generation": 2**40},
        {"owner_agent_id": None, "last_action": "repair"},
    ],
)
def test_postgresqls_rendering_is_the_serializers(changes: dict[str, object]) -> None:
    workspace = ExecutionWorkspaceFactory()
    granted = claim(workspace, AgentFactory(company=workspace.company))
    assert granted.lease is not None
    WorkspaceRuntimeLease.objects.filter(pk=granted.lease.id).update(**changes)
    row = WorkspaceRuntimeLease.objects.get(pk=granted.lease.id)
    expected = LeaseSerializer().to_representation(RuntimeLease.from_model(row))
    rendered = json.loads(_rendered_by_postgresql(row.pk))
    assert list(rendered.items()) == list(expected.items())  # same keys, order and values


@pytest.mark.django_db
@pytest.mark.parametrize(
    "moment",
    [
        datetime(2026, 12, 1, 17, 5, 49, tzinfo=UTC),
        datetime(2026, 12, 1, 17, 5, 49, 7, tzinfo=UTC),
        datetime(2026, 12, 1, 17, 5, 49, 999_999, tzinfo=UTC),
        datetime(2026, 12, 31, 23, 59, 59, 500_000, tzinfo=timezone(timedelta(hours=-5))),
        datetime(1999, 1, 2, 3, 4, 5, 600, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    ],
)
def test_postgresqls_datetimes_are_drfs(moment: datetime) -> None:
    with connection.cursor() as cursor:
        sql = iso_json_sql("m.moment")
        cursor.execute(f"SELECT {sql} FROM (SELECT %s::timestamptz AS moment) m", [moment])  # noqa: S608
        row = cursor.fetchone()
    assert row is not None
    assert row[0] == serializers.DateTimeField().to_representation(moment)


@pytest.mark.django_db
def test_postgresqls_controller_rendering_is_the_serializers(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]
    run, _ = running_run()
    granted = controller_lease_acquire(
        run_id=run.pk, agent_id=run.agent_id, boot_id="boot-a", ttl_seconds=60
    )
    rendered = controller_leases_renew(
        company_id=run.company_id,
        agent_id=run.agent_id,
        items=[
            ControllerRenewItem(run_id=run.pk, boot_id="boot-a", lease_owner=granted.lease_owner)
        ],
    )[0]
    assert isinstance(rendered, str), rendered
    row = NativeRunFinalization.objects.get(pk=run.pk)
    renewed = ControllerLease(
        lease_owner=granted.lease_owner,
        controller_boot_id="boot-a",
        generation=granted.generation,
        lease_expires_at=row.lease_expires_at,
        outcome="renewed",
    )
    expected = ControllerLeaseAcquireApi.OutputSerializer().to_representation(renewed)
    assert list(json.loads(rendered).items()) == list(expected.items())
