"""A workspace's content in the content-addressed store (docs/snapshots.md): the store's
blobs and their chunks, the trees runs registered, and the counts of trees the publisher built."""

from __future__ import annotations

import uuid
from typing import ClassVar

from django.db import models
from django.db.models.functions import Now

from paperclip.models.tenancy import Company
from paperclip.models.workspaces import ExecutionWorkspace


class CasBlob(models.Model):
    """A blob of a company's content-addressed store (docs/snapshots.md#the-store): its name is
    the sha256 of its bytes. The bytes live in the backend (`PAPERCLIP_CAS_BACKEND`): files
    under the data directory, or `CasBlobChunk` rows. `referenced_at` moves whenever an
    upload or a snapshot names the blob; the collector keeps anything younger than the grace."""

    id = models.BigAutoField(primary_key=True)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    digest = models.TextField()
    size = models.BigIntegerField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    referenced_at = models.DateTimeField(db_default=Now())
    # Marked by a collection, in its own committed transaction, before it deletes the bytes:
    # a doomed row is missing to find-missing and to pins (so its blob is uploaded again, which
    # clears the mark), and should the collection die between the bytes and its commit, the
    # next one finishes it (docs/snapshots.md#collection).
    doomed = models.BooleanField(default=False, db_default=False)

    class Meta:
        db_table = "cas_blobs"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["company", "digest"], name="cas_blobs_company_digest")
        ]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["referenced_at"], name="cas_blobs_referenced_idx")
        ]

    def __str__(self) -> str:
        return self.digest


class CasBlobChunk(models.Model):
    """The bytes of a blob in the `postgres` backend, in pieces of at most 1 MiB."""

    id = models.BigAutoField(primary_key=True)
    blob = models.ForeignKey(CasBlob, on_delete=models.CASCADE, related_name="chunks")
    seq = models.IntegerField()
    data = models.BinaryField()

    class Meta:
        db_table = "cas_blob_chunks"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["blob", "seq"], name="cas_blob_chunks_blob_seq")
        ]

    def __str__(self) -> str:
        return f"{self.blob_id}#{self.seq}"


class RunSnapshot(models.Model):
    """A tree a run's agent registered (docs/snapshots.md#snapshots), fenced by the runtime
    lease it held; `base` is the head its checkout started from (null: empty)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    run = models.ForeignKey("HeartbeatRun", on_delete=models.CASCADE, related_name="snapshots")
    execution_workspace = models.ForeignKey(
        ExecutionWorkspace, on_delete=models.CASCADE, related_name="run_snapshots"
    )
    tree = models.TextField()
    base = models.TextField(null=True, blank=True)
    files = models.BigIntegerField()
    bytes = models.BigIntegerField()
    # Entries of every kind (null: registered before this was counted); a later registration
    # compares its tree with a head that has it instead of walking the whole tree.
    entries = models.BigIntegerField(null=True, blank=True)
    lease_generation = models.BigIntegerField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "run_snapshots"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["run", "tree"], name="run_snapshots_run_tree")
        ]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["company", "tree"], name="run_snapshots_company_tree_idx")
        ]

    def __str__(self) -> str:
        return self.tree


class TreeCounts(models.Model):
    """The counts of a tree the workspace publisher built itself (a merge of two runs' trees,
    an adopted cwd), as `run_snapshots` holds them for registered trees: with them, a run
    registering against such a head compares trees instead of walking the whole one
    (docs/snapshots.md#registering-against-the-head). A function of the tree's content, so
    never stale; deleted by collection with the tree's root blob."""

    id = models.BigAutoField(primary_key=True)
    company = models.ForeignKey(Company, on_delete=models.CASCADE, related_name="+")
    tree = models.TextField()
    files = models.BigIntegerField()
    bytes = models.BigIntegerField()
    entries = models.BigIntegerField()  # entries of every kind, the root not counted
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "tree_counts"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(fields=["company", "tree"], name="tree_counts_company_tree")
        ]

    def __str__(self) -> str:
        return self.tree
