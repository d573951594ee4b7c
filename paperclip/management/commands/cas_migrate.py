"""`manage.py cas_migrate --to BACKEND`: copy every blob to another backend, verified,
resumably; switches nothing (docs/snapshots.md#moving-the-store-to-another-backend)."""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from paperclip.snapshots.store.migration import (
    BACKENDS,
    MigrateProgress,
    MigrateTotals,
    MigrationRunning,
    StoreUnavailable,
    TargetFailed,
    backend_named,
    cas_migrate,
    cas_migrate_totals,
    migration_lock,
)

MIB = 1024 * 1024


class Command(BaseCommand):
    help = (
        "Copy every company's blobs from the configured backend (PAPERCLIP_CAS_BACKEND) to "
        "another, each read back from the target and verified against its name. A blob the "
        "target already holds is skipped, so re-running after an interruption copies only the "
        "rest. Changes no setting: prints what to set afterwards. Progress on stderr."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--to", required=True, help=f"The target: {' or '.join(BACKENDS)}.")
        parser.add_argument(
            "--batch-size", type=int, default=500, help="Blobs per progress line (default 500)."
        )
        parser.add_argument(
            "--max-batch-mib",
            type=int,
            default=64,
            help="A batch also ends once it copied this many MiB (default 64).",
        )
        parser.add_argument(
            "--jobs",
            type=int,
            default=8,
            help="Blobs copied at once, each on its own database connection (default 8).",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Only count what the target lacks."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        target, batch_size, max_bytes = _checked(options)
        self.jobs: int = options["jobs"]
        if not 1 <= self.jobs <= 64:
            raise CommandError(f"--jobs must be 1 to 64, not {self.jobs}")
        source = settings.PAPERCLIP_CAS_BACKEND
        dry_run: bool = options["dry_run"]
        try:
            with migration_lock():
                totals = cas_migrate_totals()
                self.stdout.write(
                    f"{'dry run: ' if dry_run else ''}{source} -> {_where(target)}: "
                    f"{totals.blobs} blob(s), {_mib(totals.bytes)} MiB"
                )
                started = time.monotonic()
                summary = self._run(target, totals, batch_size, max_bytes, dry_run, started)
        except MigrationRunning as exc:
            raise CommandError("another cas_migrate is running; nothing was copied") from exc
        self._report(summary, source, target, dry_run, time.monotonic() - started)

    def _run(
        self,
        target: str,
        totals: MigrateTotals,
        batch_size: int,
        max_bytes: int,
        dry_run: bool,
        started: float,
    ) -> MigrateProgress:
        last: list[MigrateProgress] = []

        def progress(step: MigrateProgress) -> None:
            last[:] = [step]
            self.stderr.write(
                _progress_line(step, totals, time.monotonic() - started, dry_run=dry_run), str
            )

        try:
            return cas_migrate(
                target=target,
                totals=totals,
                batch_size=batch_size,
                max_batch_bytes=max_bytes,
                progress=progress,
                dry_run=dry_run,
                jobs=self.jobs,
            )
        except TargetFailed as exc:
            raise CommandError(
                f"the copy to {target} failed{_after(last)}: {exc}. Nothing of that blob was "
                "kept; fix the target and run the command again to continue"
            ) from exc
        except StoreUnavailable as exc:
            raise CommandError(
                f"{exc}{_after(last)}; nothing of the blob in hand was kept: run the command "
                "again once it answers"
            ) from exc
        except KeyboardInterrupt as exc:  # Ctrl-C: the blob in hand was rolled back
            raise CommandError(
                f"interrupted{_after(last)}; run the command again to copy the rest"
            ) from exc

    def _report(
        self, summary: MigrateProgress, source: str, target: str, dry_run: bool, seconds: float
    ) -> None:
        verb = "would copy" if dry_run else "copied"
        self.stdout.write(
            f"done: {verb} {summary.copied} blob(s), {_mib(summary.copied_bytes)} MiB, from "
            f"{source} to {target} in {seconds:.1f} s; {summary.present} already there, "
            f"{summary.gone} gone (collected meanwhile), {len(summary.problems)} not copied"
        )
        for p in summary.problems:
            self.stdout.write(
                f"  not copied ({p.outcome}): company {p.company_id} blob {p.digest}: {p.reason}"
            )
        self.stdout.write(
            f"Nothing was switched: PAPERCLIP_CAS_BACKEND is still {source}. Once a pass copies "
            f"nothing new, set PAPERCLIP_CAS_BACKEND={target}{_target_settings(target)} on every "
            f"web and worker node, restart them, then run "
            f"`PAPERCLIP_CAS_BACKEND={source} manage.py cas_migrate --to {target}` once more "
            "(docs/runbook.md#moving-the-blob-store-to-another-backend)."
        )
        if summary.problems:
            raise CommandError(
                f"{len(summary.problems)} blob(s) not copied (listed above): unreadable ones "
                "stay missing in the target; busy ones are retried by the next run"
            )


def _checked(options: dict[str, Any]) -> tuple[str, int, int]:
    """(target, batch size, bytes per batch); CommandError for bad input, before anything."""
    target: str = options["to"]
    if target not in BACKENDS:
        raise CommandError(f"--to must be one of {', '.join(BACKENDS)}, not {target!r}")
    if target == settings.PAPERCLIP_CAS_BACKEND:
        raise CommandError(
            f"--to {target} is the backend in use (PAPERCLIP_CAS_BACKEND); nothing to copy"
        )
    try:
        backend_named(target)  # its settings (s3: the bucket), before anything is read
    except ImproperlyConfigured as exc:
        raise CommandError(f"--to {target}: {exc}; nothing was copied") from exc
    batch_size: int = options["batch_size"]
    if batch_size < 1:
        raise CommandError("--batch-size must be at least 1")
    max_bytes = int(options["max_batch_mib"]) * MIB
    if max_bytes < 1:
        raise CommandError("--max-batch-mib must be at least 1")
    return target, batch_size, max_bytes


def _after(last: list[MigrateProgress]) -> str:
    return f" after copying {last[0].copied} blob(s)" if last else ""


def _where(target: str) -> str:
    if target == "filesystem":
        return f"filesystem ({settings.PAPERCLIP_CAS_DIR})"
    if target == "s3":
        endpoint = settings.PAPERCLIP_CAS_S3_ENDPOINT_URL or "AWS"
        return (
            f"s3 (bucket {settings.PAPERCLIP_CAS_S3_BUCKET}, prefix "
            f"{settings.PAPERCLIP_CAS_S3_PREFIX}, {endpoint})"
        )
    return target


def _target_settings(target: str) -> str:
    if target == "filesystem":
        return f" and PAPERCLIP_CAS_DIR={settings.PAPERCLIP_CAS_DIR}"
    if target == "s3":
        endpoint = settings.PAPERCLIP_CAS_S3_ENDPOINT_URL
        return (
            f" with PAPERCLIP_CAS_S3_BUCKET={settings.PAPERCLIP_CAS_S3_BUCKET}, "
            f"PAPERCLIP_CAS_S3_PREFIX={settings.PAPERCLIP_CAS_S3_PREFIX}"
            + (f", PAPERCLIP_CAS_S3_ENDPOINT_URL={endpoint}" if endpoint else "")
            + " and the AWS_* credentials"
        )
    return ""


def _mib(size: int) -> str:
    return f"{size / MIB:.1f}"


def _progress_line(
    step: MigrateProgress, totals: MigrateTotals, seconds: float, *, dry_run: bool = False
) -> str:
    """`batch N: blobs done/total, MiB done/total (what became of them), rate, ETA` (a dry
    run says what it would copy: it copies nothing)."""
    rate = step.bytes / seconds if seconds > 0 else 0.0
    left = max(totals.bytes - step.bytes, 0)
    eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
    return (
        f"batch {step.batch}: {step.blobs}/{totals.blobs} blobs, "
        f"{_mib(step.bytes)}/{_mib(totals.bytes)} MiB"
        f" ({'would copy' if dry_run else 'copied'} {step.copied}, already there "
        f"{step.present}, gone {step.gone}, not copied {len(step.problems)}), "
        f"{rate / MIB:.1f} MiB/s, ETA {eta}"
    )
