"""Seed the failover test's world on the database of DATABASE_URL and print it as JSON:
`python -m tests.ha.world AGENTS CWD_ROOT` (one issue per agent, one workspace per agent)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict


def main(argv: list[str]) -> None:
    import django

    django.setup()
    from tests.chaos.run import Config, create_world

    agents, cwd_root = int(argv[0]), argv[1]
    config = Config(agents=agents, workspaces=agents, issues_per_agent=1)
    print(json.dumps(asdict(create_world(config, cwd_root=cwd_root))))


if __name__ == "__main__":
    main(sys.argv[1:])
