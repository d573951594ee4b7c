"""Locking querysets for environment leases (kept apart from the runtime-lease `locks.py`).

Lock order (paperclip/db/advisory.py): environment lease rows come after every `paperclip` row
and are taken in ascending pk order. The cleanup protocol and the export-resume services lock
exactly one lease row and nothing after it.
"""

from __future__ import annotations

from django.db.models import QuerySet

from leases.models import EnvironmentLease


def environment_leases_for_update(*, skip_locked: bool = False) -> QuerySet[EnvironmentLease]:
    """Lease rows locked FOR NO KEY UPDATE (the key never changes, rows are never deleted);
    `skip_locked` for sweeps, which leave rows another transaction holds to a later pass."""
    return EnvironmentLease.objects.select_for_update(
        no_key=True, of=("self",), skip_locked=skip_locked
    ).order_by("pk")


def environment_slot_key(environment_id: object, execution_workspace_id: object | None) -> str:
    """Advisory key serialising acquires of one environment for one execution workspace (the
    single-flight slot: there is no row to lock before the lease exists)."""
    return f"leases:environment:{environment_id}:{execution_workspace_id or '-'}"
