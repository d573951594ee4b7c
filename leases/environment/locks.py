"""Locking querysets for environment leases (kept apart from the runtime-lease `locks.py`).

Lock order (paperclip/db/advisory.py): environment lease rows come after every `paperclip` row
and are taken in ascending pk order. The cleanup protocol and the export-resume services lock
exactly one lease row and nothing after it.
"""

from __future__ import annotations

from django.db.models import QuerySet

from leases.models import EnvironmentLease


def environment_leases_for_update() -> QuerySet[EnvironmentLease]:
    """Lease rows locked FOR NO KEY UPDATE (the key never changes, rows are never deleted)."""
    return EnvironmentLease.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")
