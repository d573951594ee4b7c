"""The seed's closing lines: the admin login, the agents' keys and the commands to try, printed
and saved to the demo's logins file (they hold secrets: readable by its owner only)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from django.core.management.base import OutputWrapper

from paperclip.models import Agent, Company, Environment, ExecutionWorkspace, HeartbeatRun, Issue
from recovery.console.demo.plan import (
    CLI_ISSUE,
    CLI_WORKDIR,
    ENVIRONMENT,
    LOGINS_FILE,
    PROVIDER_RUN_ISSUE,
    USERNAME,
)


@dataclass(frozen=True, slots=True)
class DemoLogins:
    """What the seed made that the closing lines name."""

    company: Company
    password: str
    agents: list[Agent]  # the workers, then the provider
    keys: list[str]  # one per agent, in that order
    workspaces: list[ExecutionWorkspace]
    issues: dict[str, Issue]


def demo_summary(out: OutputWrapper, root: Path, url: str, logins: DemoLogins) -> Path:
    """Print the closing lines and save them under `root`; returns the file's path."""
    company, keys = logins.company, logins.keys
    summary = _Summary(out)
    summary.write(f"Demo company: {company.name} ({company.pk})")
    summary.write(f"Admin login:  /admin/  user {USERNAME}  password {logins.password}")
    for agent, key in zip(logins.agents, keys, strict=True):
        role = " (provider)" if agent.role == Agent.Role.PROVIDER else ""
        summary.write(f"Agent {agent.name} ({agent.pk}){role} key: {key}")
    summary.write(f"Try: curl -H 'Authorization: Bearer <key>' {url}/api/me")
    environment = Environment.objects.filter(company=company, name=ENVIRONMENT).first()
    run = (
        HeartbeatRun.objects.filter(company=company, issue=logins.issues[PROVIDER_RUN_ISSUE])
        .order_by("created_at", "pk")
        .first()
    )
    if environment is not None and run is not None:
        summary.write(
            "Provider worker, in another terminal (docs/environment.md, its worker's guide):"
        )
        summary.write(
            f"  export PAPERCLIP_URL={url} PROVIDER_KEY={keys[-1]}"
            f" ENV_ID={environment.pk} RUN_ID={run.pk}"
        )
    alpha, main, issue = logins.agents[0], logins.workspaces[0], logins.issues[CLI_ISSUE]
    summary.write("Agent CLI, in another terminal (README: Agent quickstart):")
    summary.write(
        f"  export PAPERCLIP_URL={url} PAPERCLIP_AGENT_KEY=$(.venv/bin/python manage.py"
        f" create_agent_key --agent {alpha.pk} | tail -n 1)"
    )
    summary.write(
        f"  .venv/bin/paperclip-agent run --workspace {main.pk} --issue {issue.pk}"
        f" --workdir {root / CLI_WORKDIR} -- sh -c 'echo hi > out.txt'"
    )
    path = root / LOGINS_FILE
    summary.save(path)
    return path


class _Summary:
    """The closing lines (logins, keys, commands): printed, and kept for `save`."""

    def __init__(self, stdout: OutputWrapper) -> None:
        self.stdout = stdout
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.stdout.write(line)
        self.lines.append(line)

    def save(self, path: Path) -> None:
        """Write the lines to `path`, readable by its owner only: it holds secrets."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        path.chmod(0o600)
        path.write_text("\n".join(self.lines) + "\n")
