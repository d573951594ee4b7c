"""Admin: changelist with the live stale reason (no N+1), filters, search, read-only change
form, and the "Force-release selected leases" action with its confirmation page."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from leases.models import WorkspaceRuntimeLease
from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    ExecutionWorkspace,
    HeartbeatRun,
    Issue,
)
from tests.leases.factories import claim, expire
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
    UserFactory,
)

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:leases_workspaceruntimelease_changelist")


@pytest.fixture
def operator(client):
    user = UserFactory(is_superuser=True)
    client.force_login(user)
    return user


def make_leases(company, count):
    """`count` leases, a mix of live and stale owners (claimed while live: a stale owner may
    not claim, so the issue or run ends afterwards)."""
    agent = AgentFactory(company=company)
    made = []
    for i in range(count):
        workspace = ExecutionWorkspaceFactory(company=company, name=f"ws-{i:02d}")
        if i % 3 == 0:
            issue = IssueFactory(company=company, status="todo")
            made.append(claim(workspace, agent, issue_id=issue.pk).lease)
            if i % 2:
                Issue.objects.filter(pk=issue.pk).update(status="done")
        elif i % 3 == 1:
            run = HeartbeatRunFactory(company=company, agent=agent, status="running")
            made.append(claim(workspace, agent, run_id=run.pk).lease)
            HeartbeatRun.objects.filter(pk=run.pk).update(status="failed")
        else:
            made.append(claim(workspace, agent).lease)
            expire(workspace)
    return made


def stale_reason_cells(html: str) -> Counter[str]:
    """The stale-reason column of the changelist (the filter sidebar names every reason in
    its links, so a bare `reason in html` would prove nothing)."""
    return Counter(re.findall(r'<td class="field-stale_reason">([^<]*)</td>', html))


def test_changelist_shows_live_stale_reasons_without_n_plus_1(
    client, operator, company, django_assert_max_num_queries
):
    make_leases(company, 3)
    with CaptureQueriesContext(connection) as few:
        assert client.get(CHANGELIST).status_code == 200
    make_leases(company, 15)
    # session, user, two counts, the company filter's choices, the page: the stale reason
    # rides in the page query.
    with django_assert_max_num_queries(len(few)) as many:
        response = client.get(CHANGELIST)
    assert response.status_code == 200
    assert len(many) <= 6
    # make_leases(3) + make_leases(15): i % 3 == 0 issue-owned (odd i: done → terminal, even
    # i: todo → live), i % 3 == 1 run-owned with a failed run, i % 3 == 2 agent-only, expired.
    assert stale_reason_cells(response.content.decode()) == {
        "owner_run_terminal": 6,
        "lease_expired": 6,
        "owner_issue_terminal": 2,
        "— (owner live)": 4,
    }


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("staleness=stale", 12),
        ("staleness=live", 3),
        ("staleness=expired", 5),
        ("stale_reason=owner_run_terminal", 5),
        ("stale_reason=owner_issue_terminal", 2),
        ("stale_reason=lease_expired", 5),
        ("stale_reason=owner_issue_hidden", 0),
    ],
)
def test_filters(client, operator, company, query, expected):
    make_leases(company, 15)
    response = client.get(f"{CHANGELIST}?{query}")
    assert response.status_code == 200
    assert response.context["cl"].result_count == expected


def test_search_by_owner_key_and_workspace_name(client, operator, company):
    leases = make_leases(company, 4)
    response = client.get(CHANGELIST, {"q": leases[1].owner_key})
    assert response.context["cl"].result_count == 1
    response = client.get(CHANGELIST, {"q": "ws-03"})
    assert response.context["cl"].result_count == 1


def test_change_form_is_read_only_and_nothing_can_be_added_or_deleted(client, operator, company):
    lease = make_leases(company, 1)[0]
    url = reverse("admin:leases_workspaceruntimelease_change", args=[lease.id])
    response = client.get(url)
    assert response.status_code == 200
    assert b'name="_save"' not in response.content
    client.post(url, {"owner_key": "agent:hijack", "generation": 99})
    assert WorkspaceRuntimeLease.objects.get().owner_key == lease.owner_key
    assert client.get(reverse("admin:leases_workspaceruntimelease_add")).status_code == 403
    delete = reverse("admin:leases_workspaceruntimelease_delete", args=[lease.id])
    assert client.post(delete, {"post": "yes"}).status_code == 403
    assert WorkspaceRuntimeLease.objects.count() == 1


def action_post(client, leases, **extra):
    data = {
        "action": "force_release_selected",
        "_selected_action": [str(lease.id) for lease in leases],
        **extra,
    }
    return client.post(CHANGELIST, data)


def test_force_release_asks_for_confirmation_first(client, operator, company):
    leases = make_leases(company, 2)
    response = action_post(client, leases)
    assert response.status_code == 200
    assert "admin/leases/workspaceruntimelease/force_release_confirmation.html" in [
        t.name for t in response.templates
    ]
    html = response.content.decode()
    assert 'name="reason"' in html
    assert f'value="{leases[0].id}:{leases[0].generation}"' in html
    assert WorkspaceRuntimeLease.objects.count() == 2


def test_force_release_requires_a_reason(client, operator, company):
    leases = make_leases(company, 2)
    pins = [f"{lease.id}:{lease.generation}" for lease in leases]
    response = action_post(client, leases, confirm="yes", pin=pins, reason="   ")
    assert response.status_code == 200  # the page again, with the error
    assert response.context["form"].errors["reason"]
    assert WorkspaceRuntimeLease.objects.count() == 2
    assert not ActivityEvent.objects.filter(action="runtime_lease.force_released").exists()


def test_force_release_releases_each_lease_audited_with_per_item_messages(
    client, operator, company
):
    leases = make_leases(company, 3)
    pins = [f"{lease.id}:{lease.generation}" for lease in leases]

    response = action_post(client, leases, confirm="yes", pin=pins, reason="host rebuilt")

    assert response.status_code == 302
    assert WorkspaceRuntimeLease.objects.count() == 0
    events = ActivityEvent.objects.filter(action="runtime_lease.force_released")
    assert events.count() == 3
    assert {e.details["reason"] for e in events} == {"host rebuilt"}
    assert {e.actor_id for e in events} == {str(operator.pk)}
    texts = [m.message for m in get_messages(response.wsgi_request)]
    assert len(texts) == 3
    names = dict(ExecutionWorkspace.objects.values_list("pk", "name"))
    assert sorted(texts) == sorted(
        f"{names[lease.execution_workspace_id]}: released the lease of {lease.owner_key} "
        "(generation 1)."
        for lease in leases
    )


def test_force_release_keeps_a_lease_reclaimed_since_selection(client, operator, company):
    workspace = ExecutionWorkspaceFactory(company=company)
    first = AgentFactory(company=company)
    issue = IssueFactory(company=company)
    seen = claim(workspace, first, issue_id=issue.pk).lease
    Issue.objects.filter(pk=issue.pk).update(status="cancelled")
    newer = claim(workspace, AgentFactory(company=company)).lease  # reclaimed: generation 2

    response = action_post(
        client, [seen], confirm="yes", pin=[f"{seen.id}:{seen.generation}"], reason="stuck"
    )

    assert response.status_code == 302
    assert WorkspaceRuntimeLease.objects.get().generation == newer.generation == 2
    texts = [m.message for m in get_messages(response.wsgi_request)]
    assert texts == [
        f"{workspace}: not released, the lease changed since you selected it "
        f"(generation 1 → 2, owner now {newer.owner_key}) (workspace_runtime_lease_superseded)."
    ]


def test_board_member_sees_only_own_company_leases(client, company):
    make_leases(company, 2)
    make_leases(CompanyFactory(), 3)
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=company)
    user.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["view_workspaceruntimelease", "change_workspaceruntimelease"]
        )
    )
    client.force_login(user)
    response = client.get(CHANGELIST)
    assert response.status_code == 200
    assert response.context["cl"].result_count == 2
    assert "force_release_selected" in response.content.decode()


def test_staff_without_the_permission_has_no_force_release_action(client, company):
    make_leases(company, 1)
    user = UserFactory()
    BoardMembership.objects.create(user=user, company=company)
    user.user_permissions.add(Permission.objects.get(codename="view_workspaceruntimelease"))
    client.force_login(user)
    response = client.get(CHANGELIST)
    assert response.status_code == 200
    assert "force_release_selected" not in response.content.decode()
    lease = WorkspaceRuntimeLease.objects.get()
    action_post(client, [lease], confirm="yes", pin=[f"{lease.id}:1"], reason="nope")
    assert WorkspaceRuntimeLease.objects.count() == 1
