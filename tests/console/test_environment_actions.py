"""Environment leases' operator actions "Retry cleanup now…" and "Force release…": a
confirmation page, a required reason, then `environment_lease_cleanup_retry_now` (or
`environment_lease_force_release`) once a lease; the message says what was done, what was
refused and why, and where the outcome will show."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from paperclip.models import ActivityEvent, Company
from tests.console.test_pages import staff
from tests.leases.environment.factories import EnvironmentLeaseFactory, backing_off
from tests.paperclip.factories import NativeRunFactory

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

LEASES = reverse("admin:leases_environmentlease_changelist")


def test_retry_cleanup_now_from_the_lease_page(company: Company) -> None:
    lease = backing_off(company)
    active = EnvironmentLeaseFactory(company=company, status="active")
    client = staff(company)
    page = client.get(reverse("admin:leases_environmentlease_change", args=[lease.pk]))
    assert 'data-console-action="retry_cleanup_now"' in page.content.decode()
    no_button = client.get(reverse("admin:leases_environmentlease_change", args=[active.pk]))
    assert "retry_cleanup_now" not in no_button.content.decode().split("object-tools")[1][:2000]

    selected = {"action": "retry_cleanup_now", "_selected_action": [str(lease.pk), str(active.pk)]}
    confirm = client.post(LEASES, selected).content.decode()
    assert f'data-lease="{lease.pk}"' in confirm
    assert "UTC" in confirm  # the next retry's time
    blank = client.post(LEASES, {**selected, "apply": "1", "reason": ""}).content.decode()
    assert "This field is required" in blank
    done = client.post(
        LEASES, {**selected, "apply": "1", "reason": "provider outage over"}, follow=True
    ).content.decode()
    assert "Cleanup reopened for 1 lease(s)" in done
    assert "the outcome will show in each lease&#x27;s cleanup status on its page" in done
    assert f"lease {active.pk}: cleanup_not_pending (The environment lease has no pending" in done
    lease.refresh_from_db()
    assert lease.cleanup_status == "pending"
    # Reopened, it waits for a provider's claim: no button that could change nothing.
    after = client.get(reverse("admin:leases_environmentlease_change", args=[lease.pk]))
    assert 'data-console-action="retry_cleanup_now"' not in after.content.decode()


def test_the_retry_confirmation_reads_a_fixed_number_of_queries(
    company: Company, django_assert_max_num_queries: Any
) -> None:
    client: Client = staff(company)
    first = backing_off(company)
    with CaptureQueriesContext(connection) as few:
        client.post(LEASES, {"action": "retry_cleanup_now", "_selected_action": [str(first.pk)]})
    more = [str(backing_off(company).pk) for _ in range(5)]
    with django_assert_max_num_queries(len(few)):
        response = client.post(
            LEASES, {"action": "retry_cleanup_now", "_selected_action": [str(first.pk), *more]}
        )
    assert response.status_code == 200


def test_force_release_from_the_lease_page(company: Company) -> None:
    lease = EnvironmentLeaseFactory(company=company, lease_policy="retain_on_failure")
    gone = EnvironmentLeaseFactory(company=company, status="released")
    client = staff(company)
    page = client.get(reverse("admin:leases_environmentlease_change", args=[lease.pk]))
    assert 'data-console-action="force_release"' in page.content.decode()
    no_button = client.get(reverse("admin:leases_environmentlease_change", args=[gone.pk]))
    assert 'data-console-action="force_release"' not in no_button.content.decode()

    selected = {"action": "force_release", "_selected_action": [str(lease.pk), str(gone.pk)]}
    confirm = client.post(LEASES, selected).content.decode()
    assert f'data-lease="{lease.pk}"' in confirm
    assert "retain_on_failure" in confirm
    blank = client.post(LEASES, {**selected, "apply": "1", "reason": ""}).content.decode()
    assert "This field is required" in blank
    lease.refresh_from_db()
    assert lease.status == "active"
    done = client.post(
        LEASES, {**selected, "apply": "1", "reason": "provider agent is gone"}, follow=True
    ).content.decode()
    assert "Force-released 1 lease(s) as failed" in done
    assert "(now: 1 retained)" in done
    assert "Already not active, nothing written: 1." in done
    lease.refresh_from_db()
    assert lease.status == "retained"
    (event,) = ActivityEvent.objects.filter(action="environment_lease.force_released")
    assert event.details["reason"] == "provider agent is gone"
    after = client.get(reverse("admin:leases_environmentlease_change", args=[lease.pk]))
    assert 'data-console-action="force_release"' not in after.content.decode()


def test_the_force_release_confirmation_reads_a_fixed_number_of_queries(
    company: Company, django_assert_max_num_queries: Any
) -> None:
    client: Client = staff(company)
    first = EnvironmentLeaseFactory(
        company=company, heartbeat_run=NativeRunFactory(company=company)
    )
    with CaptureQueriesContext(connection) as few:
        client.post(LEASES, {"action": "force_release", "_selected_action": [str(first.pk)]})
    more = [
        str(
            EnvironmentLeaseFactory(
                company=company, heartbeat_run=NativeRunFactory(company=company)
            ).pk
        )
        for _ in range(5)
    ]
    with django_assert_max_num_queries(len(few)):
        response = client.post(
            LEASES, {"action": "force_release", "_selected_action": [str(first.pk), *more]}
        )
    assert response.status_code == 200
