"""A finalization nemesis: worker processes finalizing several runs while a nemesis SIGKILLs
workers (restarting them), ends every database session at once (what a PostgreSQL restart or
failover does to the clients; the shared test server itself is not restarted) and a board
confirms the holds whose owner is provably dead. The checker (tests/paperclip/worker/nemesis.py)
then reads the database: never two owners, never a copy-back over a live or unproven owner, every
run committed or held for the board. The checker is shown failing on corrupted histories."""

from __future__ import annotations

import os
import random
import signal
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from django.db import connection

from paperclip.access import board_actor
from paperclip.errors import DomainError
from paperclip.models import ActivityEvent, BoardMembership, HeartbeatRun, WorkspaceOperation
from paperclip.receipts import raw_owner
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.finalization import finalization_state
from recovery.services import recovery_owner_stop_confirm
from tests.paperclip.factories import CompanyFactory, UserFactory
from tests.paperclip.worker.nemesis import Event, Op, check_finalizations
from tests.paperclip.worker.test_worker_processes import Worker
from tests.recovery.factories import make_binding

SLOW = "tests.paperclip.worker.gated_copyback.SlowCopyback"
DURATION = float(os.environ.get("PAPERCLIP_NEMESIS_SECONDS", "20"))
RUNS = 6


def _ops() -> list[Op]:
    return [
        Op(
            id=str(op.pk),
            run_id=str(op.heartbeat_run_id),
            status=op.status,
            started_at=op.started_at or op.created_at,
            finished_at=op.finished_at,
            error=(op.metadata or {}).get("error"),
        )
        for op in WorkspaceOperation.objects.filter(phase="workspace_finalize")
    ]


def _events() -> list[Event]:
    actions = (
        "run.finalization_owner_claimed",
        "run.finalization_owner_takeover",
        "run.finalization_owner_released",
        "run.finalization_committed",
        "issue.workspace_owner_stop_confirmed",
    )
    return [
        Event(str(e.run_id), e.action, e.created_at, e.details or {})
        for e in ActivityEvent.objects.filter(action__in=actions)
    ]


def _confirm_dead_owners(user: Any) -> int:
    """The board's part: confirm every hold whose recorded owner process is gone (this host)."""
    confirmed = 0
    for hold in IssueRecoveryAction.objects.filter(
        cause=OWNER_UNVERIFIED_CAUSE, status__in=("active", "escalated")
    ).exclude(evidence__has_key="workspaceOwnerStop"):
        owner = hold.evidence.get("owner") or {}
        if psutil.pid_exists(int(owner.get("pid", 0))):
            continue
        try:
            recovery_owner_stop_confirm(
                actor=board_actor(user),
                issue_id=hold.source_issue_id,
                action_id=hold.pk,
                run_id=hold.evidence["runId"],
                owner_token=owner.get("token", ""),
                stop_evidence="the nemesis killed that worker process; its pid is gone",
                controller_and_copyback_stopped=True,
            )
            confirmed += 1
        except DomainError:  # stale by now (the owner moved on): the next pass looks again
            continue
    return confirmed


def _state(run: HeartbeatRun) -> str:
    return finalization_state(HeartbeatRun.objects.get(pk=run.pk)).state


def _terminate_sessions() -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_finalizations_survive_killed_workers_and_lost_sessions(tmp_path: Path) -> None:
    company = CompanyFactory()
    runs = [make_binding(company=company, tmp_path=tmp_path / f"r{i}").run for i in range(RUNS)]
    user = UserFactory(is_staff=True)
    BoardMembership.objects.create(user=user, company=company)
    env = {"PAPERCLIP_COPYBACK_BACKEND": SLOW, "PAPERCLIP_TEST_COPY_SECONDS": "1.0"}
    rng = random.Random(7)
    faults = {"worker_sigkill": 0, "all_sessions_terminated": 0, "board_confirmations": 0}
    workers = [Worker(**env), Worker(**env)]
    try:
        deadline = time.monotonic() + DURATION
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(1.0, 2.5))
            if rng.random() < 0.5:
                victim = rng.randrange(len(workers))
                workers[victim].signal(signal.SIGKILL)
                workers[victim].proc.wait(timeout=10)
                workers[victim] = Worker(**env)
                faults["worker_sigkill"] += 1
            else:
                _terminate_sessions()
                faults["all_sessions_terminated"] += 1
            connection.close()
            faults["board_confirmations"] += _confirm_dead_owners(user)
        # Faults over: the board keeps confirming dead owners until every run settles.
        settle = time.monotonic() + 60
        while time.monotonic() < settle:
            connection.close()
            faults["board_confirmations"] += _confirm_dead_owners(user)
            states = {
                str(r.pk): finalization_state(HeartbeatRun.objects.get(pk=r.pk)).state for r in runs
            }
            if all(state == "committed" for state in states.values()):
                break
            time.sleep(0.5)
    finally:
        for worker in workers:
            worker.stop()
    connection.close()
    states = {str(r.pk): finalization_state(HeartbeatRun.objects.get(pk=r.pk)).state for r in runs}
    ops, events = _ops(), _events()
    print(f"nemesis: {faults}, final states {sorted(states.values())}, {len(ops)} copy-backs")
    assert faults["worker_sigkill"] + faults["all_sessions_terminated"] > 0
    assert check_finalizations(ops=ops, events=events, final_states=states) == []
    for run in runs:
        run.refresh_from_db()
        if states[str(run.pk)] == "committed":
            assert raw_owner(run.runner_profile_json) is None


# --- the checker fails on bad histories ------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_the_checker_passes_a_clean_history() -> None:
    events = [
        Event("r", "run.finalization_owner_claimed", _at(0), {}),
        Event("r", "run.finalization_committed", _at(2), {}),
        Event("r", "run.finalization_owner_released", _at(3), {}),
    ]
    ops = [Op("a", "r", "succeeded", _at(1), _at(2), None)]
    assert check_finalizations(ops=ops, events=events, final_states={"r": "committed"}) == []


@pytest.mark.parametrize(
    ("ops", "events", "states", "expected"),
    [
        ([], [], {"r": "waiting"}, "neither committed nor held"),
        (
            [],
            [
                Event("r", "run.finalization_owner_claimed", _at(0), {}),
                Event("r", "run.finalization_owner_claimed", _at(1), {}),
            ],
            {"r": "held"},
            "a second owner claimed",
        ),
        (
            [],
            [Event("r", "run.finalization_owner_takeover", _at(1), {"takeoverBasis": None})],
            {"r": "held"},
            "without a basis",
        ),
        (
            [],
            [
                Event("r", "run.finalization_committed", _at(1), {}),
                Event("r", "run.finalization_committed", _at(2), {}),
            ],
            {"r": "committed"},
            "committed 2 times",
        ),
        (
            [
                Op("a", "r", "running", _at(1), None, None),
                Op("b", "r", "succeeded", _at(2), _at(3), None),
            ],
            [],
            {"r": "committed"},
            "started over the running a",
        ),
        (
            [
                Op("a", "r", "succeeded", _at(1), _at(5), None),
                Op("b", "r", "succeeded", _at(2), _at(3), None),
            ],
            [Event("r", "issue.workspace_owner_stop_confirmed", _at(1.5), {})],
            {"r": "committed"},
            "more than one succeeded copy-back",
        ),
    ],
)
def test_the_checker_fails_on_a_corrupted_history(
    ops: list[Op], events: list[Event], states: dict[str, str], expected: str
) -> None:
    problems = check_finalizations(ops=ops, events=events, final_states=states)
    assert any(expected in problem for problem in problems), problems
