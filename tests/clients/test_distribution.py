"""The client is its own distribution: httpx and pathspec are its only runtime dependencies, it
imports nothing of the server (no Django), it ships py.typed and the paperclip-agent entry
point."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from django.conf import settings

CLIENT = Path(settings.BASE_DIR) / "clients" / "python"


def test_pyproject_declares_httpx_and_pathspec_and_the_cli() -> None:
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "paperclip-client"
    assert [d.split(">")[0].split("=")[0] for d in project["dependencies"]] == ["httpx", "pathspec"]
    assert project["scripts"] == {"paperclip-agent": "paperclip_client.cli:entry"}
    assert (CLIENT / "paperclip_client" / "py.typed").exists()


def test_importing_the_client_loads_nothing_of_the_server() -> None:
    code = (
        "import sys, paperclip_client, paperclip_client.cli; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'django', 'rest_framework', 'paperclip', 'leases', 'recovery', 'checkpoints'}); "
        "print(bad)"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(CLIENT)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.strip() == "[]"
