"""A PostgreSQL failover under real work (tests/ha/failover.py runs it; docs/ha.md).

Each test builds its own primary and standby from the machine's PostgreSQL binaries (as the
`postgres` user when run as root). Where there are no binaries, or no `postgres` user to run
them as root, the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import pwd
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.ha import failover
from tests.ha.failover import FailoverReport, Probe, _check_web, overlapping_owners, run_failover
from tests.support.replication import postgres_bindir

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("failover")]


@pytest.fixture
def replication_available() -> None:
    try:
        postgres_bindir()
        if os.geteuid() == 0:
            pwd.getpwnam("postgres")
    except (RuntimeError, KeyError) as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but no replicated cluster can be built here: {exc}")
        pytest.skip(f"no replicated cluster can be built here: {exc}")


@pytest.mark.usefixtures("replication_available")
def test_synchronous_failover_loses_nothing_acknowledged(tmp_path: Path) -> None:
    report = run_failover(synchronous=True, agents=4, out=tmp_path)
    print(report.summary())
    assert report.violations == []
    # The forced race happened: two finalizations were in flight at the crash.
    assert report.figures["finalizations that took a second attempt"] >= 2
    assert report.figures["results acknowledged"] == 4
    assert report.figures["committed / held / lost"].endswith("/ 0")


@pytest.mark.usefixtures("replication_available")
def test_asynchronous_failover_keeps_every_safety_property(tmp_path: Path) -> None:
    """Asynchronous replication may lose the last acknowledged writes (docs/ha.md): counted,
    not failed; everything else is checked as with synchronous replication. And no primary
    for 9 s, longer than the workers' stalled timeout (6 s): every heartbeat goes stale, and
    still no worker exits, no job is left `doing` and nobody's jobs are taken away."""
    report = run_failover(synchronous=False, agents=4, out=tmp_path, outage=9.0)
    print(report.summary())
    assert report.violations == []
    assert report.figures["finalizations that took a second attempt"] >= 1
    # The grant made while the WAL sender was stopped was really lost (its generation was
    # handed out again), and its fence was not: the one after it is higher.
    lost_fence, lost_generation = report.figures["lost grant: fence / generation"].split(" / ")
    next_fence, next_generation = report.figures["next grant: fence / generation"].split(" / ")
    assert lost_generation == next_generation
    assert int(next_fence) > int(lost_fence)


def test_the_scenario_names_the_owner_hold_as_recovery_does() -> None:
    from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE

    assert failover.OWNER_UNVERIFIED_CAUSE == OWNER_UNVERIFIED_CAUSE


def test_the_checks_catch_bad_histories() -> None:
    """The checker fails on what it must catch: overlapping owners, a 500, a slow request, a
    node that never came back."""
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    spans = [("a", t0, t0 + timedelta(seconds=5)), ("b", t0 + timedelta(seconds=4), t0)]
    assert overlapping_owners(spans) == ["owners a and b overlap"]
    assert overlapping_owners([("a", t0, t0 + timedelta(seconds=1)), ("a", t0, t0)]) == []
    report = FailoverReport(synchronous=True)
    probes = [
        Probe(10.0, "web-0", 500, 0.1),
        Probe(11.0, "web-0", 200, 12.0),
        Probe(12.0, "web-1", 503, 0.1),
    ]
    _check_web(report, probes, killed_at=9.0, promoted_at=10.5)
    assert any("500" in v for v in report.violations)
    assert any("took 12.0 s" in v for v in report.violations)
    assert any("web-1 never answered 200" in v for v in report.violations)
