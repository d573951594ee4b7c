"""Two batch renews naming the same leases in opposite orders, on separate connections, never
deadlock: each statement locks its rows in id order (docs/leases.md#batch-renew).

Forced: a third connection holds the middle row; both batches are seen waiting at once (a
batch that locked in request order would by then hold the rows on its side of the middle, and
the other batch's, once the middle is let go: a deadlock), and only then is it let go."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection

from checkpoints.services import controller_lease_acquire
from checkpoints.services.controller_lease_batch import ControllerRenewItem, controller_leases_renew
from leases.services.batch_renew import RuntimeRenewItem, runtime_leases_renew
from paperclip.errors import DomainError
from tests.checkpoints.factories import TEST_KEY
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.leases.factories import claim
from tests.paperclip.factories import (
    AgentFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
    NativeRunFactory,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]
LEASES = 24
TIMEOUT = 30


def _race(renew: Any, items: list[Any], hold_sql: str, hold_id: Any) -> list[list[Any]]:
    """Renew `items` and the same items reversed at once, each on its own connection, while a
    gate holds the middle row; the two answer lists."""
    barrier = threading.Barrier(2)

    def attempt(order: list[Any]) -> list[Any]:
        try:
            barrier.wait(timeout=TIMEOUT)
            return renew(order)
        finally:
            connection.close()

    with raw_connection(autocommit=False) as gate:
        gate.execute(hold_sql, [hold_id])
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(attempt, items), pool.submit(attempt, items[::-1])]
            both_waiting = wait_for_lock_waiters(2, until=lambda: any(f.done() for f in futures))
            gate.rollback()
            answers = [f.result(timeout=TIMEOUT) for f in futures]
    assert both_waiting, "a batch went past the held row without waiting"
    return answers


def test_runtime_batches_in_opposite_orders_do_not_deadlock() -> None:
    agent = AgentFactory()
    grants = [claim(ExecutionWorkspaceFactory(company=agent.company), agent) for _ in range(LEASES)]
    leases = sorted((g.lease for g in grants if g.lease is not None), key=lambda lease: lease.id)
    items = [
        RuntimeRenewItem(execution_workspace_id=lease.execution_workspace_id, generation=1)
        for lease in leases
    ]
    middle = sorted(lease.execution_workspace_id for lease in leases)[LEASES // 2]

    def renew(order: list[RuntimeRenewItem]) -> list[Any]:
        return runtime_leases_renew(company_id=agent.company_id, agent_id=agent.pk, items=order)

    answers = _race(
        renew,
        items,
        "SELECT 1 FROM execution_workspace_runtime_leases WHERE execution_workspace_id = %s"
        " FOR NO KEY UPDATE",
        middle,
    )
    for answer in answers:
        assert not [a for a in answer if isinstance(a, DomainError)]
        assert len(answer) == LEASES


def test_controller_batches_in_opposite_orders_do_not_deadlock(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = [TEST_KEY]
    agent = AgentFactory()
    items = []
    for _ in range(LEASES):
        issue = IssueFactory(company=agent.company, assignee_agent=agent)
        run = NativeRunFactory(
            company=agent.company, agent=agent, issue=issue, native_issue=issue, status="running"
        )
        granted = controller_lease_acquire(
            run_id=run.pk, agent_id=agent.pk, boot_id="boot-a", ttl_seconds=60
        )
        items.append(
            ControllerRenewItem(run_id=run.pk, boot_id="boot-a", lease_owner=granted.lease_owner)
        )
    middle = sorted(item.run_id for item in items)[LEASES // 2]

    def renew(order: list[ControllerRenewItem]) -> list[Any]:
        return controller_leases_renew(company_id=agent.company_id, agent_id=agent.pk, items=order)

    answers = _race(
        renew,
        items,
        "SELECT 1 FROM native_run_finalizations WHERE run_id = %s FOR NO KEY UPDATE",
        middle,
    )
    for answer in answers:
        assert not [a for a in answer if isinstance(a, DomainError)]
        assert len(answer) == LEASES
