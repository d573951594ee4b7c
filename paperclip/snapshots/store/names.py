"""Blob names, the store's limits and errors, and which company a caller stores for
(docs/snapshots.md#the-store)."""

from __future__ import annotations

import re
from typing import Final
from uuid import UUID

from django.conf import settings

from paperclip.access import Actor
from paperclip.errors import (
    DomainError,
    InvalidRequest,
    NotFoundError,
    PayloadTooLargeError,
    RuleViolationError,
)
from paperclip.ids import parse_uuid
from paperclip.models import Company

BLOB_NAME: Final = re.compile(r"sha256:[0-9a-f]{64}")


CHUNK_BYTES: Final = 1024 * 1024  # one CasBlobChunk row (postgres backend)


READ_BYTES: Final = 64 * 1024  # what is read from a request or a file at a time


SPOOL_BYTES: Final = 1024 * 1024  # a spooled upload moves to a temporary file past this


MAX_FIND_MISSING: Final = 10_000


MAX_BATCH_BLOBS: Final = 10_000
# With the s3 backend each blob of a batch is a round trip to the store, so a batch of 10,000
# small blobs could outlast a client's 30 s timeout on a slow store; the client's retry would
# then find the first attempt's rows still locked (409 resource_busy). 500 keeps a batch to
# seconds even at 100 PUTs a second.
S3_MAX_BATCH_BLOBS: Final = 500


def max_batch_blobs() -> int:
    """The most frames a batch upload may hold with the configured backend."""
    return S3_MAX_BATCH_BLOBS if settings.PAPERCLIP_CAS_BACKEND == "s3" else MAX_BATCH_BLOBS


MAX_FRAME_HEADER: Final = 128  # `sha256:<64 hex> <size>\n` is at most 88 bytes


# Directory blobs are read whole; one this large is not a directory anyone meant.
MAX_DIRECTORY_BYTES: Final = 64 * 1024 * 1024


class BlobDigestMismatch(DomainError):  # 400
    code = "blob_digest_mismatch"
    message = "The bytes do not hash to the blob's name; nothing was stored."
    status_code = 400


class BlobUnreadable(RuleViolationError):  # 422, details.digest and details.reason
    code = "blob_unreadable"
    message = (
        "The store holds this blob but its bytes cannot be read back as it: they are gone "
        "from the backend or do not hash to its name. They are never served as the blob."
    )
    remediation = "Upload the blob again (PUT /api/cas/blobs/{name}): that writes its bytes anew."


class BlobStoreUnavailable(DomainError):  # 503 with Retry-After, details.reason
    code = "blob_store_unavailable"
    message = "The blob store cannot be reached; nothing was changed. Retry shortly."
    remediation = "Retry after the number of seconds in the Retry-After header."
    status_code = 503
    retry_after_seconds = 5


class BlobTooLarge(PayloadTooLargeError):  # 413, details.max_bytes
    code = "blob_too_large"
    message = "The blob is larger than the store accepts (PAPERCLIP_CAS_MAX_BLOB_BYTES)."


class BatchTooLarge(PayloadTooLargeError):  # 413, details.max_bytes
    code = "request_too_large"
    message = "The batch is larger than the store accepts (PAPERCLIP_CAS_MAX_BATCH_BYTES)."


def blob_name_problem(name: object) -> str | None:
    """Why `name` is not a blob name, or None."""
    if not isinstance(name, str) or not BLOB_NAME.fullmatch(name):
        return "Must be a blob name: sha256:<64 lowercase hex digits>."
    return None


def checked_name(name: object, field: str = "name") -> str:
    if (problem := blob_name_problem(name)) is not None:
        raise InvalidRequest(fields={field: [problem]})
    assert isinstance(name, str)  # noqa: S101 - blob_name_problem checked it
    return name


def cas_company(*, actor: Actor, company_id: str | None) -> UUID:
    """The company whose store the caller uses: an agent's own (a `company_id` naming any other
    is a 404); a board caller must name one it belongs to (`company_id` query parameter):
    missing or malformed is 400 `invalid_request`, another company or none at all 404."""
    if actor.is_agent:
        assert actor.agent is not None  # noqa: S101 - an agent actor carries its agent
        own: UUID = actor.agent.company_id
        if company_id is not None and parse_uuid(company_id) != own:
            raise NotFoundError()
        return own
    if company_id is None:
        raise InvalidRequest(fields={"company_id": ["Required for a board caller."]})
    parsed = parse_uuid(company_id)
    if parsed is None:
        raise InvalidRequest(fields={"company_id": ["Must be a valid UUID."]})
    if not actor.can_access(parsed) or not Company.objects.filter(pk=parsed).exists():
        raise NotFoundError()
    return parsed


def cas_limits() -> dict[str, int]:
    """What a client needs to plan uploads (`GET /api/cas`)."""
    return {
        "max_blob_bytes": settings.PAPERCLIP_CAS_MAX_BLOB_BYTES,
        "max_batch_bytes": settings.PAPERCLIP_CAS_MAX_BATCH_BYTES,
        "max_batch_blobs": max_batch_blobs(),
        "max_find_missing": MAX_FIND_MISSING,
    }
