"""Admin: the environment-lease pages (registered by leases/admin.py, read-only, company
scoped), the environment pages (audited, never deleted) and the recovery-action page's
inspection panel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.test import Client

from paperclip.models import ActivityEvent, BoardMembership, Company, Environment
from tests.leases.environment.factories import (
    EnvironmentLeaseFactory,
    build_scenario,
    export_marker,
    set_meta,
)
from tests.paperclip.factories import CompanyFactory, EnvironmentFactory, UserFactory
from tests.support.processes import child_env

ROOT = Path(__file__).resolve().parents[3]
LEASES = "/admin/leases/environmentlease/"
ENVIRONMENTS = "/admin/paperclip/environment/"


def test_admin_autodiscovery_registers_the_environment_admins() -> None:
    """No test imports leases.environment.admin by hand: a fresh process must find both admins
    through `leases/admin.py` alone."""
    probe = (
        "import django; django.setup();"
        "from django.contrib import admin;"
        "from leases.models import EnvironmentLease;"
        "from paperclip.models import Environment;"
        "print(type(admin.site._registry[EnvironmentLease]).__name__,"
        " type(admin.site._registry[Environment]).__name__)"
    )
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["EnvironmentLeaseAdmin", "EnvironmentAdmin"]


@pytest.mark.django_db
def test_environment_lease_admin_is_read_only(company: Company, superuser_client: Client) -> None:
    lease = EnvironmentLeaseFactory(company=company, status="pending_cleanup")
    set_meta(lease, nativeWorkspaceExportResume=export_marker(lease, leaseId="elsewhere"))
    client = superuser_client
    listing = client.get(LEASES)
    assert listing.status_code == 200
    assert lease.provider_lease_id.encode() in listing.content
    detail = client.get(f"{LEASES}{lease.pk}/change/")
    assert detail.status_code == 200
    # Which check failed, in words (the reader and the explanation share their checks).
    # Which check failed first, in words (the factory's lease has no run).
    assert b"INVALID: the lease has no run (never cleaned up automatically)" in detail.content
    assert b'name="_save"' not in detail.content  # no change form to submit
    assert client.get(f"{LEASES}add/").status_code == 403
    assert client.get(f"{LEASES}{lease.pk}/delete/").status_code == 403
    assert client.get(ENVIRONMENTS).status_code == 200
    assert client.get(f"{ENVIRONMENTS}{lease.environment_id}/change/").status_code == 200
    assert client.get(f"{ENVIRONMENTS}{lease.environment_id}/delete/").status_code == 403


@pytest.mark.django_db
def test_staff_member_sees_only_their_companies_leases_and_environments(
    company: Company, other_company: Company
) -> None:
    mine = EnvironmentLeaseFactory(company=company, provider_lease_id="sbx-mine")
    theirs = EnvironmentLeaseFactory(company=other_company, provider_lease_id="sbx-theirs")
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=company)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_environmentlease", "view_environment"])
    )
    client = Client()
    client.force_login(user)
    listing = client.get(LEASES)
    assert listing.status_code == 200
    assert listing.context["cl"].result_count == 1
    assert b"sbx-mine" in listing.content
    assert b"sbx-theirs" not in listing.content
    assert client.get(f"{LEASES}{mine.pk}/change/").status_code == 200
    # Another company's lease is "not found" (the admin redirects to its index).
    assert client.get(f"{LEASES}{theirs.pk}/change/").status_code == 302
    environments = client.get(ENVIRONMENTS)
    assert environments.context["cl"].result_count == 1
    assert client.get(f"{ENVIRONMENTS}{theirs.environment_id}/change/").status_code == 302


@pytest.mark.django_db
def test_environment_admin_saves_write_an_audit_row(
    company: Company, superuser_client: Client
) -> None:
    client = superuser_client
    response = client.post(
        f"{ENVIRONMENTS}add/",
        {
            "company": str(company.pk),
            "name": "sandbox-eu",
            "driver": "sandbox",
            "status": "active",
            "config": "{}",
            "metadata": "null",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    environment = Environment.objects.get(name="sandbox-eu")
    audit = ActivityEvent.objects.get(action="environment.created")
    assert (audit.entity_id, audit.company_id) == (str(environment.pk), company.pk)


@pytest.mark.django_db
def test_recovery_action_admin_page_shows_the_inspection_panel(superuser_client: Client) -> None:
    s = build_scenario()
    client = superuser_client
    page = f"/admin/recovery/issuerecoveryaction/{s.action.pk}/change/"
    response = client.get(page)
    assert response.status_code == 200
    body = response.content.decode()
    assert "Recovery source inspection" in body
    assert "every check passed" in body
    assert str(s.lease.pk) in body
    s.lease.lease_policy = "mystery"
    s.lease.save()
    body = client.get(page).content.decode()
    for text in ("source_binding_invalid", "lease_policy_not_retained", "service_required"):
        assert text in body
    assert "every check passed" not in body


@pytest.mark.django_db
def test_environment_without_company_is_superuser_only(
    company: Company, superuser_client: Client
) -> None:
    shared = EnvironmentFactory(company=None, name="instance-wide")
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=CompanyFactory())
    user.user_permissions.add(Permission.objects.get(codename="view_environment"))
    client = Client()
    client.force_login(user)
    assert b"instance-wide" not in client.get(ENVIRONMENTS).content
    assert b"instance-wide" in superuser_client.get(ENVIRONMENTS).content
    assert shared.pk
