"""Locking querysets for environment leases (kept apart from the runtime-lease `locks.py`).

Lock order (paperclip/db/advisory.py): environment lease rows come after every `paperclip` row
and are taken in ascending pk order. The cleanup protocol and the export-resume services lock
exactly one lease row and nothing after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import OperationalError
from django.db.models import QuerySet

from leases.models import EnvironmentLease
from paperclip.db.advisory import set_local_lock_timeout
from paperclip.errors import ResourceBusy

LOCK_NOT_AVAILABLE = "55P03"


def environment_leases_for_update() -> QuerySet[EnvironmentLease]:
    """Lease rows locked FOR NO KEY UPDATE (the key never changes, rows are never deleted)."""
    return EnvironmentLease.objects.select_for_update(no_key=True, of=("self",)).order_by("pk")


@contextmanager
def bounded_lock_wait(timeout: str = "5s") -> Iterator[None]:
    """Bound row-lock waits inside the current transaction; a timeout becomes `ResourceBusy`.

    A racing cleanup worker waits for the winner's short transaction and then sees its claim,
    so it gets a meaningful `cleanup_in_flight` instead of a bare "busy".
    """
    set_local_lock_timeout(timeout)
    try:
        yield
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            raise ResourceBusy(resource="environment_lease") from exc
        raise
