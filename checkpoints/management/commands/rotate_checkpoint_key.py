"""Re-encrypt every checkpoint part under the primary key, in batches, resumably."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from checkpoints.crypto import KeyRing, KeyUnavailable, key_file_prepend_new_key, keyring
from checkpoints.models import NativeRunnerCheckpoint
from checkpoints.services import (
    checkpoint_key_rotate_batch,
    checkpoint_parts_remaining_under_old_keys,
)
from paperclip.errors import DomainError

MORE_PASSES = 3  # passes after the first for parts written under an old key meanwhile


class Command(BaseCommand):
    help = (
        "Re-encrypt checkpoint parts that are not under the primary key (the first of "
        "PAPERCLIP_CHECKPOINT_KEYS, or the key file's first line). Only parts under another "
        "key are touched, so re-running after an interruption continues where it stopped. "
        "--new-key first generates a key and makes it the key file's primary."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch-size", type=int, default=500, help="Parts per batch.")
        parser.add_argument(
            "--max-batch-mib",
            type=int,
            default=64,
            help="A batch also ends once its parts hold this many MiB of contents (default 64).",
        )
        parser.add_argument(
            "--new-key",
            action="store_true",
            help="Generate a new primary key and prepend it to the key file (file keys only).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Only count the parts to re-encrypt."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        batch_size, max_bytes = _limits(options)
        if options["new_key"]:
            if options["dry_run"]:
                raise CommandError("--new-key cannot be combined with --dry-run")
            self._new_key()
        elif not NativeRunnerCheckpoint.objects.exists() and not _key_configured():
            # A deployment no checkpoint was ever written to: no key yet (the key file is
            # made at the first write), and nothing to re-encrypt.
            self.stdout.write(
                "no checkpoint key yet (made at the first checkpoint write); 0 part(s) stored:"
                " nothing re-encrypted" + (" (dry run)" if options["dry_run"] else "")
            )
            return
        ring = _configured_keyring()
        primary = ring.primary.key_id
        remaining = checkpoint_parts_remaining_under_old_keys()
        self.stdout.write(
            f"primary key {primary} ({ring.source}); {remaining} part(s) under other keys"
        )
        if options["dry_run"] or remaining == 0:
            self.stdout.write("nothing re-encrypted" + (" (dry run)" if options["dry_run"] else ""))
            return

        done, unreadable = self._rotate(remaining, batch_size=batch_size, max_bytes=max_bytes)
        left = checkpoint_parts_remaining_under_old_keys(settled=True)
        for _ in range(MORE_PASSES):
            if left <= unreadable:
                break
            # Parts written under the old key while the batches ran (a write that sealed them
            # before the key file changed): another pass, counted again once settled.
            self.stdout.write(f"{left} part(s) written under other keys meanwhile; another pass")
            more, _ = self._rotate(left, batch_size=batch_size, max_bytes=max_bytes)
            done += more
            left = checkpoint_parts_remaining_under_old_keys(settled=True)
        self.stdout.write(
            f"done: re-encrypted {done} part(s) under {primary}; {unreadable} unreadable; "
            f"{left} part(s) remain under other keys"
        )
        if unreadable:
            raise CommandError(
                f"{unreadable} part(s) could not be decrypted with any configured key and were "
                "left as they are (their runs must start fresh)"
            )

    def _new_key(self) -> None:
        try:
            key = key_file_prepend_new_key()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"new primary key {key.key_id} written to the key file")

    def _rotate(self, remaining: int, *, batch_size: int, max_bytes: int) -> tuple[int, int]:
        """Re-encrypt batch after batch until none is left; (re-encrypted, unreadable)."""
        after = None
        batch = done = unreadable = 0
        while True:
            try:
                result = checkpoint_key_rotate_batch(
                    after_id=after, batch_size=batch_size, max_bytes=max_bytes
                )
            except DomainError as exc:
                raise CommandError(
                    f"batch {batch + 1} failed ({exc.code}); re-run to continue"
                ) from exc
            if result.scanned == 0:
                return done, unreadable
            batch += 1
            done += result.reencrypted
            unreadable += len(result.unreadable)
            after = result.last_id
            self.stdout.write(
                f"batch {batch}: re-encrypted {result.reencrypted}, unreadable "
                f"{len(result.unreadable)}, total {done}/{remaining}"
            )
            for row_id, part, reason in result.unreadable:
                self.stdout.write(f"  unreadable part {part!r} (row {row_id}): {reason}")


def _limits(options: dict[str, Any]) -> tuple[int, int]:
    """(parts per batch, bytes per batch) from the options, each at least 1."""
    batch_size: int = options["batch_size"]
    if batch_size < 1:
        raise CommandError("--batch-size must be at least 1")
    max_bytes = int(options["max_batch_mib"]) * 1024 * 1024
    if max_bytes < 1:
        raise CommandError("--max-batch-mib must be at least 1")
    return batch_size, max_bytes


def _key_configured() -> bool:
    """Whether a key is configured (a misconfiguration counts: `_configured_keyring` says
    what is wrong with it)."""
    try:
        keyring(create=False)
    except KeyUnavailable:
        return False
    except ImproperlyConfigured:
        return True
    return True


def _configured_keyring() -> KeyRing:
    try:
        return keyring(create=False)
    except KeyUnavailable as exc:
        raise CommandError(f"no checkpoint key is configured ({exc})") from exc
    except ImproperlyConfigured as exc:
        raise CommandError(str(exc)) from exc
