"""A short chaos run of the runtime leases against the test database (tests/chaos/run.py).

Duration, agents, workspaces and seed come from PAPERCLIP_CHAOS_DURATION (default 90 s),
PAPERCLIP_CHAOS_AGENTS (5), PAPERCLIP_CHAOS_WORKSPACES (3) and PAPERCLIP_CHAOS_SEED (1).
The figures are printed whatever the outcome; the checker must pass, and every process the
run started must be gone.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from tests.chaos.run import Config, run_chaos


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
    alive = [pid for pid in outcome.pids if psutil.pid_exists(pid)]
    assert alive == []
