"""In a real browser (as tests/console/test_browser.py): an operator finds a workspace whose
cwd is behind its head on the dashboard, reads the error on its page and retries its
materialization there (screenshots `behind-*.png` in `.screenshots/`)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db.models.functions import Now
from procrastinate.contrib.django.models import ProcrastinateJob

from paperclip.models import ActivityEvent, ExecutionWorkspace
from paperclip.snapshots.behind import MATERIALIZE_TASK
from paperclip.snapshots.trees import blob_name
from tests.console.test_browser import (  # noqa: F401 - `page` is the browser fixture
    follow,
    fresh_worker_heartbeat,
    log_in,
    operator,
    page,
    shot,
)
from tests.paperclip.factories import CompanyFactory, ExecutionWorkspaceFactory

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_retry_a_workspace_behind_its_head_from_the_dashboard(page: Any) -> None:  # noqa: F811
    company = CompanyFactory(name="Acme Robotics")
    workspace = ExecutionWorkspaceFactory(company=company, name="acme-main", cwd="/srv/ws/acme")
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(
        head_tree=blob_name(b"head"),
        cwd_tree=blob_name(b"old"),
        head_committed_at=Now() - timedelta(minutes=3),
        materialize_error="OSError: [Errno 28] No space left on device: '.main.py.pcl-tmp-1f'",
        materialize_failed_at=Now(),
        materialize_attempts=2,
        materialize_next_at=Now() + timedelta(seconds=60),
    )
    fresh_worker_heartbeat()
    operator(company, username="ops")

    log_in(page, "ops")
    tile = page.locator('a.console-tile[data-kind="workspace_behind_head"]')
    assert tile.locator(".count").inner_text() == "1"
    assert "No space left on device" in tile.inner_text()
    assert "next attempt" in tile.inner_text()
    shot(page, "behind-dashboard")

    follow(page, tile)
    assert "No space left on device" in page.locator("#result_list").inner_text()
    shot(page, "behind-list")
    follow(page, f'#result_list a[href*="/executionworkspace/{workspace.pk}/change/"]')
    panel = page.locator("text=Materialization failed")
    assert panel.count() == 1
    shot(page, "behind-workspace")

    follow(page, 'button[data-console-action="retry_materialization"]')
    message = page.locator("ul.messagelist").inner_text()
    job = ProcrastinateJob.objects.get(task_name=MATERIALIZE_TASK, status="todo")
    assert f"acme-main: job {job.pk} deferred" in message.lower()
    assert ActivityEvent.objects.filter(action="workspace.materialize_retry_requested").count() == 1
    shot(page, "behind-retried")
