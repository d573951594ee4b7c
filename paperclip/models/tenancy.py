"""Who acts: companies, their board members (operators), agents and the credentials both
use on the API (agent keys, board tokens)."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.conf import settings
from django.db import models
from django.db.models.functions import Now

from paperclip.models.base import TimestampedModel


class Company(TimestampedModel):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200)

    class Meta:
        db_table = "companies"
        verbose_name_plural = "companies"
        ordering: ClassVar[list[str]] = ["name"]

    def __str__(self) -> str:
        return self.name


class BoardMembership(models.Model):
    """A Django staff user who is a board member (operator) of a company."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="board_memberships"
    )
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="board_members")
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "board_memberships"
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["user", "company"], name="board_memberships_user_company_uq"
            )
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.company_id}"


class Agent(TimestampedModel):
    class Status(models.TextChoices):
        ACTIVE = "active"
        PAUSED = "paused"
        TERMINATED = "terminated"

    class Role(models.TextChoices):
        WORKER = "worker"  # runs issues (runs, runtime leases, checkpoints, results)
        PROVIDER = "provider"  # drives environment leases and their cleanups

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="agents")
    name = models.CharField(max_length=200)
    status = models.TextField(choices=Status.choices, default=Status.ACTIVE)
    role = models.TextField(choices=Role.choices, default=Role.WORKER, db_default=Role.WORKER)

    class Meta:
        db_table = "agents"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "name"], name="agents_company_name_idx")
        ]

    def __str__(self) -> str:
        return self.name

    # DRF treats the authenticated principal as a user; an agent is always authenticated.
    @property
    def is_authenticated(self) -> bool:
        return True


class ApiCredential(models.Model):
    """Shared shape of agent keys and board tokens: `<kind>_<prefix>.<secret>`, stored as the
    prefix plus a SHA-256 hash of the secret (a slow password hash would sit on every request)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    prefix = models.CharField(max_length=32, unique=True)
    secret_sha256 = models.CharField(max_length=64)
    name = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class AgentApiKey(ApiCredential):
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="api_keys")

    class Meta:
        db_table = "agent_api_keys"
        verbose_name = "agent API key"

    def __str__(self) -> str:
        return f"pcak_{self.prefix}"


class BoardApiToken(ApiCredential):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="board_api_tokens"
    )

    class Meta:
        db_table = "board_api_tokens"
        verbose_name = "board API token"

    def __str__(self) -> str:
        return f"pcbt_{self.prefix}"
