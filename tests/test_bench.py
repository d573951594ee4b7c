"""`make bench` keeps working: each bench script runs to the end on a few iterations.

No timing is asserted (speed claims live in the bench's own ratios); this only guards the
scripts against the code moving under them, as settings and layout changes did.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.db import connection

from tests.support.processes import database_url

ROOT = Path(settings.BASE_DIR)


@pytest.mark.slow
@pytest.mark.django_db
@pytest.mark.parametrize(
    ("script", "db_env", "args"),
    [
        ("bench/leases.py", "PAPERCLIP_BENCH_DB", ["--iterations", "20"]),
        ("bench/checkpoints.py", "PAPERCLIP_BENCH_CKPT_DB", ["--iterations", "10"]),
        ("bench/renew_load.py", "PAPERCLIP_BENCH_LOAD_DB", ["--quick"]),
        ("bench/registration.py", "PAPERCLIP_BENCH_REGISTRATION_DB", ["--quick"]),
        ("bench/history.py", "PAPERCLIP_BENCH_HISTORY_DB", ["--quick"]),
    ],
)
def test_bench_script_runs_to_the_end(script: str, db_env: str, args: list[str]) -> None:
    name = f"paperclip_bench_smoke_{os.getpid()}"
    done = run_bench(script, args, {db_env: name})
    assert "ratio" in done.stdout  # it got to its report
    assert_dropped(name)


@pytest.mark.slow
def test_the_store_sync_bench_runs_to_the_end_and_cleans_up(tmp_path: Path) -> None:
    done = run_bench("bench/cas_sync.py", ["--quick", "--dir", str(tmp_path)], {})
    assert "ratio" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_cli_start_bench_runs_to_the_end() -> None:
    done = run_bench("bench/cli_start.py", ["--quick"], {})
    assert re.search(r"^(MET|MISSED): start to first request", done.stdout, re.MULTILINE)


@pytest.mark.slow
@pytest.mark.django_db
def test_finalize_bench_runs_to_the_end_and_cleans_up(tmp_path: Path) -> None:
    """bench/finalize.py also starts gunicorn and two workers and writes workspace trees:
    they are gone afterwards, and so is its temporary directory."""
    name = f"paperclip_bench_smoke_{os.getpid()}"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = run_bench(
        "bench/finalize.py",
        ["--quick"],
        {"PAPERCLIP_BENCH_FINALIZE_DB": name, "TMPDIR": str(scratch)},
    )
    assert "ratio" in done.stdout  # it got to its report
    assert "result committed -> job started" in done.stdout
    assert_dropped(name)
    assert list(scratch.iterdir()) == []
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\) stopped", done.stdout)]
    assert len(pids) == 3  # gunicorn, the worker, the polling-only worker
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


@pytest.mark.slow
@pytest.mark.django_db
def test_scale_bench_runs_to_the_end_and_drops_both_databases() -> None:
    """bench/scale.py measures a small database and a copy grown to the fixture: both go."""
    name = f"paperclip_bench_smoke_{os.getpid()}"
    done = run_bench(
        "bench/scale.py",
        ["--quick", "--base-leases", "100", "--leases", "300", "--repeats", "1"],
        {"PAPERCLIP_BENCH_SCALE_DB": name},
    )
    assert "ratio" in done.stdout  # it got to its report
    assert "statements checked at scale" in done.stdout  # and to its EXPLAIN check
    assert "sweep cost grows with stale rows" in done.stdout
    assert_dropped(name)
    assert_dropped(f"{name}_scale")


@pytest.mark.slow
def test_copyback_bench_runs_to_the_end_and_cleans_up(tmp_path: Path) -> None:
    done = run_bench(
        "bench/copyback.py",
        ["--files", "300", "--incremental-files", "400", "--rounds", "1", "--dir", str(tmp_path)],
        {},
    )
    assert "full copy-back vs cp -a: ratio" in done.stdout
    assert "incremental copy-back vs rsync -a" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.django_db
def test_snapshots_bench_runs_to_the_end_and_cleans_up(tmp_path: Path) -> None:
    """bench/snapshots.py starts the server, a worker and the CLI, and writes trees."""
    name = f"paperclip_bench_smoke_{os.getpid()}"
    done = run_bench(
        "bench/snapshots.py",
        ["--quick", "--files", "200", "--dir", str(tmp_path)],
        {"PAPERCLIP_BENCH_SNAPSHOTS_DB": name},
    )
    assert "first run vs cp -a: ratio" in done.stdout  # it got to its report
    assert "later run (1% changed) vs rsync -a: ratio" in done.stdout
    assert "checkout at the head:" in done.stdout
    # the git peer (bench/snapshots_git.py): both variants' runs, and the ratios against them
    for variant in ("git", "git-tuned"):
        assert f"round 1 {variant} first run:" in done.stdout
        assert f"round 1 {variant} later run:" in done.stdout
        assert f"first run vs {variant}: " in done.stdout
        assert f"later run vs {variant}: " in done.stdout
    assert "git-tuned settings: feature.manyFiles=true" in done.stdout
    assert_dropped(name)
    assert list(tmp_path.iterdir()) == []
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\) stopped", done.stdout)]
    assert len(pids) == 2  # the server, the worker
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


@pytest.mark.slow
@pytest.mark.django_db
def test_snapshots_scale_bench_runs_to_the_end_and_cleans_up(tmp_path: Path) -> None:
    """bench/snapshots.py --scale runs its three trees with their watchers and stops every
    process."""
    name = f"paperclip_bench_scale_smoke_{os.getpid()}"
    done = run_bench(
        "bench/snapshots.py",
        ["--scale", "--quick", "--files", "100", "--dir", str(tmp_path)],
        {"PAPERCLIP_BENCH_SNAPSHOTS_DB": name},
    )
    for tree in ("100 files", "400 files, wider", "400 files, deeper"):
        for n in (1, 2, 3):  # at least three rounds, whatever --rounds says
            assert f"round {n}, {tree}: later run (1 files changed)" in done.stdout
        assert f"a run that changed nothing on {tree}: CLI" in done.stdout
    for shape in ("wider", "deeper"):
        assert f"later run on 400 files, {shape} vs 100 files, the same 1 files" in done.stdout
    assert "scanned in full" not in done.stdout  # the watcher answered every later run
    assert_dropped(name)
    assert list(tmp_path.iterdir()) == []
    pids = [int(pid) for pid in re.findall(r"\(pid (\d+)\) stopped", done.stdout)]
    assert len(pids) == 2  # the server, the worker
    assert not [pid for pid in pids if psutil.pid_exists(pid)]


def run_bench(
    script: str, args: list[str], extra_env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    env |= {"DATABASE_URL": database_url(), **extra_env}
    done = subprocess.run(
        [sys.executable, script, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done


def assert_dropped(name: str) -> None:
    with connection.cursor() as cursor:  # the bench dropped its throwaway database
        cursor.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name])
        assert cursor.fetchone() == (0,)
