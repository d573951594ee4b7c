"""Reads of environment leases: one lease for a provider of its company or a board member,
and a company's leases for the board. Reads write nothing."""

from __future__ import annotations

from uuid import UUID

from django.db.models import QuerySet

from leases.environment.errors import EnvironmentLeaseNotFound
from leases.models import EnvironmentLease
from paperclip.access import Actor, scoped_company
from paperclip.ids import parse_uuid

LIST_LIMIT = 500


def environment_lease_get(*, actor: Actor, lease_id: UUID | str) -> EnvironmentLease:
    """The lease if the actor may see its company; EnvironmentLeaseNotFound otherwise (another
    company's lease and a missing one look alike)."""
    pk = parse_uuid(lease_id)
    lease = EnvironmentLease.objects.filter(pk=pk).first() if pk is not None else None
    if lease is None or not actor.can_access(lease.company_id):
        raise EnvironmentLeaseNotFound()
    return lease


def environment_lease_list(
    *,
    actor: Actor,
    company_id: UUID | str,
    status: str | None = None,
    heartbeat_run_id: UUID | None = None,
) -> QuerySet[EnvironmentLease]:
    """A company's environment leases, newest first (at most LIST_LIMIT), optionally of one
    status and one run. Raises NotFoundError for a company the actor cannot see."""
    company = scoped_company(actor, company_id)
    leases = EnvironmentLease.objects.filter(company_id=company.pk)
    if status is not None:
        leases = leases.filter(status=status)
    if heartbeat_run_id is not None:
        leases = leases.filter(heartbeat_run_id=heartbeat_run_id)
    return leases.order_by("-acquired_at", "-pk")[:LIST_LIMIT]
