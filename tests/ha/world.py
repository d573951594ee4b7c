"""Seed a world on the database of DATABASE_URL and print it as JSON (tests/chaos/run.py's
World): `python -m tests.ha.world AGENTS CWD_ROOT [WORKSPACES [ISSUES_PER_AGENT]]` (by
default one workspace per agent and one issue per agent)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict


def main(argv: list[str]) -> None:
    import django

    django.setup()
    from tests.chaos.run import Config, create_world

    agents, cwd_root = int(argv[0]), argv[1]
    workspaces = int(argv[2]) if len(argv) > 2 else agents
    issues = int(argv[3]) if len(argv) > 3 else 1
    config = Config(agents=agents, workspaces=workspaces, issues_per_agent=issues)
    print(json.dumps(asdict(create_world(config, cwd_root=cwd_root))))


if __name__ == "__main__":
    main(sys.argv[1:])
