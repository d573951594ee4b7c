"""Building stored trees and run snapshots for publishing tests."""

from __future__ import annotations

import io
from uuid import UUID

from paperclip.models import HeartbeatRun, NativeRunResult, RunSnapshot
from paperclip.snapshots.store.uploads import cas_put
from paperclip.snapshots.trees import Entry, blob_name, build

type Files = dict[str, bytes | str]  # path → content (str: a symlink target)


def put_blob(company_id: UUID, data: bytes) -> str:
    name = blob_name(data)
    cas_put(company_id=company_id, digest=name, stream=io.BytesIO(data), length=len(data))
    return name


def entries_of(company_id: UUID, files: Files, *, store: bool = True) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for path, content in files.items():
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            entries.setdefault(parent, Entry(name=parts[depth - 1], type="dir", mode=0o755))
        if isinstance(content, str):
            entries[path] = Entry(name=parts[-1], type="symlink", target=content)
            continue
        digest = put_blob(company_id, content) if store else blob_name(content)
        entries[path] = Entry(
            name=parts[-1], type="file", mode=0o644, size=len(content), digest=digest
        )
    return entries


def store_tree(company_id: UUID, files: Files) -> str:
    """Store `files` and their directories; the tree's name."""
    root, blobs = build(entries_of(company_id, files))
    for data in blobs.values():
        put_blob(company_id, data)
    return root


def snapshot_result(
    run: HeartbeatRun, result: NativeRunResult, tree: str, base: str | None
) -> None:
    """Register `tree` for the run (as the API would) and make its result name it."""
    assert run.execution_workspace_id is not None
    RunSnapshot.objects.create(
        company_id=run.company_id,
        run_id=run.pk,
        execution_workspace_id=run.execution_workspace_id,
        tree=tree,
        base=base,
        files=0,
        bytes=0,
        lease_generation=1,
    )
    result.result_json = {**result.result_json, "workspaceTree": tree}
    result.save(update_fields=["result_json"])
