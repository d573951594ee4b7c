"""A short chaos run of the runtime leases against the test database (tests/chaos/run.py).

Duration, agents, workspaces and seed come from PAPERCLIP_CHAOS_DURATION (default 90 s),
PAPERCLIP_CHAOS_AGENTS (5), PAPERCLIP_CHAOS_WORKSPACES (3) and PAPERCLIP_CHAOS_SEED (1).
The figures are printed whatever the outcome; the checker must pass, and every process the
run started must be gone. The second run adds PostgreSQL failovers and a web node cut off
from its database (PAPERCLIP_CHAOS_FAILOVER_DURATION, default 45 s): it needs the machine's
PostgreSQL binaries and root (network namespaces), and fails rather than skips under CI=true.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest

from tests.chaos.nemesis import DEFAULT_WEIGHTS
from tests.chaos.run import BIRTHS, Config, Outcome, note_birth, run_chaos
from tests.support.netns import IsolatedNode
from tests.support.replication import ReplicatedCluster, postgres_bindir


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_chaos_run_passes_the_checker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = Config(
        duration=float(os.environ.get("PAPERCLIP_CHAOS_DURATION", "90")),
        agents=int(os.environ.get("PAPERCLIP_CHAOS_AGENTS", "5")),
        workspaces=int(os.environ.get("PAPERCLIP_CHAOS_WORKSPACES", "3")),
        seed=int(os.environ.get("PAPERCLIP_CHAOS_SEED", "1")),
    )
    with capsys.disabled():
        print()
        outcome = run_chaos(config, workdir=tmp_path)
        print(outcome.summary)
    figures = outcome.figures
    assert outcome.report.ok, "\n".join(v.render() for v in outcome.report.violations[:20])
    assert figures["requests"] > 0
    assert figures["healthz_at_end"] == 200
    assert sum(figures["faults"].values()) > 0
    assert "agent_exit" not in figures["faults"]  # no agent died by itself
    assert figures["nemesis_errors"] == []
    assert outcome.leftovers() == []


@pytest.mark.slow
def test_a_chaos_run_with_failovers_and_a_node_cut_off_passes_the_checker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same run on a replicated cluster of its own with the server in a network namespace,
    every fault weighted, `failover` and `cut_node` the most: nothing acknowledged lost and no
    violation across primaries killed and promoted, and a node cut off from its database."""
    try:
        postgres_bindir()
        if os.geteuid() != 0:
            raise RuntimeError("network namespaces need root")
    except RuntimeError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {exc}")
        pytest.skip(str(exc))
    config = Config(
        duration=float(os.environ.get("PAPERCLIP_CHAOS_FAILOVER_DURATION", "45")),
        agents=4,
        workspaces=2,
        seed=int(os.environ.get("PAPERCLIP_CHAOS_SEED", "1")),
        gunicorn_workers=2,
        weights={**DEFAULT_WEIGHTS, "failover": 3, "cut_node": 3},
    )
    cluster = ReplicatedCluster(synchronous=True)
    node = IsolatedNode(1)
    try:
        node.create()
        cluster.start()
        with capsys.disabled():
            print()
            outcome = run_chaos(config, workdir=tmp_path, cluster=cluster, node=node)
            print(outcome.summary)
    finally:
        cluster.stop()
        node.destroy()
    figures = outcome.figures
    assert outcome.report.ok, "\n".join(v.render() for v in outcome.report.violations[:20])
    assert figures["faults"].get("failover", 0) >= 1
    assert figures["faults"].get("cut_node", 0) >= 1
    assert figures["healthz_at_end"] == 200
    assert figures["nemesis_errors"] == []
    assert outcome.leftovers() == []


def test_a_leftover_is_a_process_of_the_run_not_a_pid_used_again() -> None:
    """The check that every process of a run is gone: a pid alive with the start the run saw
    is a leftover; the same pid with another start is another process (pids are reused)."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        note_birth(child.pid)
        outcome = Outcome(
            report=cast(Any, None),
            summary="",
            figures={},
            pids=[child.pid],
            births={child.pid: BIRTHS[child.pid]},
        )
        assert outcome.leftovers() == [child.pid]
        outcome.births[child.pid] -= 100.0  # as if the run had seen another process there
        assert outcome.leftovers() == []
    finally:
        child.kill()
        child.wait()
    outcome.births[child.pid] += 100.0
    assert outcome.leftovers() == []
