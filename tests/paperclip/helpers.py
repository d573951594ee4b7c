"""Assertions shared by the core tests."""

from __future__ import annotations

from rest_framework.test import APIClient

from paperclip.models import ActivityEvent


def audit_count(action: str | None = None) -> int:
    qs = ActivityEvent.objects.all()
    return qs.filter(action=action).count() if action else qs.count()


def bearer_client(secret: str) -> APIClient:
    """An APIClient sending `Authorization: Bearer <secret>` (an agent key or a board token)."""
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {secret}")
    return client
