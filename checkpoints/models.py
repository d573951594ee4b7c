"""Encrypted runner checkpoint parts (docs/data-model.md#checkpoints): one row per (run, part)."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from django.db import models
from django.db.models.functions import Now

from checkpoints.crypto import Sealed
from paperclip.models import Company, HeartbeatRun, Issue

# The columns that hold a sealed part; written and read together.
SEALED_FIELDS = ("scheme", "key_id", "nonce", "ciphertext")


class NativeRunnerCheckpoint(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    issue = models.ForeignKey(Issue, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey(HeartbeatRun, on_delete=models.CASCADE, related_name="checkpoint_parts")
    part = models.TextField()
    # The sealed part (checkpoints/crypto.py `Sealed`); never plaintext. Raw bytes in bytea:
    # base64 inside jsonb stored a third more and cost an encode and a decode per part.
    scheme = models.TextField()
    key_id = models.TextField()
    nonce = models.BinaryField()
    ciphertext = models.BinaryField()  # GCM's 16-byte tag at its end
    # Plaintext size, kept so the admin can show sizes without decrypting.
    size_bytes = models.IntegerField(default=0)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "native_runner_checkpoints"
        constraints: ClassVar[list[Any]] = [
            models.UniqueConstraint(
                fields=["run", "part"], name="native_runner_checkpoints_run_part_uq"
            )
        ]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "issue", "run"], name="checkpoints_scope_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}:{self.part}"

    @property
    def sealed(self) -> Sealed:
        return Sealed(
            scheme=self.scheme,
            key_id=self.key_id,
            nonce=bytes(self.nonce),
            ciphertext=bytes(self.ciphertext),
        )


class NativeRunnerCheckpointWork(models.Model):
    """The work command ids of the last checkpoint written for a run, and who wrote it.

    Upstream keeps these in the writer's memory; here the writer is a stateless HTTP endpoint,
    so they are stored. A write counts as "adding new work" when it names a command id the same
    lease owner's previous snapshot did not (another owner's snapshot counts as no memory, as a
    fresh upstream writer starts empty). Kept out of the parts table so a `reset` or a part
    listing never sees it.
    """

    run = models.OneToOneField(
        HeartbeatRun, on_delete=models.CASCADE, primary_key=True, related_name="+"
    )
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    issue = models.ForeignKey(Issue, on_delete=models.CASCADE, related_name="+")
    lease_owner = models.TextField()
    work_command_ids = models.JSONField(default=list)
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "native_runner_checkpoint_work"

    def __str__(self) -> str:
        return f"work of {self.run_id}"
