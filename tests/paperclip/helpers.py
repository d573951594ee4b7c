"""Assertions shared by the core tests."""

from __future__ import annotations

from paperclip.models import ActivityEvent


def audit_count(action: str | None = None) -> int:
    qs = ActivityEvent.objects.all()
    return qs.filter(action=action).count() if action else qs.count()
