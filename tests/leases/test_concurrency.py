"""Real-connection races, each forced (every contender seen queued behind a lock a separate
connection holds): threads, separate OS processes, and fixed interleavings (contended claim,
lock timeout, fenced write vs reclaim)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.db import connection

import leases.services.operations
import paperclip.db.locking
from leases.errors import ExecutionWorkspaceNotFound, RuntimeLeaseConflict, RuntimeLeaseContended
from leases.models import WorkspaceRuntimeLease
from leases.services import (
    RuntimeLeaseOwner,
    runtime_lease_get,
    workspace_operation_create_fenced,
)
from paperclip.errors import DomainError, ResourceBusy
from paperclip.models import ExecutionWorkspace, WorkspaceOperation
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.leases.factories import claim, expire
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    ExecutionWorkspaceFactory,
    HeartbeatRunFactory,
    IssueFactory,
)
from tests.support.processes import child_env

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]

THREADS = 8
TIMEOUT = 15
ROOT = Path(__file__).resolve().parents[2]


def race(workspace, agents):
    """Every agent claims `workspace` at once; returns sorted outcomes (errors by code).

    Forced, not hoped for: a separate connection holds the workspace row (the lock every
    claim's transaction takes first), every claim is seen waiting for it at once, and only
    then does it let go."""

    def attempt(agent):
        try:
            return claim(workspace, agent).outcome
        except DomainError as exc:
            return exc.code
        finally:
            connection.close()

    with raw_connection(autocommit=False) as gate:
        hold_workspace_row(gate, workspace)
        with ThreadPoolExecutor(max_workers=len(agents)) as pool:
            futures = [pool.submit(attempt, agent) for agent in agents]
            all_waiting = wait_for_lock_waiters(
                len(agents),
                until=lambda: any(f.done() for f in futures),
                holder=gate,
                table="execution_workspaces",
            )
            gate.rollback()
            outcomes = sorted(f.result(timeout=TIMEOUT) for f in futures)
    assert all_waiting, f"a claim went past the held workspace row without waiting: {outcomes}"
    return outcomes


def hold_workspace_row(gate, workspace):
    # The claim's own lock mode: FOR UPDATE would also queue the lease insert's foreign-key
    # check (FOR KEY SHARE) behind it, a wait the claim's own lock has nothing to do with.
    gate.execute(
        "SELECT 1 FROM execution_workspaces WHERE id = %s FOR NO KEY UPDATE", [workspace.pk]
    )


def test_eight_agents_racing_for_a_free_workspace_get_one_winner():
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    agents = AgentFactory.create_batch(THREADS, company=company)

    outcomes = race(workspace, agents)

    assert outcomes == ["created"] + ["workspace_runtime_lease_conflict"] * (THREADS - 1)
    assert WorkspaceRuntimeLease.objects.filter(execution_workspace=workspace).count() == 1
    assert WorkspaceRuntimeLease.objects.get(execution_workspace=workspace).generation == 1
    workspace.refresh_from_db()
    assert workspace.runtime_lease_generation == 1


def test_the_same_owner_racing_itself_creates_once_and_renews():
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    agent = AgentFactory(company=company)

    outcomes = race(workspace, [agent] * THREADS)

    assert outcomes == ["created"] + ["renewed"] * (THREADS - 1)
    assert WorkspaceRuntimeLease.objects.get(execution_workspace=workspace).generation == 1


def test_eight_agents_racing_to_reclaim_a_stale_lease_get_one_new_generation():
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    claim(workspace, AgentFactory(company=company))
    expire(workspace)
    agents = AgentFactory.create_batch(THREADS, company=company)

    outcomes = race(workspace, agents)

    assert outcomes == ["reclaimed"] + ["workspace_runtime_lease_conflict"] * (THREADS - 1)
    assert WorkspaceRuntimeLease.objects.get().generation == 2
    workspace.refresh_from_db()
    assert workspace.runtime_lease_generation == 2


CHILD = """
import json, os, sys, uuid
import django
django.setup()
from django.db import connection
from leases.services import RuntimeLeaseOwner, runtime_lease_claim
from paperclip.errors import DomainError
connection.ensure_connection()  # connected before the start signal: the claims race, not setup
print("ready", flush=True)
sys.stdin.readline()  # the start signal, sent to every child at once
try:
    outcome = runtime_lease_claim(
        company_id=uuid.UUID(os.environ["COMPANY"]),
        execution_workspace_id=uuid.UUID(os.environ["WORKSPACE"]),
        action="start",
        owner=RuntimeLeaseOwner.for_agent(uuid.UUID(os.environ["AGENT"])),
    ).outcome
except DomainError as exc:
    outcome = exc.code
print(json.dumps({"outcome": outcome}), flush=True)
"""


@pytest.mark.slow
def test_eight_processes_racing_for_a_workspace_get_one_winner():
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    agents = AgentFactory.create_batch(THREADS, company=company)
    env_base = child_env(COMPANY=str(company.pk), WORKSPACE=str(workspace.pk))
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**env_base, "AGENT": str(agent.pk)},
        )
        for agent in agents
    ]
    try:
        for child in children:  # every child is connected-ready before any may start
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with raw_connection(autocommit=False) as gate:
            hold_workspace_row(gate, workspace)
            for child in children:
                child.stdin.write("go\n")
                child.stdin.flush()
            # Evidence of the overlap: all eight claims queue behind the held workspace row.
            all_waiting = wait_for_lock_waiters(
                THREADS,
                until=lambda: any(c.poll() is not None for c in children),
                holder=gate,
                table="execution_workspaces",
            )
            gate.rollback()
        outcomes = sorted(
            json.loads(child.communicate(timeout=60)[0].strip().splitlines()[-1])["outcome"]
            for child in children
        )
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()

    assert all_waiting, f"a child's claim went past the held workspace row: {outcomes}"
    assert outcomes == ["created"] + ["workspace_runtime_lease_conflict"] * (THREADS - 1)
    assert WorkspaceRuntimeLease.objects.filter(execution_workspace=workspace).count() == 1
    assert WorkspaceRuntimeLease.objects.get(execution_workspace=workspace).generation == 1


def test_a_release_between_insert_conflict_and_row_lock_is_contended():
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    claim(workspace, AgentFactory(company=company))
    rival = AgentFactory(company=company)

    with raw_connection(autocommit=False) as holder:
        # The holder locks the row (as a release in progress would), so the rival's insert
        # sees a committed row and conflicts, then waits for the row lock.
        holder.execute(
            "SELECT 1 FROM execution_workspace_runtime_leases"
            " WHERE execution_workspace_id = %s FOR UPDATE",
            [workspace.pk],
        )

        def rival_claim():
            try:
                return claim(workspace, rival)
            finally:
                connection.close()

        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(rival_claim)
            wait_for_lock_waiters()
            holder.execute(
                "DELETE FROM execution_workspace_runtime_leases WHERE execution_workspace_id = %s",
                [workspace.pk],
            )
            holder.commit()
            with pytest.raises(RuntimeLeaseContended) as caught:
                future.result(timeout=TIMEOUT)

    assert caught.value.details["execution_workspace_id"] == str(workspace.pk)
    assert not WorkspaceRuntimeLease.objects.exists()
    # The retry the error asks for succeeds with a generation never handed out before.
    assert claim(workspace, rival).lease.generation == 2


def test_a_renew_committed_while_a_reclaim_waits_turns_the_reclaim_into_a_conflict():
    """The reclaim judges staleness on the row as it is once locked, not as it was when the
    claim began: the holder renewing its expired lease meanwhile keeps the lane."""
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    holder = AgentFactory(company=company)
    claim(workspace, holder)
    expire(workspace)
    rival = AgentFactory(company=company)

    with raw_connection(autocommit=False) as renewer:
        # The holder's renew in flight: the row is locked, the expiry not yet moved.
        renewer.execute(
            "SELECT 1 FROM execution_workspace_runtime_leases"
            " WHERE execution_workspace_id = %s FOR UPDATE",
            [workspace.pk],
        )

        def rival_claim():
            try:
                return claim(workspace, rival)
            finally:
                connection.close()

        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(rival_claim)
            wait_for_lock_waiters()
            renewer.execute(
                "UPDATE execution_workspace_runtime_leases"
                " SET expires_at = now() + interval '30 minutes', renewed_at = now()"
                " WHERE execution_workspace_id = %s",
                [workspace.pk],
            )
            renewer.commit()
            with pytest.raises(RuntimeLeaseConflict) as caught:
                future.result(timeout=TIMEOUT)

    assert caught.value.details["owner_key"] == f"agent:{holder.pk}"
    lease = WorkspaceRuntimeLease.objects.get()
    assert (lease.owner_key, lease.generation) == (f"agent:{holder.pk}", 1)
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).runtime_lease_generation == 1


def test_a_held_row_lock_turns_into_resource_busy_not_a_hang(monkeypatch):
    monkeypatch.setattr(paperclip.db.locking, "HOT_PATH_LOCK_TIMEOUT", "200ms")
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    agent = AgentFactory(company=company)
    claim(workspace, agent)

    with raw_connection(autocommit=False) as holder:
        holder.execute(
            "SELECT 1 FROM execution_workspace_runtime_leases"
            " WHERE execution_workspace_id = %s FOR UPDATE",
            [workspace.pk],
        )
        started = time.monotonic()
        with pytest.raises(ResourceBusy):
            claim(workspace, agent)  # the renew fast path waits on the row
        assert time.monotonic() - started < TIMEOUT
        holder.rollback()
    assert claim(workspace, agent).outcome == "renewed"


def test_a_reclaim_waits_for_an_in_flight_fenced_write_and_fences_the_next(monkeypatch):
    """The real service's write holds the lease row (FOR SHARE) until it commits: a reclaim
    started mid-write must wait for it, so the write lands under the old generation and the
    holder's next write is refused. (Without the service's row lock the reclaim would finish
    while the write is still open, and the write would then commit after the reclaim.)"""
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    holder_agent, rival = AgentFactory.create_batch(2, company=company)
    claim(workspace, holder_agent)
    expire(workspace)
    owner = RuntimeLeaseOwner.for_agent(holder_agent.pk)
    in_write, finish_write = threading.Event(), threading.Event()
    real_audit = leases.services.operations.audit

    def audit_then_pause(**kwargs):
        real_audit(**kwargs)
        if kwargs["action"] == "workspace_operation.recorded":
            # Inside the write's transaction, after the operation row: hold it open here.
            in_write.set()
            assert finish_write.wait(TIMEOUT)

    monkeypatch.setattr(leases.services.operations, "audit", audit_then_pause)

    def write():
        try:
            return workspace_operation_create_fenced(
                company_id=company.pk,
                execution_workspace_id=workspace.pk,
                owner=owner,
                generation=1,
                phase="runtime_start",
                status="running",
            )
        finally:
            connection.close()

    def reclaim():
        try:
            return claim(workspace, rival)
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=2) as pool:
        written = pool.submit(write)
        assert in_write.wait(TIMEOUT)
        reclaimed = pool.submit(reclaim)
        waited = wait_for_lock_waiters(until=reclaimed.done)
        finished_early = reclaimed.done()
        finish_write.set()
        assert written.result(timeout=TIMEOUT).lease_generation == 1
        assert reclaimed.result(timeout=TIMEOUT).outcome == "reclaimed"
    assert waited, "the reclaim did not wait for the in-flight fenced write"
    assert not finished_early

    with pytest.raises(DomainError) as caught:
        workspace_operation_create_fenced(
            company_id=company.pk,
            execution_workspace_id=workspace.pk,
            owner=owner,
            generation=1,
            phase="runtime_stop",
            status="running",
        )
    assert caught.value.code == "workspace_runtime_lease_superseded"
    assert caught.value.details["current_generation"] == 2
    assert list(WorkspaceOperation.objects.values_list("lease_generation", flat=True)) == [1]


def test_fenced_writes_racing_a_reclaim_never_land_under_a_superseded_generation():
    """Writers with generation 1 and a reclaim, forced to contend: a separate connection holds
    the lease row, all of them are seen waiting for it at once (the writers on their FOR SHARE
    fence, the reclaim on its FOR UPDATE), then it lets go. Whatever order the lock manager
    picks, each write is either accepted under generation 1 or refused as superseded (never an
    error), and once the reclaim has committed generation 1 can write nothing more. (The
    ordering itself is pinned by the deterministic test above.)"""
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    holder_agent, rival = AgentFactory.create_batch(2, company=company)
    claim(workspace, holder_agent)
    expire(workspace)
    owner = RuntimeLeaseOwner.for_agent(holder_agent.pk)

    def write(i):
        try:
            workspace_operation_create_fenced(
                company_id=company.pk,
                execution_workspace_id=workspace.pk,
                owner=owner,
                generation=1,
                phase=f"write-{i}",
                status="succeeded",
            )
            return "accepted"
        except DomainError as exc:
            return exc.code
        finally:
            connection.close()

    def reclaim():
        try:
            return claim(workspace, rival).outcome
        finally:
            connection.close()

    with raw_connection(autocommit=False) as gate:
        gate.execute(
            "SELECT 1 FROM execution_workspace_runtime_leases"
            " WHERE execution_workspace_id = %s FOR UPDATE",
            [workspace.pk],
        )
        with ThreadPoolExecutor(max_workers=THREADS) as pool:
            writes = [pool.submit(write, i) for i in range(THREADS - 1)]
            reclaimed = pool.submit(reclaim)
            # Evidence of the overlap: every contender is waiting for the row at once.
            all_waiting = wait_for_lock_waiters(
                THREADS, until=lambda: any(f.done() for f in [*writes, reclaimed])
            )
            gate.rollback()
            results = [w.result(timeout=TIMEOUT) for w in writes]
            assert reclaimed.result(timeout=TIMEOUT) == "reclaimed"
    assert all_waiting, f"a contender went past the held lease row without waiting: {results}"

    assert set(results) <= {"accepted", "workspace_runtime_lease_superseded"}
    lease = WorkspaceRuntimeLease.objects.get()
    assert lease.generation == 2
    assert set(WorkspaceOperation.objects.values_list("lease_generation", flat=True)) <= {1}
    assert WorkspaceOperation.objects.count() == results.count("accepted")
    with pytest.raises(DomainError) as late:
        workspace_operation_create_fenced(
            company_id=company.pk,
            execution_workspace_id=workspace.pk,
            owner=owner,
            generation=1,
            phase="late",
            status="running",
        )
    assert late.value.code == "workspace_runtime_lease_superseded"
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).runtime_lease_generation == 2


def test_once_the_holders_issue_is_done_no_renew_or_write_of_the_holder_is_accepted():
    """The holder renews and writes from several connections while another connection moves
    its issue to done, forced to overlap: a separate connection holds the lease row, every
    attempt is seen queued for it, then the change (which queues for the row too: its trigger
    marks the lease owner-stale), then the row is let go. Those in-flight attempts may land
    either side of the change; every attempt started after it committed is refused as
    owner-ineligible, and the lease is reclaimable at once."""
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    agent = AgentFactory(company=company)
    issue = IssueFactory(company=company, status="in_progress")
    run = HeartbeatRunFactory(company=company, agent=agent, status="running")
    ids = {"issue_id": issue.pk, "run_id": run.pk}
    generation = claim(workspace, agent, **ids).lease.generation
    owner = RuntimeLeaseOwner.for_agent(agent.pk, **ids)
    holders = THREADS - 1
    post_commit_attempts = 3

    def renew():
        return claim(workspace, agent, **ids).outcome

    def write():
        workspace_operation_create_fenced(
            company_id=company.pk,
            execution_workspace_id=workspace.pk,
            owner=owner,
            generation=generation,
            phase="runtime_repair",
            status="succeeded",
        )
        return "accepted"

    def attempt(act):
        try:
            return act()
        except DomainError as exc:
            return exc.code

    changed = threading.Event()

    def holder(i):
        act = renew if i % 2 == 0 else write
        try:
            in_flight = attempt(act)  # queued behind the gate, as is the change
            assert changed.wait(timeout=TIMEOUT)
            return act.__name__, in_flight, [attempt(act) for _ in range(post_commit_attempts)]
        finally:
            connection.close()

    def change():
        with raw_connection() as other:  # autocommit: committed when execute returns
            other.execute(
                "UPDATE issues SET status = 'done', updated_at = now() WHERE id = %s",
                [issue.pk],
            )
        changed.set()

    # Before the change every kind of attempt is accepted.
    assert (renew(), write()) == ("renewed", "accepted")
    with raw_connection(autocommit=False) as gate:
        gate.execute(
            "SELECT 1 FROM execution_workspace_runtime_leases"
            " WHERE execution_workspace_id = %s FOR UPDATE",
            [workspace.pk],
        )
        with ThreadPoolExecutor(max_workers=holders + 1) as pool:
            futures = [pool.submit(holder, i) for i in range(holders)]
            all_waiting = wait_for_lock_waiters(
                holders,
                until=lambda: any(f.done() for f in futures),
                holder=gate,
                table="execution_workspace_runtime_leases",
            )
            changing = pool.submit(change)
            change_waiting = wait_for_lock_waiters(
                holders + 1,
                until=changing.done,
                holder=gate,
                table="execution_workspace_runtime_leases",
            )
            gate.rollback()
            changing.result(timeout=TIMEOUT)
            results = [f.result(timeout=TIMEOUT) for f in futures]
    assert all_waiting, f"an attempt went past the held lease row: {results}"
    assert change_waiting, "the issue's change did not wait for the lease row it marks"

    accepted_writes = 1  # the one before the change
    for kind, in_flight, after in results:
        ok = "renewed" if kind == "renew" else "accepted"
        assert in_flight in (ok, "workspace_runtime_lease_owner_ineligible"), (kind, in_flight)
        assert after == ["workspace_runtime_lease_owner_ineligible"] * post_commit_attempts, (
            kind,
            after,
        )
        accepted_writes += in_flight == "accepted"
    assert WorkspaceOperation.objects.count() == accepted_writes
    lease = WorkspaceRuntimeLease.objects.get()
    assert (lease.owner_key, lease.generation) == (f"issue:{issue.pk}", generation)
    assert runtime_lease_get(execution_workspace_id=workspace.pk).stale_reason == (
        "owner_issue_terminal"
    )
    reclaimed = claim(workspace, AgentFactory(company=company))
    assert (reclaimed.outcome, reclaimed.lease.generation) == ("reclaimed", generation + 1)


def test_agents_racing_against_a_live_holder_all_get_the_conflict_not_a_lease():
    """Under real contention (every claim queued behind the workspace row at once), a live
    holder is reported to each rival as the conflict: never swallowed, never a reclaim."""
    company = CompanyFactory()
    workspace = ExecutionWorkspaceFactory(company=company)
    holder = AgentFactory(company=company)
    claim(workspace, holder)

    outcomes = race(workspace, AgentFactory.create_batch(THREADS, company=company))

    assert outcomes == ["workspace_runtime_lease_conflict"] * THREADS
    lease = WorkspaceRuntimeLease.objects.get()
    assert (lease.owner_key, lease.generation) == (f"agent:{holder.pk}", 1)


def test_a_workspace_deleted_while_a_claim_waits_for_its_row_is_not_found():
    """The claim checked the workspace, then waits for its row lock behind a transaction that
    deletes it: once the delete commits, the lock finds no row and the claim answers "no such
    workspace" (nothing written), not an error."""
    company = CompanyFactory()
    agent = AgentFactory(company=company)
    workspace = ExecutionWorkspaceFactory(company=company)
    with raw_connection(autocommit=False) as deleter:
        deleter.execute("DELETE FROM execution_workspaces WHERE id = %s", [workspace.pk])
        with ThreadPoolExecutor(max_workers=1) as pool:

            def attempt():
                try:
                    return claim(workspace, agent)
                finally:
                    connection.close()

            outcome = pool.submit(attempt)
            assert wait_for_lock_waiters(
                1, until=outcome.done, holder=deleter, table="execution_workspaces"
            )
            deleter.commit()
            with pytest.raises(ExecutionWorkspaceNotFound):
                outcome.result(timeout=30)
    assert not WorkspaceRuntimeLease.objects.filter(execution_workspace_id=workspace.pk).exists()
