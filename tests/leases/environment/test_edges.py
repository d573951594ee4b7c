"""Environment leases at their edges (an adversarial review's findings): claimed cleanups do
not starve the retry sweep, a staff member cannot make an instance-wide environment, and
another company's busy slot looks like a missing environment."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from paperclip.models import Company, Environment
from tests.helpers import assert_error
from tests.leases.environment.test_lifecycle_api import ACQUIRE, acquire_body
from tests.paperclip.factories import NativeRunFactory

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def test_staff_cannot_create_an_instance_wide_environment(company: Company) -> None:
    from django.contrib.auth.models import Permission
    from django.test import Client

    from paperclip.models import ActivityEvent, BoardMembership
    from tests.paperclip.factories import UserFactory

    user = UserFactory(is_staff=True)
    BoardMembership.objects.create(user=user, company=company)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_environment", "add_environment"])
    )
    client = Client()
    client.force_login(user)
    response = client.post(
        "/admin/paperclip/environment/add/",
        {
            "company": "",
            "name": "sneaky-instance-wide",
            "driver": "sandbox",
            "status": "active",
            "config": "{}",
            "metadata": "null",
        },
    )
    assert not Environment.objects.filter(name="sneaky-instance-wide").exists(), (
        response.status_code,
        list(Environment.objects.filter(name="sneaky-instance-wide").values("company_id")),
        list(ActivityEvent.objects.filter(action="environment.created").values("company_id")),
    )


@pytest.mark.django_db(transaction=True)
def test_another_companys_busy_environment_slot_looks_missing_not_busy(
    make_agent_client: Any,
) -> None:
    from leases.environment.locks import environment_slot_key
    from tests.helpers import raw_connection
    from tests.leases.environment.factories import ProviderAgentFactory
    from tests.paperclip.factories import CompanyFactory, EnvironmentFactory

    theirs = CompanyFactory()
    their_env = EnvironmentFactory(company=theirs)
    mine = CompanyFactory()
    stranger = make_agent_client(ProviderAgentFactory(company=mine))
    my_run = NativeRunFactory(company=mine, status="running")
    # Company `theirs` is in the middle of an acquire on its environment (holds the slot).
    holder = raw_connection(autocommit=False)
    try:
        holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            [environment_slot_key(their_env.pk, None)],
        )
        probe = stranger.post(ACQUIRE, acquire_body(their_env, my_run), format="json")
        missing = stranger.post(
            ACQUIRE,
            {**acquire_body(their_env, my_run), "environment_id": str(uuid.uuid4())},
            format="json",
        )
    finally:
        holder.rollback()
        holder.close()
    assert_error(missing, 404, "not_found")
    assert_error(probe, 404, "not_found")  # not 409 resource_busy: that reveals the slot


def test_claimed_failed_cleanups_do_not_starve_the_retry_sweep(company: Company) -> None:
    import time

    from leases.environment.services import environment_cleanups_retry_due
    from tests.leases.environment.factories import EnvironmentLeaseFactory, set_meta

    now_ms = int(time.time() * 1000)
    # A failed cleanup whose back-off is over and that a provider claimed before the sweep
    # came round (the claim leaves cleanup_status failed and the past retry time).
    claimed = EnvironmentLeaseFactory(
        id=uuid.UUID(int=1), company=company, status="pending_cleanup", cleanup_status="failed"
    )
    set_meta(
        claimed,
        pendingCleanupRetryAttempts=1,
        pendingCleanupRetryAfterMs=now_ms - 60_000,
        pendingCleanupInFlight=True,
        pendingCleanupLeaseExpiresAtMs=now_ms + 600_000,
    )
    due = EnvironmentLeaseFactory(
        id=uuid.UUID(int=2), company=company, status="pending_cleanup", cleanup_status="failed"
    )
    set_meta(
        due,
        pendingCleanupRetryAttempts=1,
        pendingCleanupRetryAfterMs=now_ms - 60_000,
        pendingCleanupInFlight=False,
    )
    # One batch (the task's 200, scaled down to 1): the due lease must be reached.
    sweep = environment_cleanups_retry_due(batch_size=1)
    assert sweep.reopened == [due.pk], sweep


def test_a_due_cleanup_whose_metadata_names_no_claim_at_all_is_reopened(company: Company) -> None:
    """The claim filter is in SQL: a lease with neither the in-flight flag nor a claim expiry
    (a null comparison there would hide it) is reopened as before."""
    import time

    from leases.environment.services import environment_cleanups_retry_due
    from tests.leases.environment.factories import EnvironmentLeaseFactory, set_meta

    now_ms = int(time.time() * 1000)
    due = EnvironmentLeaseFactory(
        company=company, status="pending_cleanup", cleanup_status="failed"
    )
    set_meta(due, pendingCleanupRetryAttempts=1, pendingCleanupRetryAfterMs=now_ms - 60_000)
    claimed = EnvironmentLeaseFactory(
        company=company, status="pending_cleanup", cleanup_status="failed"
    )
    # in flight, its expiry unreadable: counts as expired, so reopened
    set_meta(
        claimed,
        pendingCleanupRetryAttempts=1,
        pendingCleanupRetryAfterMs=now_ms - 60_000,
        pendingCleanupInFlight=True,
    )
    assert sorted(environment_cleanups_retry_due().reopened) == sorted([due.pk, claimed.pk])
