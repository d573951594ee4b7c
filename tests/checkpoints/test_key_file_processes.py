"""Separate OS processes creating the key file at once agree on one key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import sys
import django
django.setup()
from checkpoints.crypto import key_file_path, keyring
print("ready", flush=True)
sys.stdin.readline()  # go
missing = not key_file_path().exists()
print(int(missing), keyring(create=True).primary.key_id, flush=True)
"""
CHILDREN = 4


def _race(data_dir: Path) -> list[tuple[bool, str]]:
    """Start the children, wait until every one is set up and ready, then release them at once
    (one write to each stdin); each reports whether it found no key file, and its key id."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "paperclip.settings",
        "PAPERCLIP_DATA_DIR": str(data_dir),
        "PAPERCLIP_CHECKPOINT_KEYS": "",
        # Never used (no query runs); set so settings do not start an embedded server.
        "DATABASE_URL": os.environ.get("DATABASE_URL") or "postgres://unused@127.0.0.1/unused",
        "DJANGO_SECRET_KEY": "test-only",
    }
    root = Path(__file__).resolve().parents[2]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD],
            env=env,
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(CHILDREN)
    ]
    for child in children:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    reports = []
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        missing, key_id = out.split()
        reports.append((missing == "1", key_id))
    return reports


@pytest.mark.slow
def test_racing_processes_create_one_key_file(tmp_path: Path) -> None:
    """Released together, several processes find no key file and all create one: they must
    still agree on one key (created by hard link: the first wins, the others read its key).
    An attempt where fewer than two found the file missing did not race; it is repeated."""
    for attempt in range(5):
        data_dir = tmp_path / f"data-{attempt}"
        reports = _race(data_dir)
        creators = sum(missing for missing, _ in reports)
        assert len({key_id for _, key_id in reports}) == 1, reports
        key_file = data_dir / "checkpoint_keys"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        keys = [line for line in key_file.read_text().splitlines() if not line.startswith("#")]
        assert len(keys) == 1
        if creators >= 2:
            return
    pytest.fail(f"in 5 attempts no two processes raced to create the key file ({reports})")
