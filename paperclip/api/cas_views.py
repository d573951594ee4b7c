"""The content-addressed store's API (docs/snapshots.md#the-store) and a workspace's head.

Agents use their own company's store; a board caller names the company with the `company_id`
query parameter. Blob bodies are raw bytes (`application/octet-stream`), read from the request
stream in pieces by the services, never through a parser (DRF's `request.data` is never
touched here), so neither the JSON parser nor DATA_UPLOAD_MAX_MEMORY_SIZE applies to them:
the store's own limits do, as the bytes arrive.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.http import HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import serializers, status
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from paperclip import selectors
from paperclip.api.auth import IsAgentOrBoard, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    RESOURCE_BUSY,
    StrictInputSerializer,
    error_responses,
)
from paperclip.errors import InvalidRequest, NotFoundError
from paperclip.ids import parse_count
from paperclip.snapshots.store.batch import cas_put_batch
from paperclip.snapshots.store.batch_read import (
    MAX_BATCH_READ_BLOBS,
    MAX_BATCH_READ_BYTES,
    cas_read_batch,
    checked_names,
    frame_stream,
)
from paperclip.snapshots.store.names import MAX_FIND_MISSING, cas_company, cas_limits
from paperclip.snapshots.store.reads import cas_blob_redirect, cas_find_missing, cas_open
from paperclip.snapshots.store.uploads import cas_put

COMPANY_PARAMETER = OpenApiParameter(
    "company_id",
    OpenApiTypes.UUID,
    OpenApiParameter.QUERY,
    required=False,
    description=(
        "The company whose store to use: required for a board caller; an agent uses its own "
        "(naming another company is a 404)."
    ),
)
NAME_PARAMETER = OpenApiParameter(
    "name",
    str,
    OpenApiParameter.PATH,
    pattern=r"^sha256:[0-9a-f]{64}$",
    description="The blob's name: `sha256:` and the 64 lowercase hex digits of its SHA-256.",
)
TOO_LARGE = (413, "blob_too_large")
DIGEST_MISMATCH = (400, "blob_digest_mismatch")
UNREADABLE = (422, "blob_unreadable")
STORE_UNAVAILABLE = (503, "blob_store_unavailable")


def _company(request: Request) -> UUID:
    return cas_company(actor=actor_for(request), company_id=request.query_params.get("company_id"))


def _content_length(request: Request) -> int:
    value = parse_count(request.META.get("CONTENT_LENGTH") or "0", high=2**63 - 1)
    if value is None:
        raise InvalidRequest(fields={"body": ["Content-Length is not a number."]})
    return value


def _body(request: Request) -> Any:
    # The Django request itself: a stream bounded by Content-Length (DRF's `request.stream`
    # is that same object, or None for an empty body).
    return request.stream


class CasLimitsApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="CasLimits")
    class OutputSerializer(serializers.Serializer[Any]):
        max_blob_bytes = serializers.IntegerField()
        max_batch_bytes = serializers.IntegerField()
        max_batch_blobs = serializers.IntegerField()
        max_find_missing = serializers.IntegerField()

    @extend_schema(
        operation_id="cas_limits",
        summary="The content-addressed store's limits, to plan uploads",
        responses={200: OutputSerializer, **error_responses(*AUTH_ERRORS)},
    )
    def get(self, request: Request) -> Response:
        return Response(cas_limits())


class CasFindMissingApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="CasFindMissingInput")
    class InputSerializer(StrictInputSerializer):
        digests = serializers.ListField(
            child=serializers.CharField(trim_whitespace=False, max_length=71),
            max_length=MAX_FIND_MISSING,
            help_text="Blob names (`sha256:<64 hex>`), at most 10,000.",
        )

    @extend_schema_serializer(component_name="CasFindMissing")
    class OutputSerializer(serializers.Serializer[Any]):
        missing = serializers.ListField(
            child=serializers.CharField(),
            help_text="The names the company's store lacks, in request order (a name asked "
            "twice is answered twice); another company's blobs count as missing.",
        )

    @extend_schema(
        operation_id="cas_find_missing",
        summary="Which of these blobs the company's store lacks",
        parameters=[COMPANY_PARAMETER],
        request=InputSerializer,
        responses={
            200: OutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def post(self, request: Request) -> Response:
        company_id = _company(request)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        missing = cas_find_missing(company_id=company_id, digests=data.validated_data["digests"])
        return Response({"missing": missing})


@extend_schema_serializer(component_name="CasBlobStored")
class BlobStoredSerializer(serializers.Serializer[Any]):
    digest = serializers.CharField()
    size = serializers.IntegerField()
    created = serializers.BooleanField(help_text="False when the store already had it.")


class CasBlobApi(APIView):
    """GET streams a blob; PUT stores one. One class for the one path (Django routes a path to
    a single view)."""

    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        # A download may ask for `application/octet-stream`, which the JSON renderer does not
        # offer: the bytes bypass renderers anyway, and errors are still JSON.
        result: tuple[BaseRenderer, str] = super().perform_content_negotiation(request, force=True)
        return result

    @extend_schema(
        operation_id="cas_blob_get",
        summary="Download a blob's bytes",
        parameters=[NAME_PARAMETER, COMPANY_PARAMETER],
        responses={
            (200, "application/octet-stream"): OpenApiResponse(
                OpenApiTypes.BINARY,
                description="The blob's bytes, with Content-Length. Verified against the "
                "name as they are read: a mismatch that shows only at the end cuts the "
                "stream short of its Content-Length.",
            ),
            307: OpenApiResponse(
                description="s3 backend with PAPERCLIP_CAS_S3_REDIRECT: `Location` is a "
                "short-lived pre-signed URL of the object; fetch it without this API's "
                "Authorization header and verify the bytes against the name."
            ),
            **error_responses(
                *AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND, UNREADABLE, STORE_UNAVAILABLE
            ),
        },
    )
    def get(self, request: Request, name: str) -> HttpResponseBase:
        company_id = _company(request)
        location = cas_blob_redirect(company_id=company_id, digest=name)
        if location is not None:
            # 307: the store's URL is fetched without this API's Authorization header (the
            # agents' client drops it) and the bytes are verified by the reader.
            redirect = HttpResponse(status=307)
            redirect["Location"] = location
            redirect["Cache-Control"] = "no-store"
            return redirect
        reader = cas_open(company_id=company_id, digest=name)
        if reader is None:
            raise NotFoundError()
        response = StreamingHttpResponse(reader.chunks, content_type="application/octet-stream")
        response["Content-Length"] = str(reader.size)
        return response

    @extend_schema(
        operation_id="cas_blob_put",
        summary="Upload a blob: raw bytes, hashed as they arrive (201 new, 200 already stored)",
        parameters=[NAME_PARAMETER, COMPANY_PARAMETER],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={
            201: BlobStoredSerializer,
            200: BlobStoredSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                DIGEST_MISMATCH,
                NOT_FOUND,
                RESOURCE_BUSY,
                TOO_LARGE,
                STORE_UNAVAILABLE,
            ),
        },
    )
    def put(self, request: Request, name: str) -> Response:
        company_id = _company(request)
        stored = cas_put(
            company_id=company_id,
            digest=name,
            stream=_body(request),
            length=_content_length(request),
        )
        return Response(
            {"digest": stored.digest, "size": stored.size, "created": stored.created},
            status=status.HTTP_201_CREATED if stored.created else status.HTTP_200_OK,
        )


class CasBatchApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="CasBatchStored")
    class OutputSerializer(serializers.Serializer[Any]):
        stored = serializers.ListField(child=serializers.CharField(), help_text="New blobs.")
        existing = serializers.ListField(
            child=serializers.CharField(), help_text="Blobs the store already had."
        )

    @extend_schema(
        operation_id="cas_batch_upload",
        summary="Upload many blobs in one body of frames (`<name> <size>\\n` then the bytes)",
        description=(
            "The body is a sequence of frames, each an ASCII header line `<name> <size>\\n` "
            "followed by exactly `size` bytes. Every blob is verified like a single upload; "
            "all or nothing."
        ),
        parameters=[COMPANY_PARAMETER],
        request={"application/octet-stream": OpenApiTypes.BINARY},
        responses={
            200: OutputSerializer,
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                DIGEST_MISMATCH,
                NOT_FOUND,
                RESOURCE_BUSY,
                TOO_LARGE,
                (413, "request_too_large"),
                STORE_UNAVAILABLE,
            ),
        },
    )
    def post(self, request: Request) -> Response:
        company_id = _company(request)
        batch = cas_put_batch(
            company_id=company_id, stream=_body(request), length=_content_length(request)
        )
        return Response({"stored": batch.stored, "existing": batch.existing})


class CasBatchReadApi(APIView):
    """Many small blobs in one answer of frames (docs/snapshots.md#batch-read)."""

    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        # The answer is bytes (as a blob download's); errors are still JSON.
        result: tuple[BaseRenderer, str] = super().perform_content_negotiation(request, force=True)
        return result

    @extend_schema_serializer(component_name="CasBatchReadInput")
    class InputSerializer(StrictInputSerializer):
        digests = serializers.ListField(
            child=serializers.CharField(trim_whitespace=False, max_length=71),
            min_length=1,
            max_length=MAX_BATCH_READ_BLOBS,
            help_text=f"Blob names (`sha256:<64 hex>`), at most {MAX_BATCH_READ_BLOBS:,}, "
            f"their sizes adding up to at most {MAX_BATCH_READ_BYTES:,} bytes.",
        )

    @extend_schema(
        operation_id="cas_batch_read",
        summary="Read many small blobs in one answer of frames (`<name> <size>\\n` then the bytes)",
        description=(
            "The answer is a sequence of frames in request order (a name asked twice is "
            "answered once), each an ASCII header line `<name> <size>\\n` followed by exactly "
            "`size` bytes, every blob verified against its name before the answer starts. "
            "All or nothing: a name the company does not hold is 404 with `details.digests`."
        ),
        parameters=[COMPANY_PARAMETER],
        request=InputSerializer,
        responses={
            (200, "application/octet-stream"): OpenApiResponse(
                OpenApiTypes.BINARY, description="The frames, with Content-Length."
            ),
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                (413, "request_too_large"),
                UNREADABLE,
                STORE_UNAVAILABLE,
            ),
        },
    )
    def post(self, request: Request) -> HttpResponseBase:
        company_id = _company(request)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        batch = cas_read_batch(
            company_id=company_id, digests=checked_names(data.validated_data["digests"])
        )
        pieces = frame_stream(batch)
        response = StreamingHttpResponse(pieces, content_type="application/octet-stream")
        response["Content-Length"] = str(sum(len(piece) for piece in pieces))
        return response


class ExecutionWorkspaceHeadApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="ExecutionWorkspaceHead")
    class OutputSerializer(serializers.Serializer[Any]):
        tree = serializers.CharField(allow_null=True, help_text="Null: the workspace is empty.")
        run_id = serializers.UUIDField(allow_null=True)
        committed_at = serializers.DateTimeField(allow_null=True)

    @extend_schema(
        operation_id="execution_workspace_head",
        summary="The workspace's head: the tree the last committed run published",
        responses={200: OutputSerializer, **error_responses(*AUTH_ERRORS, NOT_FOUND)},
    )
    def get(self, request: Request, workspace_id: UUID) -> Response:
        workspace = selectors.execution_workspace_get(
            actor=actor_for(request), workspace_id=workspace_id
        )
        body = {
            "tree": workspace.head_tree,
            "run_id": workspace.head_run_id,
            "committed_at": workspace.head_committed_at,
        }
        return Response(self.OutputSerializer(body).data)
