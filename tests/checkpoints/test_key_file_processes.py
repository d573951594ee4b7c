"""Separate OS processes creating the key file at once agree on one key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = """
import django
django.setup()
from checkpoints.crypto import keyring
print(keyring(create=True).primary.key_id)
"""


@pytest.mark.slow
def test_racing_processes_create_one_key_file(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
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
            [sys.executable, "-c", CHILD], env=env, cwd=root, stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outputs = []
    for child in children:
        out, _ = child.communicate(timeout=60)
        assert child.returncode == 0
        outputs.append(out.strip().splitlines()[-1])
    assert len(set(outputs)) == 1
    key_file = data_dir / "checkpoint_keys"
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    keys = [line for line in key_file.read_text().splitlines() if not line.startswith("#")]
    assert len(keys) == 1
