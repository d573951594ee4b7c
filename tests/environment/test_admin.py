"""The read-only environment-lease admin renders, flags stop-only intents and forbids edits."""

from __future__ import annotations

import pytest
from django.test import Client

import leases.environment_admin  # noqa: F401 - registers the admin (leases/admin.py imports it)
from paperclip.models import Company
from tests.environment.factories import EnvironmentLeaseFactory, export_marker, set_meta
from tests.factories import UserFactory


@pytest.mark.django_db
def test_environment_lease_admin_is_read_only(company: Company) -> None:
    lease = EnvironmentLeaseFactory(company=company, status="pending_cleanup")
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease, leaseId="elsewhere"))
    client = Client()
    client.force_login(UserFactory(is_superuser=True))
    listing = client.get("/admin/leases/environmentlease/")
    assert listing.status_code == 200
    assert lease.provider_lease_id.encode() in listing.content
    detail = client.get(f"/admin/leases/environmentlease/{lease.pk}/change/")
    assert detail.status_code == 200
    assert b"INVALID: does not bind to this lease" in detail.content
    assert client.get("/admin/leases/environmentlease/add/").status_code == 403
    assert client.get("/admin/paperclip/environment/").status_code == 200
