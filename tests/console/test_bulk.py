"""Bulk actions by filter (paperclip.admin.bulk): "<verb> all N matching…" on the runs, runtime
leases and environment leases lists carries the list's filter to a confirmation page (count,
preview, required reason); acting reads the filter again and runs the single-row service on
every matching row, one audit row per row acted on, none for a refused one, and the message
counts each outcome and names each refusal with its reason."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from leases.admin import FORCE_RELEASE_BULK
from leases.errors import RuntimeLeaseSuperseded
from leases.models import WorkspaceRuntimeLease
from paperclip.access import board_actor
from paperclip.admin import bulk
from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    Company,
    ExecutionWorkspace,
    HeartbeatRun,
)
from tests.console.helpers import stale_lease
from tests.console.test_pages import staff
from tests.leases.environment.factories import EnvironmentLeaseFactory, backing_off
from tests.leases.factories import claim
from tests.paperclip.factories import (
    AgentFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    UserFactory,
)

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

RUNS = reverse("admin:paperclip_heartbeatrun_changelist")
RUNS_BULK = reverse("admin:paperclip_heartbeatrun_bulk", args=["interrupt"])
ENV_BULK = reverse("admin:leases_environmentlease_bulk", args=["retry-cleanup"])
LEASES_BULK = reverse("admin:leases_workspaceruntimelease_bulk", args=["force-release"])
_NAMES = itertools.count()


def _messages(html: str) -> str:
    found = re.search(r'<ul class="messagelist">(.*?)</ul>', html, re.S)
    assert found is not None, "no message on the page"
    return found.group(1)


def _runs(company: Company, count: int) -> list[HeartbeatRun]:
    agent = AgentFactory(company=company)
    return [HeartbeatRunFactory(company=company, agent=agent) for _ in range(count)]


def test_interrupt_all_200_matching_runs_with_one_refused(
    company: Company, other_company: Company
) -> None:
    live = _runs(company, 199)
    ended = HeartbeatRunFactory(
        company=company, agent=live[0].agent, status=HeartbeatRun.Status.SUCCEEDED
    )
    elsewhere = _runs(other_company, 3)  # outside the filter: untouched
    client = staff(company, other_company)
    query = f"company__id__exact={company.pk}"

    listing = client.get(f"{RUNS}?{query}").content.decode()
    assert f'href="{RUNS_BULK}?{query}"' in listing
    assert "Interrupt all 200 matching…" in listing

    confirm = client.get(f"{RUNS_BULK}?{query}").content.decode()
    assert 'data-count="200"' in confirm
    assert f"<code>company: {company.name}</code>" in confirm
    assert confirm.count("<tr data-pk=") == bulk.BULK_PREVIEW
    assert 'value="Interrupt all 200 matching"' in confirm

    blank = client.post(f"{RUNS_BULK}?{query}", {"reason": "  ", "seen": "200"})
    assert "This field is required" in blank.content.decode()
    assert not ActivityEvent.objects.filter(action="heartbeat_run.status_changed").exists()

    done = client.post(
        f"{RUNS_BULK}?{query}", {"reason": "rack 7 lost power", "seen": "200"}, follow=True
    )
    assert done.redirect_chain == [(f"{RUNS}?{query}", 302)]
    text = _messages(done.content.decode())
    assert "Interrupt every matching run: 200 row(s) acted on" in text
    assert "199 interrupted" in text
    assert (
        f"Refused: 1 (run {ended.pk}: invalid_run_transition "
        "(A succeeded run cannot become interrupted))" in text
    )
    assert set(HeartbeatRun.objects.filter(company=company).values_list("status", flat=True)) == {
        "interrupted",
        "succeeded",
    }
    assert all(
        r.status == "running" for r in HeartbeatRun.objects.filter(pk__in=[r.pk for r in elsewhere])
    )
    audits = ActivityEvent.objects.filter(action="heartbeat_run.status_changed")
    assert sorted(audits.values_list("entity_id", flat=True)) == sorted(str(r.pk) for r in live)
    assert {e.details["reason"] for e in audits} == {"rack 7 lost power"}
    assert not audits.filter(entity_id=str(ended.pk)).exists()


def test_retry_all_200_matching_cleanups_with_one_refused(company: Company) -> None:
    leases = [backing_off(company) for _ in range(199)]
    active = EnvironmentLeaseFactory(company=company, status="active")
    client = staff(company)
    query = f"company__id__exact={company.pk}"

    confirm = client.get(f"{ENV_BULK}?{query}").content.decode()
    assert 'data-count="200"' in confirm
    done = client.post(
        f"{ENV_BULK}?{query}", {"reason": "provider outage over", "seen": "200"}, follow=True
    )
    text = _messages(done.content.decode())
    assert "199 reopened" in text
    assert f"Refused: 1 (lease {active.pk}: cleanup_not_pending (" in text
    audits = ActivityEvent.objects.filter(action="environment_lease.cleanup_retry_requested")
    assert sorted(audits.values_list("entity_id", flat=True)) == sorted(str(x.pk) for x in leases)
    assert {e.details["reason"] for e in audits} == {"provider outage over"}


def test_force_release_all_stale_leases_leaves_the_live_ones(company: Company) -> None:
    stale = [stale_lease(company, f"stale-{i}") for i in range(3)]
    agent = AgentFactory(company=company)
    live = [ExecutionWorkspaceFactory(company=company) for _ in range(2)]
    for workspace in live:
        claim(workspace, agent)
    client = staff(company)

    listing = client.get(
        reverse("admin:leases_workspaceruntimelease_changelist") + "?staleness=stale"
    ).content.decode()
    assert "Force-release all 3 matching…" in listing
    confirm = client.get(f"{LEASES_BULK}?staleness=stale").content.decode()
    assert 'data-count="3"' in confirm
    assert "<code>owner: Stale (any reason)</code>" in confirm
    as_of = re.search(r'name="as_of" value="([^"]+)"', confirm)  # the page's moment
    assert as_of is not None
    done = client.post(
        f"{LEASES_BULK}?staleness=stale",
        {"reason": "issues closed", "seen": "3", "as_of": as_of.group(1)},
        follow=True,
    )
    text = _messages(done.content.decode())
    assert "3 released" in text
    assert "Refused: 0." in text
    remaining = set(WorkspaceRuntimeLease.objects.values_list("execution_workspace_id", flat=True))
    assert remaining == {workspace.pk for workspace in live}
    audits = ActivityEvent.objects.filter(action="runtime_lease.force_released")
    assert sorted(audits.values_list("entity_id", flat=True)) == sorted(
        str(lease.execution_workspace_id) for lease in stale
    )


def test_acting_reads_the_filter_again(company: Company) -> None:
    runs = _runs(company, 3)
    client = staff(company)
    query = "status__exact=running"
    assert 'data-count="3"' in client.get(f"{RUNS_BULK}?{query}").content.decode()
    HeartbeatRun.objects.filter(pk=runs[0].pk).update(status="succeeded")
    done = client.post(f"{RUNS_BULK}?{query}", {"reason": "host gone", "seen": "3"}, follow=True)
    text = _messages(done.content.decode())
    assert "Interrupt every matching run: 2 row(s) acted on" in text
    assert "(3 matched when you confirmed; the filter was read again)" in text
    assert "Refused: 0." in text


def test_more_than_the_cap_is_refused_with_nothing_done(
    company: Company, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk, "BULK_CAP", 3)
    _runs(company, 4)
    client = staff(company)
    confirm = client.get(RUNS_BULK).content.decode()
    assert "More than 3 rows match this filter" in confirm
    assert "none (every row you may see)" in confirm
    assert 'name="apply"' not in confirm
    refused = client.post(RUNS_BULK, {"reason": "everything", "seen": "3"}).content.decode()
    assert "More than 3 rows match this filter" in refused
    assert not HeartbeatRun.objects.exclude(status="running").exists()
    assert not ActivityEvent.objects.exists()


def test_bulk_needs_the_single_row_actions_permission(company: Company) -> None:
    _runs(company, 2)
    user = UserFactory()
    user.user_permissions.set(Permission.objects.filter(codename="view_heartbeatrun"))
    BoardMembership.objects.create(user=user, company=company)
    client = Client()
    client.force_login(user)
    assert "bulk-link" not in client.get(RUNS).content.decode()
    assert client.get(RUNS_BULK).status_code == 403
    assert client.post(RUNS_BULK, {"reason": "x"}).status_code == 403
    assert not HeartbeatRun.objects.exclude(status="running").exists()


def test_another_companys_rows_are_never_matched(company: Company, other_company: Company) -> None:
    _runs(company, 2)
    theirs = _runs(other_company, 2)
    client = staff(company)
    assert 'data-count="2"' in client.get(RUNS_BULK).content.decode()
    client.post(RUNS_BULK, {"reason": "cleanup", "seen": "2"})
    assert all(
        r.status == "running" for r in HeartbeatRun.objects.filter(pk__in=[r.pk for r in theirs])
    )


@pytest.mark.parametrize(
    ("url", "make"),
    [
        (RUNS_BULK, lambda company: HeartbeatRunFactory(company=company)),
        (ENV_BULK, backing_off),
        (LEASES_BULK, lambda company: stale_lease(company, f"ws-{next(_NAMES)}")),
    ],
)
def test_the_confirmation_page_reads_a_fixed_number_of_queries(
    company: Company, django_assert_max_num_queries: Any, url: str, make: Any
) -> None:
    client = staff(company)
    make(company)
    with CaptureQueriesContext(connection) as few:
        assert client.get(url).status_code == 200
    for _ in range(bulk.BULK_PREVIEW + 5):
        make(company)
    with django_assert_max_num_queries(len(few)):
        page = client.get(url)
    assert page.status_code == 200
    assert page.content.decode().count("<tr data-pk=") == bulk.BULK_PREVIEW


def test_a_lease_reclaimed_after_the_filter_read_it_is_refused_and_kept(company: Company) -> None:
    """Each lease is released only at the generation the filter read: one reclaimed between
    the batch's read and its turn belongs to an owner the operator never saw."""
    stale_lease(company, "ws-reclaimed")
    read = WorkspaceRuntimeLease.objects.get()
    workspace = ExecutionWorkspace.objects.get(pk=read.execution_workspace_id)
    claim(workspace, AgentFactory(company=company))  # the next claim reclaims the stale lane
    user = UserFactory(is_superuser=True)
    with pytest.raises(RuntimeLeaseSuperseded):
        FORCE_RELEASE_BULK.act(board_actor(user), read, "issues closed")
    assert WorkspaceRuntimeLease.objects.get().generation == read.generation + 1
    assert not ActivityEvent.objects.filter(action="runtime_lease.force_released").exists()
