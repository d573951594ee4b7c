"""The "Workspaces behind their head" tile and "Retry materialization now": the tile counts
the workspaces whose cwd does not hold the head (a recorded failure, or over a minute behind)
and names the latest error and its next attempt; it opens the workspace list filtered to
exactly those; the action defers the materialization job at once, audited, and says per
workspace what it did (docs/snapshots.md#when-materialization-fails)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.messages import get_messages
from django.db.models.functions import Now
from django.urls import reverse
from procrastinate.contrib.django.models import ProcrastinateJob

from paperclip.models import ActivityEvent, Company, ExecutionWorkspace
from paperclip.snapshots.behind import (
    MATERIALIZE_TASK,
    WorkspaceNotFound,
    workspace_materialize_retry,
)
from paperclip.snapshots.trees import blob_name
from recovery.console.attention import attention_summary
from recovery.console.site import tile_url
from tests.console.test_pages import staff
from tests.paperclip.factories import CompanyFactory, ExecutionWorkspaceFactory

pytestmark = pytest.mark.django_db

WORKSPACES = reverse("admin:paperclip_executionworkspace_changelist")
HEAD, OLD = blob_name(b"head"), blob_name(b"old")


def _workspace(company: Company, name: str, **state: object) -> ExecutionWorkspace:
    workspace = ExecutionWorkspaceFactory(company=company, name=name, cwd=f"/srv/ws/{name}")
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(**state)
    workspace.refresh_from_db()
    return workspace


def _behind(company: Company) -> dict[str, ExecutionWorkspace]:
    long_ago = Now() - timedelta(minutes=5)
    return {
        "failed": _workspace(
            company,
            "failed",
            head_tree=HEAD,
            cwd_tree=OLD,
            head_committed_at=Now(),
            materialize_error="OSError: [Errno 28] No space left on device",
            materialize_failed_at=Now(),
            materialize_attempts=3,
            materialize_next_at=Now() + timedelta(minutes=2),
        ),
        "stuck": _workspace(
            company, "stuck", head_tree=HEAD, cwd_tree=None, head_committed_at=long_ago
        ),
        # Not counted: just moved (its job is at work), at its head, no cwd, no head.
        "fresh": _workspace(
            company, "fresh", head_tree=HEAD, cwd_tree=OLD, head_committed_at=Now()
        ),
        "current": _workspace(
            company, "current", head_tree=HEAD, cwd_tree=HEAD, head_committed_at=long_ago
        ),
        "no-cwd": _workspace(
            company, "no-cwd", cwd=None, head_tree=HEAD, head_committed_at=long_ago
        ),
        "empty": _workspace(company, "empty", head_committed_at=long_ago),
    }


def _tile(company_ids: list[object] | None) -> object:
    summary = attention_summary(company_ids=company_ids, include_jobs=False)
    return next(t for t in summary.tiles if t.kind == "workspace_behind_head")


def test_the_tile_counts_failed_and_long_behind_workspaces_and_names_the_latest_error(
    company: Company,
) -> None:
    _behind(company)
    _behind(CompanyFactory())  # another company's: not counted
    tile = _tile([company.pk])
    assert tile.count == 2
    assert tile.oldest_at is not None
    assert "No space left on device" in tile.hint
    assert "attempt 3" in tile.hint
    assert "next attempt 20" in tile.hint  # a date, in UTC
    client = staff(company)
    listed = client.get(tile_url(tile.kind, tile.detail))
    assert listed.status_code == 200
    assert listed.context["cl"].result_count == 2
    html = listed.content.decode()
    assert "No space left on device" in html
    assert "behind its head" in html
    dashboard = client.get(reverse("admin:index")).content.decode()
    assert 'data-kind="workspace_behind_head"' in dashboard
    assert "Workspaces behind their head" in dashboard


def test_a_workspace_that_catches_up_leaves_the_tile(company: Company) -> None:
    workspaces = _behind(company)
    ExecutionWorkspace.objects.filter(pk=workspaces["failed"].pk).update(
        cwd_tree=HEAD, materialize_error=None, materialize_next_at=None
    )
    tile = _tile([company.pk])
    assert tile.count == 1
    assert "No space left" not in tile.hint


def _retry(client: object, *workspaces: ExecutionWorkspace) -> str:
    response = client.post(  # type: ignore[attr-defined]
        WORKSPACES,
        {"action": "retry_materialization", "_selected_action": [str(w.pk) for w in workspaces]},
    )
    assert response.status_code == 302
    return " ".join(str(m) for m in get_messages(response.wsgi_request))


def _retries() -> int:
    return ActivityEvent.objects.filter(action="workspace.materialize_retry_requested").count()


def test_retry_materialization_now_defers_the_job_at_once_and_says_what_it_did(
    company: Company,
) -> None:
    workspaces = _behind(company)
    client = staff(company)
    said = _retry(client, workspaces["failed"], workspaces["current"], workspaces["no-cwd"])
    job = ProcrastinateJob.objects.get(task_name=MATERIALIZE_TASK, status="todo")
    assert job.args == {"workspace_id": str(workspaces["failed"].pk)}
    assert f"failed: job {job.pk} deferred" in said
    assert "current: the cwd already holds the head" in said
    assert "no-cwd: no cwd, nothing to materialize" in said
    assert _retries() == 1
    (event,) = ActivityEvent.objects.filter(action="workspace.materialize_retry_requested")
    assert event.details["jobId"] == job.pk
    failed = ExecutionWorkspace.objects.get(pk=workspaces["failed"].pk)
    assert failed.materialize_next_at is not None
    assert failed.materialize_error is not None  # cleared by the success, not by the request
    # Again while that job waits: nothing new is written, and the message says so.
    again = _retry(client, workspaces["failed"])
    assert "failed: a materialization job was already waiting" in again
    assert _retries() == 1
    assert ProcrastinateJob.objects.filter(task_name=MATERIALIZE_TASK).count() == 1


def test_another_companys_workspace_is_not_found(company: Company) -> None:
    theirs = _behind(CompanyFactory())["failed"]
    with pytest.raises(WorkspaceNotFound):
        workspace_materialize_retry(workspace_id=theirs.pk, company_ids=[company.pk], actor_id="1")
    client = staff(company)
    response = client.post(
        WORKSPACES, {"action": "retry_materialization", "_selected_action": [str(theirs.pk)]}
    )
    assert not ProcrastinateJob.objects.filter(task_name=MATERIALIZE_TASK).exists()
    assert response.status_code in (200, 302)
    assert _retries() == 0


def test_the_workspace_page_says_why_and_offers_the_retry_only_when_behind(
    company: Company,
) -> None:
    workspaces = _behind(company)
    client = staff(company)

    def page(name: str) -> str:
        url = reverse("admin:paperclip_executionworkspace_change", args=[workspaces[name].pk])
        response = client.get(url)
        assert response.status_code == 200
        return response.content.decode()

    failed = page("failed")
    assert 'data-console-action="retry_materialization"' in failed
    assert "Materialization failed: OSError: [Errno 28] No space left on device" in failed
    assert "Failures in a row: 3" in failed
    assert 'data-console-action="retry_materialization"' in page("stuck")
    assert 'data-console-action="retry_materialization"' not in page("current")
    assert 'data-console-action="retry_materialization"' not in page("no-cwd")
    assert not ActivityEvent.objects.exists()  # reading writes nothing
