"""`manage.py create_board_token --user <username> [--superuser]`: mint a board API token.

A missing user is created as a staff user without a usable password (API only); an existing
user is made staff, since only staff users act as the board. `--superuser` grants access to
every company. The bearer secret is printed alone on the last line of output, once.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.credentials import board_token_create, board_user_ensure
from paperclip.errors import DomainError


class Command(BaseCommand):
    help = "Create an API token for a board (staff) user and print the secret on the last line."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--user", required=True, help="Username (created if missing).")
        parser.add_argument(
            "--superuser", action="store_true", help="Make the user a superuser (all companies)."
        )
        parser.add_argument("--name", default="", help="A label for the token.")

    def handle(self, *args: Any, **options: Any) -> None:
        username = options["user"].strip()
        if not username:
            raise CommandError("--user must not be blank.")
        try:
            ensured = board_user_ensure(username=username, superuser=options["superuser"])
        except DomainError as exc:
            raise CommandError(exc.text) from exc
        user, created, changes = ensured.user, ensured.created, ensured.changes
        if created:
            self.stdout.write(f"Created staff user {username!r} (no password; API only).")
        elif changes:
            self.stdout.write(f"Updated user {username!r}: {', '.join(sorted(changes))}.")
        issued = board_token_create(user=user, name=options["name"])
        scope = "all companies" if user.is_superuser else "the companies they are a member of"
        self.stdout.write(
            f"Created board token {issued.prefix} (id {issued.id}) for {username!r} ({scope}). "
            "It is shown once; store it now:"
        )
        self.stdout.write(issued.secret)
