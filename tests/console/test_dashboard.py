"""The "Needs attention" dashboard: its selector counts every kind of stuck work in a fixed
number of queries, each tile's link opens a list with exactly that many rows, it is scoped to
the operator's companies, and reading it writes nothing."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from paperclip.models import ActivityEvent, BoardMembership, Company
from recovery.console.attention import attention_summary
from recovery.console.site import tile_url
from recovery.selectors.holds import HOLD_REMEDIATION
from tests.console.helpers import held, held_conflict, held_export, one_of_each
from tests.paperclip.factories import AgentFactory, CompanyFactory, IssueFactory, UserFactory

pytestmark = pytest.mark.django_db

INDEX = reverse("admin:index")
FRAGMENT = reverse("admin:console_attention")


def counts(company_ids: Any, *, include_jobs: bool = False) -> dict[str, int]:
    summary = attention_summary(company_ids=company_ids, include_jobs=include_jobs)
    return {f"{t.kind}:{t.detail or ''}": t.count for t in summary.tiles}


def staff_client(*companies: Company, superuser: bool = False) -> Client:
    # A staff board member with every model permission: only membership limits what they see.
    user = UserFactory(is_superuser=superuser)
    for company in companies:
        BoardMembership.objects.create(user=user, company=company)
    if not superuser:
        user.user_permissions.set(Permission.objects.all())
    client = Client()
    client.force_login(user)
    return client


def test_every_kind_of_stuck_work_is_counted(company: Company) -> None:
    one_of_each(company)
    found = counts([company.pk])
    assert found["finalization_held:owner_unverified"] == 1
    assert found["finalization_held:workspace_head_conflict"] == 0
    assert found["finalization_held:workspace_export_retry_exhausted"] == 0
    assert found["finalization_failed:"] == 1
    assert found["finalization_retrying:"] == 1
    assert found["runtime_lease_stale:owner_issue_terminal"] == 1
    assert found["runtime_lease_stale:lease_expired"] == 1
    assert found["runtime_lease_stale:owner_run_terminal"] == 0
    assert found["cleanup_failed:"] == 1
    assert found["cleanup_claim_overdue:"] == 1
    assert found["cleanup_marker_invalid:"] == 1
    assert found["authority_expired:"] == 1
    assert found["worker_heartbeat_stale:"] == 1  # no worker in this test
    assert "job_failed:" not in found  # jobs are for superusers only
    assert "job_failed:" in counts(None, include_jobs=True)


def test_the_summary_reads_a_fixed_number_of_queries_however_many_rows(
    company: Company, django_assert_max_num_queries: Any
) -> None:
    one_of_each(company, "-a")
    with CaptureQueriesContext(connection) as few:
        attention_summary(company_ids=[company.pk], include_jobs=True)
    for n in range(4):
        one_of_each(company, f"-b{n}")
    with django_assert_max_num_queries(len(few)) as many:
        summary = attention_summary(company_ids=[company.pk], include_jobs=True)
    assert len(many) == len(few) <= 13
    held = next(t for t in summary.tiles if t.kind == "finalization_held")
    assert held.count == 5


def test_the_dashboard_page_reads_a_fixed_number_of_queries(
    company: Company, django_assert_max_num_queries: Any
) -> None:
    client = staff_client(company)
    one_of_each(company, "-a")
    with CaptureQueriesContext(connection) as few:
        assert client.get(INDEX).status_code == 200
    for n in range(3):
        one_of_each(company, f"-b{n}")
    with django_assert_max_num_queries(len(few)):
        assert client.get(INDEX).status_code == 200


def test_each_tile_opens_a_list_with_exactly_its_rows(company: Company) -> None:
    """The tile and the list filter it links to use the same builder: the numbers agree."""
    one_of_each(company, "-a")
    one_of_each(company, "-b")
    one_of_each(CompanyFactory(), "-other")  # another company's: counted by neither
    client = staff_client(company)
    summary = attention_summary(company_ids=[company.pk], include_jobs=False)
    checked = 0
    for tile in summary.tiles:
        if tile.kind == "worker_heartbeat_stale":
            continue
        response = client.get(tile_url(tile.kind, tile.detail))
        assert response.status_code == 200, tile.kind
        assert response.context["cl"].result_count == tile.count, tile
        checked += 1
    assert checked >= 12


def test_dashboard_shows_tiles_with_counts_ages_and_links(company: Company) -> None:
    one_of_each(company)
    client = staff_client(company)
    html = client.get(INDEX).content.decode()
    tile = re.search(
        r'<a class="console-tile needs" href="([^"]+)" data-kind="finalization_held"', html
    )
    assert tile is not None
    assert tile.group(1) == "/admin/recovery/issuerecoveryaction/?hold=owner_unverified"
    assert "Finalizations held for the board" in html
    assert re.search(r"oldest <time[^>]*>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC</time>", html)
    assert "times in UTC" in html
    # Refreshed in place: the fragment is the same tiles, without the page around them.
    fragment = client.get(FRAGMENT)
    assert fragment.status_code == 200
    body = fragment.content.decode()
    assert 'data-kind="finalization_held"' in body
    assert "<html" not in body


def test_dashboard_is_scoped_to_the_operators_companies(company: Company) -> None:
    other = CompanyFactory(name="Other Corp")
    theirs = one_of_each(other, "-theirs")
    client = staff_client(company)
    for url in (INDEX, FRAGMENT):
        html = client.get(url).content.decode()
        assert 'class="console-tile needs" href="/admin/recovery' not in html
        assert str(theirs["held"][0].run.pk) not in html
        assert "Other Corp" not in html
    # Their audit rows do not show in the recent activity either.
    assert str(theirs["held"][1].pk)[:8] not in client.get(INDEX).content.decode()


def test_reading_the_dashboard_writes_nothing(company: Company) -> None:
    one_of_each(company)
    client = staff_client(company)
    before = ActivityEvent.objects.count()
    client.get(INDEX)
    client.get(FRAGMENT)
    assert ActivityEvent.objects.count() == before


def test_the_fragment_needs_a_staff_login(client: Client) -> None:
    response = client.get(FRAGMENT)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


def test_tiles_link_only_to_pages_the_operator_may_open(company: Company) -> None:
    """The worker pages are for superusers: a staff user's heartbeat tile links nowhere."""
    staff_html = staff_client(company).get(INDEX).content.decode()
    assert re.search(
        r'<div class="console-tile needs"\s+data-kind="worker_heartbeat_stale"', staff_html
    )
    assert "/admin/paperclip/workerprocess/" not in staff_html
    superuser_html = staff_client(superuser=True).get(INDEX).content.decode()
    assert (
        '<a class="console-tile needs" href="/admin/paperclip/workerprocess/" '
        'data-kind="worker_heartbeat_stale"' in superuser_html
    )


def test_recent_activity_links_to_each_entitys_page_by_name(company: Company) -> None:
    agent = AgentFactory(company=company, name="agent-recent")
    issue = IssueFactory(company=company, title="Recent issue")
    for entity_type, entity_id in (("issue", issue.pk), ("agent", agent.pk)):
        ActivityEvent.objects.create(
            company=company,
            actor_type="agent",
            actor_id=str(agent.pk),
            action=f"{entity_type}.updated",
            entity_type=entity_type,
            entity_id=str(entity_id),
        )
    html = staff_client(company).get(INDEX).content.decode()
    recent = html[html.index('id="recent-actions-module"') :]
    issue_url = reverse("admin:paperclip_issue_change", args=[issue.pk])
    agent_url = reverse("admin:paperclip_agent_change", args=[agent.pk])
    assert f'<a href="{issue_url}">' in recent
    assert f'<a href="{agent_url}">' in recent
    assert "Recent issue" in recent
    assert f'agent-recent <span class="console-id">({str(agent.pk)[:8]})</span>' in recent


def test_every_board_hold_has_a_held_tile_of_its_reason_with_its_own_remedy(
    company: Company,
) -> None:
    """Owner unverified, workspace conflict and export retries spent each wait for the board:
    each is counted on its own "held for the board" tile with its own remediation, and a
    conflict hold is not counted as a finalization the worker retries."""
    held(company)
    conflict, _hold = held_conflict(company)
    held_export(company)
    summary = attention_summary(company_ids=[company.pk], include_jobs=False)
    tiles = {t.detail: t for t in summary.tiles if t.kind == "finalization_held"}
    assert {reason: t.count for reason, t in tiles.items()} == {
        "owner_unverified": 1,
        "workspace_head_conflict": 1,
        "workspace_export_retry_exhausted": 1,
    }
    assert tiles["owner_unverified"].hint == HOLD_REMEDIATION["owner_unverified"]
    assert tiles["workspace_head_conflict"].hint == HOLD_REMEDIATION["workspace_head_conflict"]
    hints = [t.hint for t in tiles.values()]
    assert len(set(hints)) == 3  # one remedy per reason, never the owner-stop one for all
    assert "resolve" in tiles["workspace_head_conflict"].hint
    assert "Retry workspace export" in tiles["workspace_export_retry_exhausted"].hint
    retrying = next(t for t in summary.tiles if t.kind == "finalization_retrying")
    failed = next(t for t in summary.tiles if t.kind == "finalization_failed")
    assert (retrying.count, failed.count) == (0, 0)  # each hold is counted once, as held
    client = staff_client(company)
    for reason, tile in tiles.items():
        listed = client.get(tile_url(tile.kind, tile.detail))
        assert listed.context["cl"].result_count == 1, reason
    html = client.get(INDEX).content.decode()
    assert "Finalizations held for the board: workspace head conflict" in html
    assert "Finalizations retrying: 0" in html
    # The coordinator's page says the same: held over a conflict, with the conflict's remedy.
    page = client.get(
        reverse("admin:paperclip_nativerunfinalization_change", args=[conflict.run.pk])
    ).content.decode()
    assert "Held for the board (workspace_head_conflict)" in page
    assert "nothing waits for a retry" in page
    assert "previous owner" not in page
