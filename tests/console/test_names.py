"""Names beside ids on every list and page that shows an agent's, issue's, workspace's or run's
id (docs/runbook.md, "Names beside ids"): coordinators, checkpoint parts, run results, workspace
snapshots and heads, issues' runs, stop receipts, environment leases, recovery actions and the
worker's jobs, each list in a number of queries that does not grow with its rows."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from checkpoints.models import NativeRunnerCheckpoint
from leases.models import EnvironmentLease
from paperclip.models import Company, ExecutionWorkspace, ExecutionWorkspaceSnapshot, JobError
from recovery.models import WorkerStopReceipt
from recovery.services import finalization_defer_in_tx
from tests.console.helpers import checkpoint_part
from tests.console.test_pages import staff
from tests.leases.environment.factories import EnvironmentLeaseFactory
from tests.paperclip.factories import UserFactory
from tests.recovery.factories import Binding, RecoveryActionFactory, make_binding

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def named(company: Company, tag: str) -> Binding:
    """A run of agent `agent{tag}` on issue `Issue{tag}` in workspace `ws{tag}`, with its
    coordinator, accepted result, a checkpoint part, a workspace snapshot and head, a stop
    receipt, an environment lease and a finalization job (failed, with its error)."""
    b = make_binding(company=company)
    b.agent.name = f"agent{tag}"
    b.agent.save(update_fields=["name"])
    b.issue.title = f"Issue{tag}"
    b.issue.save(update_fields=["title"])
    ExecutionWorkspace.objects.filter(pk=b.workspace.pk).update(name=f"ws{tag}", head_run=b.run)
    checkpoint_part(b)
    ExecutionWorkspaceSnapshot.objects.create(company=company, execution_workspace=b.workspace)
    WorkerStopReceipt.objects.create(
        company=company,
        run=b.run,
        owner_token=f"token{tag}",
        worker_id=f"worker{tag}",
        stopped_at="2026-12-01T12:00:00Z",
        signature="sig",
    )
    EnvironmentLeaseFactory(company=company, heartbeat_run=b.run)
    RecoveryActionFactory(company=company, source_issue=b.issue, evidence={"runId": str(b.run.pk)})
    job_id = finalization_defer_in_tx(company_id=company.pk, run_id=b.run.pk)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE procrastinate_jobs SET status = 'failed' WHERE id = %s", [job_id])
    JobError.objects.create(job_id=job_id, task_name="finalize_run", attempt=1, error=f"boom{tag}")
    return b


def superuser() -> Client:
    client = Client()
    client.force_login(UserFactory(is_superuser=True, is_staff=True))
    return client


def run_named(b: Binding) -> str:
    return f'run of {b.agent.name} <span class="console-id">({str(b.run.pk)[:8]})</span>'


def issue_named(b: Binding) -> str:
    return f'{b.issue.title} <span class="console-id">({str(b.issue.pk)[:8]})</span>'


def workspace_named(b: Binding) -> str:
    return f'ws-n <span class="console-id">({str(b.workspace.pk)[:8]})</span>'


# Each list, and the names it shows beside ids.
NAMED_LISTS: dict[str, tuple[Any, ...]] = {
    "admin:paperclip_nativerunfinalization_changelist": (run_named, issue_named),
    "admin:checkpoints_nativerunnercheckpoint_changelist": (run_named, issue_named),
    "admin:paperclip_nativerunresult_changelist": (run_named, issue_named),
    "admin:paperclip_executionworkspacesnapshot_changelist": (workspace_named,),
    "admin:paperclip_issue_changelist": (run_named,),
    "admin:recovery_workerstopreceipt_changelist": (run_named,),
    "admin:leases_environmentlease_changelist": (run_named,),
    "admin:procrastinate_procrastinatejob_changelist": (run_named,),
    "admin:recovery_issuerecoveryaction_changelist": (run_named,),
}


@pytest.mark.parametrize("name", NAMED_LISTS)
def test_lists_show_names_beside_short_ids(company: Company, name: str) -> None:
    b = named(company, "-n")
    html = superuser().get(reverse(name)).content.decode()
    for expected in NAMED_LISTS[name]:
        assert expected(b) in html
    target = (
        ("paperclip_heartbeatrun", b.run.pk)
        if run_named in NAMED_LISTS[name]
        else ("paperclip_executionworkspace", b.workspace.pk)
    )
    assert f'href="{reverse(f"admin:{target[0]}_change", args=[target[1]])}"' in html


@pytest.mark.parametrize("name", NAMED_LISTS)
def test_named_lists_read_a_bounded_number_of_queries(
    company: Company, name: str, django_assert_max_num_queries: Any
) -> None:
    client = superuser() if "procrastinate" in name else staff(company)
    named(company, "-a")
    with CaptureQueriesContext(connection) as few:
        assert client.get(reverse(name)).status_code == 200
    for n in range(4):
        named(company, f"-b{n}")
    with django_assert_max_num_queries(len(few)):
        html = client.get(reverse(name)).content.decode()
    assert "agent-b3" in html or "ws-b3" in html


def test_the_jobs_page_says_what_each_job_is_about_and_how_it_failed(company: Company) -> None:
    b = named(company, "-n")
    html = superuser().get(reverse("admin:procrastinate_procrastinatejob_changelist")).content
    page = html.decode()
    assert f'{company.name} <span class="console-id">({str(company.pk)[:8]})</span>' in page
    assert run_named(b) in page
    assert "boom-n" in page


def test_detail_pages_are_titled_with_names(company: Company) -> None:
    b = named(company, "-n")
    client = staff(company)
    short = str(b.run.pk)[:8]

    def page(name: str, pk: Any) -> str:
        response = client.get(reverse(name, args=[pk]))
        assert response.status_code == 200
        return response.content.decode()

    coordinator = page("admin:paperclip_nativerunfinalization_change", b.run.pk)
    assert f"coordinator of run of agent-n ({short}) on “Issue-n”" in coordinator
    part = NativeRunnerCheckpoint.objects.get(run=b.run)
    checkpoint = page("admin:checkpoints_nativerunnercheckpoint_change", part.pk)
    assert f"session.jsonl of run of agent-n ({short}) on “Issue-n”" in checkpoint
    assert run_named(b) in checkpoint
    assert b.result is not None
    result = page("admin:paperclip_nativerunresult_change", b.result.pk)
    assert f"of run of agent-n ({short}) on “Issue-n”" in result
    snapshot = ExecutionWorkspaceSnapshot.objects.get(execution_workspace=b.workspace)
    snap = page("admin:paperclip_executionworkspacesnapshot_change", snapshot.pk)
    assert f"of ws-n ({str(b.workspace.pk)[:8]})" in snap
    # A workspace's head, an issue's runs, a receipt's run and an environment lease's run.
    assert run_named(b) in page("admin:paperclip_executionworkspace_change", b.workspace.pk)
    assert run_named(b) in page("admin:paperclip_issue_change", b.issue.pk)
    receipt = WorkerStopReceipt.objects.get(run=b.run)
    assert run_named(b) in page("admin:recovery_workerstopreceipt_change", receipt.pk)
    lease = EnvironmentLease.objects.get(heartbeat_run=b.run)
    assert run_named(b) in page("admin:leases_environmentlease_change", lease.pk)
