"""`manage.py create_agent_key --agent <uuid> [--name NAME]`: mint an agent API key.

The bearer secret is printed alone on the last line of output, once; only its hash is stored.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.credentials import agent_key_create
from paperclip.errors import NotFoundError
from paperclip.models import Agent


class Command(BaseCommand):
    help = "Create an API key for an agent and print the secret (alone, on the last line)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--agent", required=True, help="The agent's UUID.")
        parser.add_argument("--name", default="", help="A label for the key.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            agent_id = UUID(options["agent"])
        except ValueError as exc:
            raise CommandError(f"--agent: {options['agent']!r} is not a UUID.") from exc
        try:
            issued = agent_key_create(agent_id=agent_id, name=options["name"])
        except NotFoundError as exc:
            raise CommandError(f"No agent with id {agent_id}.") from exc
        agent = Agent.objects.select_related("company").get(pk=agent_id)
        if agent.status != Agent.Status.ACTIVE:
            self.stderr.write(f"Warning: agent status is {agent.status}.")
        self.stdout.write(
            f"Created key {issued.prefix} (id {issued.id}) for agent {agent.name} ({agent.pk}) "
            f"of {agent.company.name}. It is shown once; store it now:"
        )
        self.stdout.write(issued.secret)
