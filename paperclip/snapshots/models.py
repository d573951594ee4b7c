"""The history of a workspace's head (docs/snapshots.md#history): one row per move, written in
the transaction that moves the head and never rewritten (a trigger refuses every UPDATE).

Kept with the snapshots; `paperclip/models/__init__.py` imports it, so Django sees
the model in the `paperclip` app. The run and the recovery action are plain ids, not foreign
keys: a deleted run must not rewrite the row, and the recovery action belongs to an app above
the core.
"""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.db.models.functions import Now


class WorkspaceHeadMove(models.Model):
    """One move of a workspace's head: from `previous_tree` (null: empty) to `tree`."""

    class Kind(models.TextChoices):
        PUBLISH = "publish"
        MERGE = "merge"
        RESOLUTION = "resolution"
        ADOPTION = "adoption"
        RESTORE = "restore"

    class ActorType(models.TextChoices):
        AGENT = "agent"
        BOARD = "board"
        SYSTEM = "system"

    id = models.BigAutoField(primary_key=True)
    company = models.ForeignKey("paperclip.Company", on_delete=models.CASCADE, related_name="+")
    workspace = models.ForeignKey(
        "paperclip.ExecutionWorkspace", on_delete=models.CASCADE, related_name="head_moves"
    )
    seq = models.BigIntegerField()  # 1, 2, ... per workspace, in the order of the moves
    tree = models.TextField()
    previous_tree = models.TextField(null=True, blank=True)
    kind = models.TextField(choices=Kind.choices)
    run_id = models.UUIDField(null=True, blank=True)
    action_id = models.UUIDField(null=True, blank=True)
    actor_type = models.TextField(choices=ActorType.choices)
    actor_id = models.TextField()
    added = models.BigIntegerField(default=0)
    removed = models.BigIntegerField(default=0)
    modified = models.BigIntegerField(default=0)
    note = models.TextField(null=True, blank=True)
    at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "workspace_head_moves"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["workspace", "seq"], name="ws_head_move_ws_seq")
        ]
        indexes: ClassVar[list[models.Index]] = [
            # Collection keeps the trees of the recent moves of a company (retention).
            models.Index(fields=["company", "at"], name="ws_head_move_company_at_idx"),
        ]

    def __str__(self) -> str:
        return f"move {self.seq} of {self.workspace_id}: {self.kind} {self.tree}"
