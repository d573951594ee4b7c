"""Console pages: act where you look (detail-page buttons through the same actions), the
confirmation page, the global id search and the activity timelines, all company-scoped."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from leases.models import WorkspaceRuntimeLease
from paperclip.models import ActivityEvent, BoardMembership, Company, Issue
from paperclip.receipts import OWNER_KEY
from tests.console.helpers import held, one_of_each, stale_lease
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    IssueFactory,
    NativeRunFactory,
    UserFactory,
)

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

LEASES = reverse("admin:leases_workspaceruntimelease_changelist")
ACTIONS = reverse("admin:recovery_issuerecoveryaction_changelist")
SEARCH = reverse("admin:console_search")
EVIDENCE = "k8s: pod finalizer-7f9 terminated 12:03Z, no copy processes left on node"


def staff(*companies: Company, perms: bool = True) -> Client:
    user = UserFactory()
    for company in companies:
        BoardMembership.objects.create(user=user, company=company)
    if perms:
        user.user_permissions.set(Permission.objects.all())
    client = Client()
    client.force_login(user)
    return client


def test_force_release_from_the_lease_page(company: Company) -> None:
    lease = stale_lease(company)
    client = staff(company)
    page = client.get(reverse("admin:leases_workspaceruntimelease_change", args=[lease.id]))
    html = page.content.decode()
    assert 'data-reason="owner_issue_terminal"' in html
    assert "The issue that owns it is done or cancelled." in html
    assert 'data-console-action="force_release_selected"' in html
    # The button posts the lease to the list's own action: the same confirmation page.
    confirm = client.post(
        LEASES, {"action": "force_release_selected", "_selected_action": [str(lease.id)]}
    )
    assert confirm.status_code == 200
    assert f'value="{lease.id}:{lease.generation}"' in confirm.content.decode()
    done = client.post(
        LEASES,
        {
            "action": "force_release_selected",
            "_selected_action": [str(lease.id)],
            "confirm": "yes",
            "pin": [f"{lease.id}:{lease.generation}"],
            "reason": "host rebuilt",
        },
    )
    assert done.status_code == 302
    assert not WorkspaceRuntimeLease.objects.exists()
    assert ActivityEvent.objects.filter(action="runtime_lease.force_released").count() == 1


def test_the_force_release_button_needs_the_permission(company: Company) -> None:
    lease = stale_lease(company)
    client = staff(company, perms=False)
    user = UserFactory()  # view-only staff member of the company
    user.user_permissions.set(Permission.objects.filter(codename="view_workspaceruntimelease"))
    BoardMembership.objects.create(user=user, company=company)
    client = Client()
    client.force_login(user)
    page = client.get(reverse("admin:leases_workspaceruntimelease_change", args=[lease.id]))
    assert page.status_code == 200
    assert "force_release_selected" not in page.content.decode()


def test_confirm_owner_stop_from_the_hold_page(company: Company) -> None:
    b, action, _receipt = held(company)
    client = staff(company)
    page = client.get(reverse("admin:recovery_issuerecoveryaction_change", args=[action.pk]))
    html = page.content.decode()
    assert 'data-verdict="same_host_dead_no_barrier"' in html
    assert 'data-console-action="confirm_owner_stop"' in html
    assert 'name="_save"' not in html
    assert "Recovery source" not in html
    form = client.post(ACTIONS, {"action": "confirm_owner_stop", "_selected_action": [action.pk]})
    form_html = form.content.decode()
    # One heading, and a breadcrumb that keeps the list and the hold.
    assert len(re.findall(r"<h1[ >]", form_html)) == 1
    crumbs = re.search(r'<ol class="breadcrumbs">(.*?)</ol>', form_html, re.S)
    assert crumbs is not None
    assert f'href="{ACTIONS}"' in crumbs.group(1)
    assert reverse("admin:recovery_issuerecoveryaction_change", args=[action.pk]) in crumbs.group(1)
    assert 'data-verdict="same_host_dead_no_barrier"' in form_html
    done = client.post(
        ACTIONS,
        {
            "action": "confirm_owner_stop",
            "_selected_action": [action.pk],
            "apply": "1",
            "stop_evidence": EVIDENCE,
            "confirmed": "on",
        },
    )
    assert done.status_code == 302
    b.run.refresh_from_db()
    assert OWNER_KEY not in b.run.runner_profile_json
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 1
    after = client.get(reverse("admin:recovery_issuerecoveryaction_change", args=[action.pk]))
    assert "confirm_owner_stop" not in after.content.decode().split("object-tools")[1][:3000]
    assert client.get(f"{ACTIONS}?hold=board").context["cl"].result_count == 0


def test_finalize_now_from_the_coordinator_page(company: Company) -> None:
    world = one_of_each(company)
    coordinator = world["failed"]
    client = staff(company)
    url = reverse("admin:paperclip_nativerunfinalization_change", args=[coordinator.pk])
    assert 'data-console-action="finalize_now"' in client.get(url).content.decode()
    changelist = reverse("admin:paperclip_nativerunfinalization_changelist")
    done = client.post(changelist, {"action": "finalize_now", "_selected_action": [coordinator.pk]})
    assert done.status_code == 302
    assert ActivityEvent.objects.filter(action="run.finalization_requested").count() == 1


def test_run_page_lists_everything_related_and_never_checkpoint_contents(
    company: Company,
) -> None:
    world = one_of_each(company)
    run = world["authority"].run
    client = staff(company)
    html = client.get(reverse("admin:paperclip_heartbeatrun_change", args=[run.pk])).content
    text = html.decode()
    for heading in (
        "Coordinator",
        "Runtime leases",
        "Recovery actions",
        "Checkpoint parts",
        "Workspace operations",
        "Audit rows",
    ):
        assert f"<h3>{heading}</h3>" in text
    assert "session.jsonl" in text
    assert "2.0\xa0KB (2048 B)" in text
    assert "ciphertext" not in text


def test_search_finds_ids_only_in_the_operators_companies(company: Company) -> None:
    mine = held(company)[0]
    theirs = held(CompanyFactory())[0]
    client = staff(company)
    found = client.get(SEARCH, {"q": str(mine.run.pk), "list": "1"})
    assert found.status_code == 200
    assert str(mine.run.pk) in found.content.decode()
    one = client.get(SEARCH, {"q": str(mine.issue.pk)})
    assert one.status_code == 302 or one.status_code == 200
    nothing = client.get(SEARCH, {"q": str(theirs.run.pk)})
    assert nothing.status_code == 200
    assert "Nothing in your companies" in nothing.content.decode()
    for weird in ("", "'; select 1; --", "x" * 5000, "issue:not-a-uuid", "a\x00b"):
        assert client.get(SEARCH, {"q": weird}).status_code == 200


def test_search_opens_a_single_hit(company: Company) -> None:
    workspace_lease = stale_lease(company)
    client = staff(company)
    # An owner key names both the lease and its owner: both are listed.
    both = client.get(SEARCH, {"q": workspace_lease.owner_key})
    assert [hit.kind for hit, _ in both.context["hits"]] == ["issue", "runtime lease"]
    response = client.get(SEARCH, {"q": str(workspace_lease.id)})
    assert response.status_code == 302
    assert response["Location"] == reverse(
        "admin:leases_workspaceruntimelease_change", args=[workspace_lease.id]
    )


def test_history_is_the_activity_timeline_and_scoped(company: Company) -> None:
    mine = held(company)[0]
    theirs = held(CompanyFactory())[0]
    client = staff(company)
    ActivityEvent.objects.create(
        company=company,
        actor_type="system",
        actor_id="test",
        action="heartbeat_run.status_changed",
        entity_type="heartbeat_run",
        entity_id=str(mine.run.pk),
        run=mine.run,
    )
    page = client.get(reverse("admin:paperclip_heartbeatrun_history", args=[mine.run.pk]))
    assert page.status_code == 200
    assert "heartbeat_run.status_changed" in page.content.decode()
    assert "no change history" not in page.content.decode().lower()
    other = client.get(reverse("admin:paperclip_heartbeatrun_history", args=[theirs.run.pk]))
    assert other.status_code == 302  # as for a missing object: nothing revealed


def test_company_filter_lists_only_the_operators_companies(company: Company) -> None:
    CompanyFactory(name="Secret Other Co")
    stale_lease(company)
    client = staff(company)
    html = client.get(LEASES).content.decode()
    assert company.name in html
    assert "Secret Other Co" not in html

    # The key columns first, so that they stay on screen at 1400 px.
    columns = re.findall(r'<th scope="col" class="[^"]*column-(\w+)', html)
    assert columns[:5] == ["workspace", "company", "stale_reason", "renewed", "expires"]


def test_console_templates_use_the_admins_breadcrumb_markup() -> None:
    """Django's admin styles `ol.breadcrumbs`; a `div.breadcrumbs` renders as bare links."""
    root = Path(settings.BASE_DIR) / "templates"
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.html")
        if 'class="breadcrumbs"' in path.read_text()
        and '<ol class="breadcrumbs">' not in path.read_text()
    ]
    assert offenders == []


CHANGELISTS = [
    "admin:leases_workspaceruntimelease_changelist",
    "admin:leases_environmentlease_changelist",
    "admin:recovery_issuerecoveryaction_changelist",
    "admin:paperclip_nativerunfinalization_changelist",
    "admin:paperclip_heartbeatrun_changelist",
    "admin:paperclip_activityevent_changelist",
    "admin:checkpoints_nativerunnercheckpoint_changelist",
    "admin:paperclip_workspaceoperation_changelist",
]


@pytest.mark.parametrize("name", CHANGELISTS)
def test_console_changelists_have_no_n_plus_1(
    company: Company, name: str, django_assert_max_num_queries: Any
) -> None:
    client = staff(company)
    one_of_each(company, "-a")
    with CaptureQueriesContext(connection) as few:
        assert client.get(reverse(name)).status_code == 200
    for n in range(4):
        one_of_each(company, f"-b{n}")
    with django_assert_max_num_queries(len(few)):
        assert client.get(reverse(name)).status_code == 200


@pytest.mark.parametrize("superuser", [True, False])
def test_every_console_page_answers_without_a_server_error(
    company: Company, superuser: bool
) -> None:
    """Every registered list, the first object's page and its timeline, for a superuser and a
    staff member: never a 500."""
    from django.contrib import admin

    one_of_each(company)
    if superuser:
        user = UserFactory(is_superuser=True)
        client = Client()
        client.force_login(user)
    else:
        client = staff(company)
    checked = 0
    for model, model_admin in admin.site._registry.items():
        opts = model._meta
        changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        response = client.get(changelist)
        assert response.status_code in (200, 403), changelist
        if response.status_code != 200:
            continue
        checked += 1
        first = model_admin.get_queryset(response.wsgi_request).order_by().first()
        if first is None:
            continue
        for view in ("change", "history"):
            url = reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=[first.pk])
            assert client.get(url).status_code == 200, url
    assert checked >= 15


def test_detail_pages_say_why_in_words(company: Company) -> None:
    world = one_of_each(company)
    client = staff(company)
    coordinator = client.get(
        reverse("admin:paperclip_nativerunfinalization_change", args=[world["failed"].pk])
    ).content.decode()
    assert 'id="finalization-state" data-state="failed"' in coordinator
    assert "Last error: workspace_copyback_retry_exhausted" in coordinator
    marker = client.get(
        reverse("admin:leases_environmentlease_change", args=[world["marker"].pk])
    ).content.decode()
    assert 'id="marker-verdict" data-state="marker_invalid"' in marker
    assert "nativeWorkspaceExportResume: leaseId does not equal the lease&#x27;s" in marker
    overdue = client.get(
        reverse("admin:leases_environmentlease_change", args=[world["overdue"].pk])
    ).content.decode()
    assert 'data-state="claim_overdue"' in overdue
    assert 'data-state="marker_invalid"' not in overdue  # panels only where they apply
    failed = client.get(
        reverse("admin:leases_environmentlease_change", args=[world["cleanup_failed"].pk])
    ).content.decode()
    assert 'data-state="cleanup_failed"' in failed


def test_lists_and_titles_name_agents_issues_and_workspaces_beside_short_ids(
    company: Company,
) -> None:
    lease = stale_lease(company, "ws-named")
    run = NativeRunFactory(
        company=company,
        agent=AgentFactory(company=company, name="agent-3"),
        issue=IssueFactory(company=company, title="Fix login"),
    )
    ActivityEvent.objects.create(
        company=company,
        actor_type="agent",
        actor_id=str(run.agent_id),
        action="heartbeat_run.status_changed",
        entity_type="heartbeat_run",
        entity_id=str(run.pk),
        run=run,
    )
    client = staff(company)
    runs = client.get(reverse("admin:paperclip_heartbeatrun_changelist")).content.decode()
    assert f'agent-3 <span class="console-id">({str(run.agent_id)[:8]})</span>' in runs
    assert f'>Fix login <span class="console-id">({str(run.issue_id)[:8]})' in runs
    leases = client.get(LEASES).content.decode()
    workspace = lease.execution_workspace_id
    assert f'ws-named <span class="console-id">({str(workspace)[:8]})</span>' in leases
    owner = Issue.objects.get(pk=lease.owner_issue_id)
    assert f'issue: {owner.title} <span class="console-id">' in leases
    audit = client.get(reverse("admin:paperclip_activityevent_changelist")).content.decode()
    assert "run of agent-3" in audit
    assert f'agent-3 <span class="console-id">({str(run.agent_id)[:8]})</span>' in audit
    page = client.get(reverse("admin:paperclip_heartbeatrun_change", args=[run.pk]))
    assert f"run {str(run.pk)[:8]} of agent-3 on “Fix login”" in page.content.decode()
    history = client.get(reverse("admin:paperclip_heartbeatrun_history", args=[run.pk]))
    assert f"Activity of run {str(run.pk)[:8]} of agent-3" in history.content.decode()


def test_search_finds_short_id_prefixes_agent_names_and_issue_titles(company: Company) -> None:
    run = NativeRunFactory(
        company=company,
        agent=AgentFactory(company=company, name="agent-ergo-7"),
        issue=IssueFactory(company=company, title="Rotate the billing keys"),
    )
    theirs = NativeRunFactory(
        company=CompanyFactory(),
        agent=AgentFactory(name="agent-ergo-8"),
        issue=IssueFactory(title="Rotate the billing keys too"),
    )
    client = staff(company)

    def found(query: str) -> list[Any]:
        response = client.get(SEARCH, {"q": query, "list": "1"})
        assert response.status_code == 200
        return [hit.pk for hit, _ in response.context["hits"]]

    assert run.pk in found(str(run.pk)[:8])
    assert run.pk in found(str(run.pk)[:8].upper())
    assert theirs.pk not in found(str(theirs.pk)[:8])
    assert found("agent-ergo") == [run.agent_id]
    assert found("billing keys") == [run.issue_id]
    # One hit opens its page.
    opened = client.get(SEARCH, {"q": "Agent-Ergo-7"})
    assert opened.status_code == 302
    assert opened["Location"] == reverse("admin:paperclip_agent_change", args=[run.agent_id])
    assert "Nothing in your companies" in client.get(SEARCH, {"q": "zzz-no-such"}).content.decode()


UNIT = r"\d+(\.\d)? (s|min|h)"
RENEWAL = re.compile(rf"last renewal {UNIT} ago, expected every {UNIT} \(TTL {UNIT}\)")


def test_a_leases_owner_is_shown_with_its_renewal_cadence(company: Company) -> None:
    lease = stale_lease(company, "ws-renewal")
    client = staff(company)
    listed = client.get(LEASES).content.decode()
    assert re.search(rf"{UNIT} ago, every {UNIT}", listed)
    assert RENEWAL.search(listed)  # the whole sentence in the title attribute
    page = client.get(reverse("admin:leases_workspaceruntimelease_change", args=[lease.id]))
    assert RENEWAL.search(page.content.decode())
    run = NativeRunFactory(company=company, execution_workspace_id=lease.execution_workspace_id)
    run_page = client.get(reverse("admin:paperclip_heartbeatrun_change", args=[run.pk]))
    assert RENEWAL.search(run_page.content.decode())
    # The force-release confirmation names whom it evicts, and whether they still renew.
    confirm = client.post(
        LEASES, {"action": "force_release_selected", "_selected_action": [str(lease.id)]}
    ).content.decode()
    assert RENEWAL.search(confirm)
    assert f"({str(lease.owner_key.partition(':')[2])[:8]})" in confirm


def test_run_page_shows_its_timeline_oldest_first_in_a_bounded_number_of_queries(
    company: Company, django_assert_max_num_queries: Any
) -> None:
    world = one_of_each(company)
    run = world["authority"].run
    url = reverse("admin:paperclip_heartbeatrun_change", args=[run.pk])
    client = staff(company)
    with CaptureQueriesContext(connection) as few:
        html = client.get(url).content.decode()
    timeline = html[html.index('id="run-timeline"') : html.index("<h3>Coordinator</h3>")]
    stamps = re.findall(r'<time datetime="([^"]+)"', timeline)
    assert stamps
    assert stamps == sorted(stamps)
    assert "run created" in timeline
    for n in range(5):
        ActivityEvent.objects.create(
            company=company,
            actor_type="system",
            actor_id="test",
            action=f"run.step_{n}",
            entity_type="heartbeat_run",
            entity_id=str(run.pk),
            run=run,
        )
    with django_assert_max_num_queries(len(few)):
        more = client.get(url).content.decode()
    assert "run.step_4" in more[more.index('id="run-timeline"') :]
