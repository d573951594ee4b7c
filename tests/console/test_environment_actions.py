"""Environment leases' operator action "Retry cleanup now…": a confirmation page, a required
reason, then `environment_lease_cleanup_retry_now` once a lease; the message says what was
reopened, what was refused and why, and where the outcome will show."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from paperclip.models import Company
from tests.console.test_pages import staff
from tests.leases.environment.factories import EnvironmentLeaseFactory, backing_off

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
