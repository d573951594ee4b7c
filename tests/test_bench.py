"""`make bench` keeps working: each bench script runs to the end on a few iterations.

No timing is asserted (speed claims live in the bench's own ratios); this only guards the
scripts against the code moving under them, as settings and layout changes did.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from paperclip.testing.processes import database_url

ROOT = Path(settings.BASE_DIR)


@pytest.mark.slow
@pytest.mark.django_db
@pytest.mark.parametrize(
    ("script", "db_env", "args"),
    [
        ("bench/leases.py", "PAPERCLIP_BENCH_DB", ["--iterations", "20"]),
        ("bench/checkpoints.py", "PAPERCLIP_BENCH_CKPT_DB", ["--iterations", "10"]),
    ],
)
def test_bench_script_runs_to_the_end(script: str, db_env: str, args: list[str]) -> None:
    name = f"paperclip_bench_smoke_{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    env |= {"DATABASE_URL": database_url(), db_env: name}
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
    assert "ratio" in done.stdout  # it got to its report
    with connection.cursor() as cursor:  # and dropped its throwaway database
        cursor.execute("SELECT count(*) FROM pg_database WHERE datname = %s", [name])
        assert cursor.fetchone() == (0,)
