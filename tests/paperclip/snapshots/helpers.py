"""Helpers of the store's tests."""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import UUID

from paperclip.models import CasBlob, CasBlobChunk
from paperclip.snapshots.store.backends import blob_path


def name_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def frames(*blobs: bytes, names: list[str] | None = None) -> bytes:
    out = b""
    for index, data in enumerate(blobs):
        name = names[index] if names is not None else name_of(data)
        out += f"{name} {len(data)}\n".encode() + data
    return out


def kept(company_id: UUID | str, name: str) -> dict[str, Any]:
    """What the store holds of `name` for the company: row, chunks, file."""
    row = CasBlob.objects.filter(company_id=company_id, digest=name).first()
    return {
        "row": row is not None,
        "chunks": CasBlobChunk.objects.filter(
            blob__company_id=company_id, blob__digest=name
        ).exists(),
        "file": blob_path(company_id, name).exists(),
    }


NOTHING = {"row": False, "chunks": False, "file": False}
