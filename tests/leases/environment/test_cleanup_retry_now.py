"""The board's "retry cleanup now" (leases.environment.services
`environment_lease_cleanup_retry_now`): a failed cleanup waiting out its back-off is reopened
at once for the provider's next claim, audited with its reason; a live claim, a lease not
pending cleanup or another company's is refused; a cleanup already pending writes nothing."""

from __future__ import annotations

from typing import Any

import pytest

from leases.environment.errors import CleanupInFlight, CleanupNotPending, EnvironmentLeaseNotFound
from leases.environment.services import (
    environment_lease_cleanup_claim,
    environment_lease_cleanup_retry_now,
)
from leases.models import EnvironmentLease
from paperclip.models import ActivityEvent, Company
from tests.leases.environment.factories import EnvironmentLeaseFactory, backing_off
from tests.paperclip.factories import CompanyFactory

pytestmark = pytest.mark.django_db


def _retry(lease: EnvironmentLease, company_ids: Any = None) -> Any:
    return environment_lease_cleanup_retry_now(
        company_ids=company_ids,
        lease_id=lease.pk,
        actor_type="user",
        actor_id="1",
        reason="provider outage over",
    )


def test_the_service_reopens_a_backing_off_cleanup_at_once_then_a_provider_claims_it(
    company: Company,
) -> None:
    lease = backing_off(company)
    answer = _retry(lease)
    assert answer.reopened
    lease.refresh_from_db()
    assert lease.cleanup_status == "pending"
    assert lease.metadata["pendingCleanupRetryAfterMs"] == 0
    assert lease.metadata["pendingCleanupRetryAttempts"] == 2
    (event,) = ActivityEvent.objects.filter(action="environment_lease.cleanup_retry_requested")
    assert event.details["reason"] == "provider outage over"
    claim = environment_lease_cleanup_claim(
        lease_id=lease.pk, company_id=company.pk, actor_type="agent", actor_id="provider"
    )
    assert claim.attempt_id
    # A live claim is the provider's to answer: refused; its receipt decides.
    with pytest.raises(CleanupInFlight):
        _retry(lease)


def test_the_service_refuses_what_it_cannot_retry_and_repeats_write_nothing(
    company: Company,
) -> None:
    active = EnvironmentLeaseFactory(company=company, status="active")
    with pytest.raises(CleanupNotPending):
        _retry(active)
    with pytest.raises(EnvironmentLeaseNotFound):
        _retry(backing_off(company), company_ids=frozenset({CompanyFactory().pk}))
    pending = EnvironmentLeaseFactory(
        company=company, status="pending_cleanup", cleanup_status="pending"
    )
    assert not _retry(pending).reopened
    assert not ActivityEvent.objects.filter(
        action="environment_lease.cleanup_retry_requested"
    ).exists()
