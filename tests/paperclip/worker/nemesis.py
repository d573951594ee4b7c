"""The finalization checker: what must hold whatever faults hit the workers and the database.

It reads the database after a run of faults (audit rows, workspace operations, coordinators,
holds) and returns the violations, so that a test can also feed it a corrupted history.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Op:
    id: str
    run_id: str
    status: str
    started_at: datetime
    finished_at: datetime | None
    error: str | None


@dataclass(frozen=True)
class Event:
    run_id: str
    action: str
    at: datetime
    details: dict[str, Any]


def check_finalizations(
    *, ops: list[Op], events: list[Event], final_states: dict[str, str]
) -> list[str]:
    """Violations of:
    1. every run ends `committed` or `held` (waiting for the board);
    2. a run commits at most once, and has at most one succeeded copy-back;
    3. never two owners: each `owner_claimed` (no prior receipt) comes after the previous
       owner's receipt was released or confirmed stopped by the board; a `takeover` names a
       basis;
    4. never a copy-back over a live or unproven owner: a copy-back that starts while an
       earlier one of the run is still `running` needs the board's confirmation (or a takeover
       with proof) after the earlier one started, and the earlier one is then closed as
       abandoned, never succeeded.
    """
    problems: list[str] = []
    for run, state in final_states.items():
        if state not in ("committed", "held"):
            problems.append(f"run {run} ended {state}, neither committed nor held")
    by_run: dict[str, list[Event]] = defaultdict(list)
    for event in sorted(events, key=lambda e: e.at):
        by_run[event.run_id].append(event)
    for run, run_events in by_run.items():
        commits = [e for e in run_events if e.action == "run.finalization_committed"]
        if len(commits) > 1:
            problems.append(f"run {run} committed {len(commits)} times")
        holder = False
        for event in run_events:
            if event.action == "run.finalization_owner_claimed":
                if holder:
                    problems.append(f"run {run}: a second owner claimed at {event.at:%T.%f}")
                holder = True
            elif event.action == "run.finalization_owner_takeover":
                if not event.details.get("takeoverBasis"):
                    problems.append(f"run {run}: a takeover without a basis at {event.at:%T.%f}")
                holder = True
            elif event.action in (
                "run.finalization_owner_released",
                "issue.workspace_owner_stop_confirmed",
            ):
                holder = False
    ops_by_run: dict[str, list[Op]] = defaultdict(list)
    for op in ops:
        ops_by_run[op.run_id].append(op)
    for run, run_ops in ops_by_run.items():
        run_ops.sort(key=lambda o: o.started_at)
        if sum(o.status == "succeeded" for o in run_ops) > 1:
            problems.append(f"run {run}: more than one succeeded copy-back")
        for earlier, later in itertools.pairwise(run_ops):
            overlapped = earlier.finished_at is None or earlier.finished_at > later.started_at
            if not overlapped:
                continue
            authorized = any(
                e.action
                in ("issue.workspace_owner_stop_confirmed", "run.finalization_owner_takeover")
                and earlier.started_at < e.at < later.started_at
                for e in by_run.get(run, [])
            )
            if not authorized:
                problems.append(
                    f"run {run}: copy-back {later.id} started over the running {earlier.id} "
                    "with no confirmation or takeover in between"
                )
            if earlier.status == "succeeded" or (
                earlier.status == "failed"
                and earlier.error != "abandoned_by_previous_owner"
                and earlier.finished_at is not None
                and earlier.finished_at > later.started_at
            ):
                problems.append(f"run {run}: {earlier.id} kept going after {later.id} started")
    return problems
