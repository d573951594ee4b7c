"""The audit log (paperclip/activity.py writes it)."""

from __future__ import annotations

import uuid
from typing import ClassVar

from django.db import models
from django.db.models.functions import Now

from paperclip.models.tenancy import Company
from paperclip.models.work import HeartbeatRun


class ActivityEvent(models.Model):
    """The audit log: one row per state change, written in the same transaction."""

    class ActorType(models.TextChoices):
        AGENT = "agent"
        USER = "user"
        SYSTEM = "system"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(
        Company, on_delete=models.CASCADE, null=True, blank=True, related_name="activity"
    )
    actor_type = models.TextField(choices=ActorType.choices)
    actor_id = models.TextField()
    action = models.TextField()
    entity_type = models.TextField()
    entity_id = models.TextField()
    run = models.ForeignKey(
        HeartbeatRun, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "activity_events"
        ordering: ClassVar[list[str]] = ["-created_at"]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "created_at"], name="activity_company_created_idx"),
            models.Index(fields=["entity_type", "entity_id"], name="activity_entity_idx"),
            # Newest first across companies (the console's recent activity, the audit list's
            # default order with its id tie-break), and per action in that order (its filter).
            models.Index(fields=["created_at", "id"], name="activity_created_idx"),
            models.Index(fields=["action", "created_at"], name="activity_action_created_idx"),
            # A staff user's audit list filtered by action or entity type: its count and
            # filter choices read only the matching rows of its companies.
            models.Index(
                fields=["company", "action", "created_at"], name="activity_company_action_idx"
            ),
            models.Index(
                fields=["company", "entity_type", "created_at"], name="activity_company_entity_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.entity_type}:{self.entity_id}"
