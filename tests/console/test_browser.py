"""The console in a real browser (Playwright driving the Debian chromium package): an operator
finds a held finalization from the dashboard, reads why it is held, confirms it from its page
and sees it leave the dashboard; force-releases a stale lease from its page; interrupts an
orphaned run from its page; meets a held run's hold first on its page, with the hold's
confirmation in place of "Finalize now"; retries a held workspace export from the run's page;
retries a failed environment cleanup now;
force-releases an environment lease its provider left active; interrupts every run a filter
matches, and retries every failed cleanup one matches, from the list (count, preview,
reason, per-row outcome); resolves a failed sandbox run's recovery action waiting for the
board; a staff user of one company never sees another company's objects on any console page;
and the lists and a run's page fit a 1366x768 laptop screen (screenshots `laptop-*.png`).

Screenshots of the pages each test walks through are written to `.screenshots/`
(ignored by git). Without chromium these tests fail in CI (CI=true) and are skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import connection

from leases.models import WorkspaceRuntimeLease
from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    Company,
    ExecutionWorkspaceSnapshot,
    HeartbeatRun,
)
from recovery.console.site import REFRESH_SECONDS
from recovery.services import run_finalize
from tests.console.helpers import (
    held,
    held_export,
    invalid_marker_lease,
    one_of_each,
    orphaned_run,
    stale_lease,
)
from tests.console.test_recovery_resolve import sandbox_failed
from tests.helpers import close_if_dead
from tests.leases.environment.factories import EnvironmentLeaseFactory, backing_off
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("PAPERCLIP_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(settings.BASE_DIR) / ".screenshots"
PASSWORD = "console-test-password-1"  # a throwaway test user
EVIDENCE = "k8s: pod finalizer-7f9 terminated 12:03Z; node drained; no tar processes remain"


def _chromium_or_skip() -> str:
    found = CHROMIUM if Path(CHROMIUM).exists() else shutil.which("chromium")
    if found:
        return found
    message = (
        f"chromium not found at {CHROMIUM} or on PATH: install the Debian package "
        "(apt-get install -y chromium) to run the console's browser tests"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)  # never silently skipped in CI
    pytest.skip(message)


@pytest.fixture
def page(live_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    executable = _chromium_or_skip()
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are
    # still synchronous and safe (the live server answers from its own thread).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        tab = context.new_page()
        tab.set_default_timeout(15_000)
        tab.base_url = live_server.url  # type: ignore[attr-defined]
        # Starting the browser takes seconds; a session of this worker's database ended
        # meanwhile (CI: AdminShutdown at a browser test's first insert) is replaced here.
        close_if_dead()
        try:
            yield tab
        finally:
            context.close()
            browser.close()


def operator(*companies: Company, username: str) -> Any:
    user = get_user_model().objects.create_user(username=username, password=PASSWORD, is_staff=True)
    user.user_permissions.set(Permission.objects.all())
    for company in companies:
        BoardMembership.objects.create(user=user, company=company)
    return user


def log_in(page: Any, username: str) -> None:
    page.goto(f"{page.base_url}/admin/login/?next=/admin/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    follow(page, "input[type=submit]")
    page.wait_for_selector("#attention")


def follow(page: Any, target: Any) -> None:
    """Click a link or submit button and wait until the page it opens has loaded: a locator's
    count() does not wait, so an assertion right after a bare click can read the old page."""
    with page.expect_navigation():
        (page.locator(target) if isinstance(target, str) else target).click()


def fresh_worker_heartbeat() -> None:
    """A worker that just beat (Procrastinate's table; emptied after each transactional test)."""
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO procrastinate_workers (last_heartbeat) VALUES (now())")


def shot(page: Any, name: str) -> None:
    SHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_confirm_a_held_finalization_from_the_dashboard(page: Any) -> None:
    company = CompanyFactory(name="Acme Robotics")
    b, action, _ = held(company)
    stale_lease(company, "acme-main")
    invalid_marker_lease(company)
    fresh_worker_heartbeat()
    operator(company, username="ops")
    clicks = 0

    log_in(page, "ops")
    tile = page.locator('a.console-tile[data-kind="finalization_held"]')
    assert tile.locator(".count").inner_text() == "1"
    assert "oldest" in tile.inner_text()
    assert "UTC" in tile.inner_text()
    shot(page, "dashboard")

    follow(page, tile)
    clicks += 1
    follow(page, f'#result_list a[href*="/recovery/issuerecoveryaction/{action.pk}/change/"]')
    clicks += 1
    verdict = page.locator("#owner-verdict")
    assert verdict.get_attribute("data-verdict") == "same_host_dead_no_barrier"
    assert "no succeeded copy-back barrier" in verdict.inner_text()
    assert page.locator("text=Recovery source inspection").count() == 0
    shot(page, "held-finalization")

    follow(page, 'button[data-console-action="confirm_owner_stop"]')
    clicks += 1
    assert page.locator("h1").count() == 1
    assert page.locator(".breadcrumbs a", has_text="Issue recovery actions").count() == 1
    page.fill("#id_stop_evidence", EVIDENCE)
    page.check("#id_confirmed")
    clicks += 1
    follow(page, "input[name=apply]")
    clicks += 1
    assert "Confirmed 1" in page.locator("ul.messagelist").inner_text()

    page.goto(f"{page.base_url}/admin/")
    assert page.locator('a.console-tile[data-kind="finalization_held"]').count() == 0
    # One quiet line per hold reason (owner unverified, conflict, export retries spent).
    assert page.locator('ul.console-quiet li[data-kind="finalization_held"]').count() == 3
    assert ActivityEvent.objects.filter(action="issue.workspace_owner_stop_confirmed").count() == 1
    b.run.refresh_from_db()
    assert "nativeWorkspaceFinalizationOwner" not in b.run.runner_profile_json
    # Tile, row, confirm button, tick the box, submit (plus typing the evidence).
    assert clicks == 5


def test_the_dashboard_refreshes_in_place(page: Any) -> None:
    company = CompanyFactory()
    operator(company, username="ops")
    page.clock.install()  # the page's timers run on a clock the test moves
    log_in(page, "ops")
    assert page.locator('a.console-tile[data-kind="finalization_held"]').count() == 0
    page.evaluate("window.__marker = 'same page'")
    held(company)
    page.clock.fast_forward(REFRESH_SECONDS * 1000)  # the dashboard's own refresh timer fires
    page.wait_for_selector('a.console-tile[data-kind="finalization_held"]', timeout=30_000)
    assert page.evaluate("window.__marker") == "same page"  # no full reload


def test_force_release_a_stale_lease_from_its_page(page: Any) -> None:
    company = CompanyFactory()
    lease = stale_lease(company, "acme-review")
    operator(company, username="ops")
    log_in(page, "ops")
    follow(
        page, 'a.console-tile[data-kind="runtime_lease_stale"][data-detail="owner_issue_terminal"]'
    )
    follow(page, f'#result_list a[href*="/leases/workspaceruntimelease/{lease.id}/change/"]')
    assert page.locator("#stale-verdict").get_attribute("data-reason") == "owner_issue_terminal"
    shot(page, "stale-lease")
    follow(page, 'button[data-console-action="force_release_selected"]')
    assert page.locator(".breadcrumbs a", has_text="Workspace runtime leases").count() == 1
    shot(page, "force-release-confirmation")
    page.fill("textarea[name=reason]", "issue closed, lane blocked")
    follow(page, "input[type=submit][value^='Force-release']")
    assert "released the lease" in page.locator("ul.messagelist").inner_text()
    assert not WorkspaceRuntimeLease.objects.filter(pk=lease.id).exists()
    page.goto(f"{page.base_url}/admin/")
    assert page.locator('a.console-tile[data-kind="runtime_lease_stale"]').count() == 0


def test_interrupt_an_orphaned_run_from_the_dashboard(page: Any) -> None:
    run = orphaned_run()
    operator(run.company, username="ops")
    log_in(page, "ops")
    follow(page, 'a.console-tile[data-kind="run_orphaned"]')
    follow(page, f'#result_list a[href*="/paperclip/heartbeatrun/{run.pk}/change/"]')
    assert page.locator("#orphaned-verdict").get_attribute("data-state") == "orphaned"
    shot(page, "orphaned-run")
    follow(page, 'button[data-console-action="interrupt_selected"]')
    assert page.locator(".breadcrumbs a", has_text="Heartbeat runs").count() == 1
    # count() does not wait: wait for the confirmation page the click navigates to.
    page.wait_for_selector(f'#interrupt-runs tr[data-run="{run.pk}"]')
    assert page.locator(f'#interrupt-runs tr[data-run="{run.pk}"]').count() == 1
    shot(page, "interrupt-confirmation")
    page.fill("textarea[name=reason]", "agent host lost (kill -9), issue blocked")
    follow(page, "input[name=apply]")
    message = page.locator("ul.messagelist").inner_text()
    assert "Interrupted 1 run(s)" in message
    assert "Refused: none" in message
    shot(page, "interrupted-run")
    run.refresh_from_db()
    assert run.status == "interrupted"
    page.goto(f"{page.base_url}/admin/")
    assert page.locator('a.console-tile[data-kind="run_orphaned"]').count() == 0


def test_interrupt_every_run_matching_a_filter(page: Any) -> None:
    company = CompanyFactory(name="Acme Robotics")
    other = CompanyFactory(name="Globex")
    agent = AgentFactory(company=company, name="builder-7")
    live = [HeartbeatRunFactory(company=company, agent=agent) for _ in range(14)]
    ended = HeartbeatRunFactory(company=company, agent=agent, status="succeeded")
    theirs = HeartbeatRunFactory(company=other)
    operator(company, other, username="ops")
    log_in(page, "ops")
    page.goto(f"{page.base_url}/admin/paperclip/heartbeatrun/")
    follow(page, '#changelist-filter a:has-text("Acme Robotics")')
    bulk_link = page.locator('a.bulk-link[data-bulk="interrupt"]')
    assert bulk_link.text_content() == "Interrupt all 15 matching…"
    shot(page, "bulk-filtered-runs")
    follow(page, bulk_link)
    confirmation = page.locator("#bulk-confirmation")
    assert confirmation.get_attribute("data-count") == "15"
    assert page.locator("#bulk-filter").inner_text() == "Filter: company: Acme Robotics"
    assert page.locator("#bulk-preview tbody tr").count() == 10
    shot(page, "bulk-confirmation")
    page.fill("textarea[name=reason]", "rack 7 lost power; every agent on it is gone")
    follow(page, "input[name=apply]")
    message = page.locator("ul.messagelist").inner_text()
    assert "14 interrupted" in message
    assert f"Refused: 1 (run {ended.pk}: invalid_run_transition" in message
    assert "company__id__exact" in page.url  # back on the filtered list
    shot(page, "bulk-result")
    statuses = set(HeartbeatRun.objects.filter(company=company).values_list("status", flat=True))
    assert statuses == {"interrupted", "succeeded"}
    theirs.refresh_from_db()
    assert theirs.status == "running"
    assert len(live) == ActivityEvent.objects.filter(action="heartbeat_run.status_changed").count()


def test_retry_every_failed_cleanup_a_filter_matches(page: Any) -> None:
    company = CompanyFactory(name="Acme Robotics")
    failed = [backing_off(company) for _ in range(4)]
    EnvironmentLeaseFactory(company=company, status="active")  # not matched by the filter
    operator(company, username="ops")
    log_in(page, "ops")
    page.goto(f"{page.base_url}/admin/leases/environmentlease/")
    follow(page, '#changelist-filter a:has-text("Cleanup failed")')
    bulk_link = page.locator('a.bulk-link[data-bulk="retry-cleanup"]')
    assert bulk_link.text_content() == "Retry cleanup of all 4 matching…"
    follow(page, bulk_link)
    assert page.locator("#bulk-confirmation").get_attribute("data-count") == "4"
    assert "needs attention: Cleanup failed" in page.locator("#bulk-filter").inner_text()
    shot(page, "bulk-retry-cleanup-confirmation")
    page.fill("textarea[name=reason]", "provider outage over")
    follow(page, "input[name=apply]")
    message = page.locator("ul.messagelist").inner_text()
    assert "4 reopened" in message
    assert "Refused: 0." in message
    shot(page, "bulk-retry-cleanup-result")
    reopened = ActivityEvent.objects.filter(action="environment_lease.cleanup_retry_requested")
    assert sorted(reopened.values_list("entity_id", flat=True)) == sorted(
        str(lease.pk) for lease in failed
    )


def test_a_held_runs_page_opens_with_its_hold_and_offers_its_confirmation(page: Any) -> None:
    company = CompanyFactory(name="Acme Robotics")
    b, action, _ = held(company)
    operator(company, username="ops")
    log_in(page, "ops")
    page.goto(f"{page.base_url}/admin/paperclip/heartbeatrun/{b.run.pk}/change/")
    hold = page.locator("#board-hold")
    assert hold.get_attribute("data-hold") == str(action.pk)
    first_field = page.locator(".form-row").first
    assert hold.bounding_box()["y"] < first_field.bounding_box()["y"]  # type: ignore[index]
    assert page.locator('button[data-console-action="finalize_now"]').count() == 0
    shot(page, "held-run")
    follow(page, 'button[data-console-action="confirm_owner_stop"]')
    assert page.locator(".breadcrumbs a", has_text="Issue recovery actions").count() == 1
    page.wait_for_selector("#id_stop_evidence")
    assert page.locator("#id_stop_evidence").count() == 1


def test_retry_a_held_workspace_export_from_the_runs_page(page: Any) -> None:
    company = CompanyFactory(name="Acme Robotics")
    b, hold = held_export(company)
    operator(company, username="ops")
    log_in(page, "ops")
    page.goto(f"{page.base_url}/admin/paperclip/heartbeatrun/{b.run.pk}/change/")
    panel = page.locator("#board-hold")
    assert panel.get_attribute("data-hold") == str(hold.pk)
    assert "workspace export failed" in panel.inner_text()
    assert page.locator('button[data-console-action="finalize_now"]').count() == 0
    shot(page, "held-export-run")
    follow(page, 'button[data-console-action="retry_workspace_export"]')
    page.wait_for_selector("#id_repair_note")
    assert "No space left on device" in page.locator("#content").inner_text()
    page.fill("#id_repair_note", "freed 40 GiB on the worker's volume (df shows 61% used)")
    shot(page, "retry-workspace-export-confirmation")
    follow(page, "input[name=apply]")
    message = page.locator("ul.messagelist").inner_text()
    assert "Export retry queued for 1 run(s), 0 already queued" in message
    assert "Refused: none" in message
    shot(page, "retry-workspace-export-queued")
    retried = ActivityEvent.objects.filter(action="issue.workspace_export_retry_requested")
    assert retried.count() == 1
    # The attempt the worker makes (Playwright's event loop rules out a worker in this thread).
    run_finalize(company_id=company.pk, run_id=b.run.pk)
    hold.refresh_from_db()
    assert (hold.status, hold.outcome) == ("resolved", "restored")
    page.goto(f"{page.base_url}/admin/paperclip/heartbeatrun/{b.run.pk}/change/")
    page.wait_for_selector("#run-timeline")
    assert page.locator("#board-hold").count() == 0


def test_retry_a_failed_cleanup_now_from_the_dashboard(page: Any) -> None:
    company = CompanyFactory()
    lease = backing_off(company)
    operator(company, username="ops")
    log_in(page, "ops")
    follow(page, 'a.console-tile[data-kind="cleanup_failed"]')
    follow(page, f'#result_list a[href*="/leases/environmentlease/{lease.pk}/change/"]')
    assert page.locator("#cleanup-verdict").get_attribute("data-state") == "cleanup_failed"
    follow(page, 'button[data-console-action="retry_cleanup_now"]')
    page.wait_for_selector(f'#retry-cleanup-leases tr[data-lease="{lease.pk}"]')
    assert page.locator(f'#retry-cleanup-leases tr[data-lease="{lease.pk}"]').count() == 1
    shot(page, "retry-cleanup-confirmation")
    page.fill("textarea[name=reason]", "provider outage over")
    follow(page, "input[name=apply]")
    assert "Cleanup reopened for 1 lease(s)" in page.locator("ul.messagelist").inner_text()
    lease.refresh_from_db()
    assert lease.cleanup_status == "pending"
    page.goto(f"{page.base_url}/admin/leases/environmentlease/{lease.pk}/change/")
    shot(page, "cleanup-reopened")


def test_force_release_an_environment_lease_from_its_page(page: Any) -> None:
    company = CompanyFactory()
    lease = EnvironmentLeaseFactory(company=company)
    operator(company, username="ops")
    log_in(page, "ops")
    page.goto(f"{page.base_url}/admin/leases/environmentlease/{lease.pk}/change/")
    follow(page, 'button[data-console-action="force_release"]')
    page.wait_for_selector(f'#force-release-leases tr[data-lease="{lease.pk}"]')
    assert page.locator(f'#force-release-leases tr[data-lease="{lease.pk}"]').count() == 1
    shot(page, "environment-force-release-confirmation")
    page.fill("textarea[name=reason]", "provider agent is gone")
    follow(page, "input[name=apply]")
    message = page.locator("ul.messagelist").inner_text()
    assert "Force-released 1 lease(s) as failed" in message
    assert "(now: 1 pending_cleanup)" in message
    shot(page, "environment-force-released")
    lease.refresh_from_db()
    assert (lease.status, lease.cleanup_status) == ("pending_cleanup", "pending")
    page.goto(f"{page.base_url}/admin/leases/environmentlease/{lease.pk}/change/")
    assert page.locator('button[data-console-action="force_release"]').count() == 0
    shot(page, "environment-lease-after-force-release")


def test_resolve_a_board_recovery_action_from_its_page(page: Any) -> None:
    company = CompanyFactory()
    action = sandbox_failed(company)
    operator(company, username="ops")
    log_in(page, "ops")
    page.goto(f"{page.base_url}/admin/recovery/issuerecoveryaction/{action.pk}/change/")
    shot(page, "recovery-action-waiting-for-the-board")
    follow(page, 'button[data-console-action="resolve_recovery_action"]')
    page.wait_for_selector(f'#resolve-recovery-actions tr[data-action="{action.pk}"]')
    assert page.locator(f'#resolve-recovery-actions tr[data-action="{action.pk}"]').count() == 1
    page.check("input[name=outcome][value=restored]")
    page.fill("textarea[name=note]", "recovered the work from the retained sandbox")
    shot(page, "resolve-recovery-action-confirmation")
    follow(page, "input[name=apply]")
    message = page.locator("ul.messagelist").inner_text()
    assert "Closed 1 recovery action(s): resolved with outcome restored" in message
    shot(page, "recovery-action-resolved")
    action.refresh_from_db()
    assert action.status == "resolved"


def test_a_staff_user_of_one_company_never_sees_another_companys_objects(page: Any) -> None:
    mine = CompanyFactory(name="Acme Robotics")
    theirs = CompanyFactory(name="Globex Secret Labs")
    held(mine)
    stale_lease(mine, "acme-ws")
    b, action, _ = held(theirs)
    lease = stale_lease(theirs, "globex-ws")
    operator(mine, username="acme-ops")
    secrets = [
        "Globex Secret Labs",
        "globex-ws",
        str(theirs.pk),
        str(b.run.pk),
        str(b.issue.pk),
        str(action.pk),
        str(lease.id),
    ]

    log_in(page, "acme-ops")
    urls = ["/admin/", "/admin/attention/"]
    # Every list the operator can open, from the console's own app index.
    page.goto(f"{page.base_url}/admin/")
    hrefs = page.eval_on_selector_all(
        ".console-apps a[href^='/admin/']", "els => els.map(e => e.getAttribute('href'))"
    )
    urls += sorted({h for h in hrefs if h.endswith("/") and "/add/" not in h})
    urls += [f"/admin/search/?q={value}&list=1" for value in secrets[2:]]
    urls += [
        f"/admin/paperclip/heartbeatrun/{b.run.pk}/change/",
        f"/admin/paperclip/heartbeatrun/{b.run.pk}/history/",
        f"/admin/recovery/issuerecoveryaction/{action.pk}/change/",
        f"/admin/leases/workspaceruntimelease/{lease.id}/change/",
        f"/admin/paperclip/company/{theirs.pk}/change/",
    ]
    assert len(urls) > 20
    for url in urls:
        response = page.goto(f"{page.base_url}{url}")
        assert response is not None
        assert response.status < 500, url
        if "/change/" in url or "/history/" in url:
            # Answered exactly as for an id that never existed (Django echoes the id typed).
            assert page.url == f"{page.base_url}/admin/", url
            assert "doesn\u2019t exist" in page.locator("ul.messagelist").inner_text()
            page.evaluate("document.querySelector('ul.messagelist').remove()")
        html = page.content()
        if "/search/" in url:  # the query is echoed back in the search box and the address
            html = html.replace(url.split("q=")[-1].split("&")[0], "")
        leaked = [secret for secret in secrets if secret in html]
        assert leaked == [], f"{url} shows {leaked}"


LAPTOP = {"width": 1366, "height": 768}
LAPTOP_LISTS = {
    "runs": "/admin/paperclip/heartbeatrun/",
    "runtime-leases": "/admin/leases/workspaceruntimelease/",
    "environment-leases": "/admin/leases/environmentlease/",
    "recovery-actions": "/admin/recovery/issuerecoveryaction/",
    "audit-log": "/admin/paperclip/activityevent/",
    "workspace-operations": "/admin/paperclip/workspaceoperation/",
    "coordinators": "/admin/paperclip/nativerunfinalization/",
    "checkpoint-parts": "/admin/checkpoints/nativerunnercheckpoint/",
    "run-results": "/admin/paperclip/nativerunresult/",
    "workspace-snapshots": "/admin/paperclip/executionworkspacesnapshot/",
    "issues": "/admin/paperclip/issue/",
}


def test_lists_and_a_run_page_fit_a_laptop_screen(page: Any) -> None:
    """At 1366 px no list the operator works from scrolls sideways, and names sit beside
    short ids."""
    company = CompanyFactory()
    one_of_each(company)
    run = orphaned_run(company=company)  # a run with a lapsed lease: claims on its timeline
    workspace = ExecutionWorkspaceFactory(company=company, name="ws-snapshotted")
    ExecutionWorkspaceSnapshot.objects.create(company=company, execution_workspace=workspace)
    operator(company, username="laptop")
    page.set_viewport_size(LAPTOP)
    log_in(page, "laptop")
    for name, path in LAPTOP_LISTS.items():
        page.goto(f"{page.base_url}{path}")
        page.wait_for_selector("#result_list")
        shot(page, f"laptop-{name}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= LAPTOP["width"], f"{name}: {width} px wide"
        # Django scrolls a wide table inside its box: the table must fit that box too.
        table, box = page.evaluate(
            "[document.querySelector('#result_list').scrollWidth,"
            " document.querySelector('.results').clientWidth]"
        )
        assert table <= box, f"{name}: table {table} px in a {box} px box"
    assert page.locator("#result_list .console-id").count() > 0  # the last list names too
    page.goto(f"{page.base_url}/admin/paperclip/heartbeatrun/{run.pk}/change/")
    page.wait_for_selector("#run-timeline")
    shot(page, "laptop-run")
    assert page.evaluate("document.documentElement.scrollWidth") <= LAPTOP["width"]
