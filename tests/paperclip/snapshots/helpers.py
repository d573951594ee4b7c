"""Helpers of the store's tests."""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import UUID

import obstore
from django.conf import settings

from paperclip.models import CasBlob, CasBlobChunk
from paperclip.snapshots.store.backends import blob_path
from paperclip.snapshots.store.s3 import S3Backend


def name_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def frames(*blobs: bytes, names: list[str] | None = None) -> bytes:
    out = b""
    for index, data in enumerate(blobs):
        name = names[index] if names is not None else name_of(data)
        out += f"{name} {len(data)}\n".encode() + data
    return out


def kept(company_id: UUID | str, name: str) -> dict[str, Any]:
    """What the store holds of `name` for the company: row, chunks, file (the s3 backend's
    object when it is the backend)."""
    row = CasBlob.objects.filter(company_id=company_id, digest=name).first()
    return {
        "row": row is not None,
        "chunks": CasBlobChunk.objects.filter(
            blob__company_id=company_id, blob__digest=name
        ).exists(),
        "file": s3_object_exists(company_id, name)
        if settings.PAPERCLIP_CAS_BACKEND == "s3"
        else blob_path(company_id, name).exists(),
    }


def s3_object_exists(company_id: UUID | str, name: str) -> bool:
    backend = S3Backend()
    try:
        obstore.head(backend.store, backend.key(company_id, name))
    except FileNotFoundError:
        return False
    return True


NOTHING = {"row": False, "chunks": False, "file": False}
