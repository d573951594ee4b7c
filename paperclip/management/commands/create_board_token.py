"""`manage.py create_board_token --user <username> [--superuser]`: mint a board API token.

A missing user is created as a staff user without a usable password (API only); an existing
user is made staff, since only staff users act as the board. `--superuser` grants access to
every company. The bearer secret is printed alone on the last line of output, once.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from paperclip.activity import activity_record
from paperclip.credentials import board_token_create


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
        user_model = get_user_model()
        with transaction.atomic(durable=True):
            user = (
                user_model.objects.select_for_update()
                .filter(**{user_model.USERNAME_FIELD: username})
                .first()
            )
            created = user is None
            if user is None:
                user = user_model(**{user_model.USERNAME_FIELD: username})
                user.set_unusable_password()
            changes = {}
            if not user.is_staff:
                changes["is_staff"] = True
            if options["superuser"] and not user.is_superuser:
                changes["is_superuser"] = True
            if not user.is_active:
                raise CommandError(f"User {username!r} is inactive.")
            for field, value in changes.items():
                setattr(user, field, value)
            if created or changes:
                user.save()
                activity_record(
                    company_id=None,
                    actor_type="system",
                    actor_id="cli",
                    action="board_user.created" if created else "board_user.updated",
                    entity_type="user",
                    entity_id=str(user.pk),
                    details={"username": username, **changes},
                )
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
