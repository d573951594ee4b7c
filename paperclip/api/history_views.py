"""A workspace's history API (docs/snapshots.md#history): its head's moves, the diff of two
trees of its company, the files of a recorded tree, and the board's restore. Each view
translates the request, calls one service of `paperclip.snapshots` and renders its result."""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.http import StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_serializer,
)
from rest_framework import serializers
from rest_framework.permissions import IsAuthenticated
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from paperclip.api.auth import IsAgentOrBoard, IsBoard, actor_for
from paperclip.api.serializers import (
    AUTH_ERRORS,
    INVALID_REQUEST,
    NOT_FOUND,
    StrictInputSerializer,
    error_responses,
)
from paperclip.errors import InvalidRequest
from paperclip.ids import parse_count
from paperclip.snapshots.diff import TreeDiff
from paperclip.snapshots.files import file_reader, workspace_tree_node
from paperclip.snapshots.history import (
    DIFF_LIMIT_DEFAULT,
    DIFF_LIMIT_MAX,
    EMPTY_TREE,
    HISTORY_LIMIT_DEFAULT,
    HISTORY_LIMIT_MAX,
    tree_name,
    workspace_diff,
    workspace_history,
)
from paperclip.snapshots.restore import MAX_NOTE_CHARS, MIN_NOTE_CHARS, workspace_restore

HEAD_MOVED = (409, "workspace_head_moved")
FILE_TOO_LARGE = (422, "file_too_large")


@extend_schema_serializer(component_name="ChangeCounts")
class CountsSerializer(serializers.Serializer[Any]):
    added = serializers.IntegerField()
    removed = serializers.IntegerField()
    modified = serializers.IntegerField()


@extend_schema_serializer(component_name="HeadMoveActor")
class ActorSerializer(serializers.Serializer[Any]):
    type = serializers.ChoiceField(choices=["agent", "board", "system"])
    id = serializers.CharField()


@extend_schema_serializer(component_name="WorkspaceHeadMove")
class MoveSerializer(serializers.Serializer[Any]):
    seq = serializers.IntegerField(help_text="1, 2, ... in the order of the workspace's moves.")
    tree = serializers.CharField()
    previous_tree = serializers.CharField(allow_null=True, help_text="Null: the empty tree.")
    kind = serializers.ChoiceField(
        choices=["publish", "merge", "resolution", "adoption", "restore"]
    )
    run_id = serializers.UUIDField(allow_null=True)
    action_id = serializers.UUIDField(allow_null=True)
    actor = ActorSerializer()
    at = serializers.DateTimeField()
    note = serializers.CharField(allow_null=True)
    counts = CountsSerializer(help_text="Paths added, removed and modified (directories too).")


def _integer(request: Request, name: str, default: int | None, high: int) -> int | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = parse_count(raw, high=high)
    if value is None or value < 1:
        raise InvalidRequest(fields={name: [f"Must be a whole number 1..{high}."]})
    return value


class WorkspaceHistoryApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="WorkspaceHistory")
    class OutputSerializer(serializers.Serializer[Any]):
        results = MoveSerializer(many=True, help_text="Newest first.")
        next = serializers.IntegerField(
            allow_null=True, help_text="Pass as `before` for the next page; null: no more."
        )

    @extend_schema(
        operation_id="execution_workspace_history",
        summary="Every move of the workspace's head, newest first (agent or board)",
        parameters=[
            OpenApiParameter("limit", int, OpenApiParameter.QUERY, description="1..500, 50."),
            OpenApiParameter("before", int, OpenApiParameter.QUERY, description="A `seq`."),
        ],
        responses={
            200: OutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def get(self, request: Request, workspace_id: UUID) -> Response:
        limit = _integer(request, "limit", HISTORY_LIMIT_DEFAULT, HISTORY_LIMIT_MAX)
        before = _integer(request, "before", None, 2**62)
        page = workspace_history(
            actor=actor_for(request),
            workspace_id=workspace_id,
            limit=limit or HISTORY_LIMIT_DEFAULT,
            before=before,
        )
        return Response({"results": [move.as_json() for move in page.moves], "next": page.next})


def diff_json(diff: TreeDiff) -> dict[str, Any]:
    return {
        "from": diff.before if diff.before is not None else EMPTY_TREE,
        "to": diff.after,
        "changes": [change.as_json() for change in diff.changes],
        "truncated": diff.truncated,
    }


# The one shape of a change, shared with the board's conflict preview (recovery.api.views).
class ConflictTreeEntrySerializer(serializers.Serializer[Any]):
    """An entry of a tree at one path: a file's type, mode, size and digest (or chunks), a
    directory's type and mode, a symlink's type and target."""

    type = serializers.ChoiceField(choices=("file", "dir", "symlink"))
    mode = serializers.IntegerField(required=False)
    size = serializers.IntegerField(required=False)
    digest = serializers.CharField(required=False)
    chunks = serializers.ListField(child=serializers.CharField(), required=False)
    target = serializers.CharField(required=False)


class ConflictTreeChangeSerializer(serializers.Serializer[Any]):
    path = serializers.CharField()
    change = serializers.ChoiceField(choices=("added", "removed", "modified"))
    from_ = ConflictTreeEntrySerializer(allow_null=True)
    to = ConflictTreeEntrySerializer(allow_null=True)

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        fields["from"] = fields.pop("from_")  # `from` is a keyword
        return fields


class WorkspaceDiffApi(APIView):
    permission_classes = (IsAuthenticated, IsAgentOrBoard)

    @extend_schema_serializer(component_name="TreeDiff")
    class OutputSerializer(serializers.Serializer[Any]):
        to = serializers.CharField()
        changes = ConflictTreeChangeSerializer(many=True, help_text="Sorted by path.")
        truncated = serializers.BooleanField()

        def get_fields(self) -> dict[str, Any]:
            fields = super().get_fields()
            fields["from"] = serializers.CharField(help_text="A tree, or `empty`.")
            return fields

    @extend_schema(
        operation_id="execution_workspace_diff",
        summary="The changes between two trees of the workspace's company, path by path",
        parameters=[
            OpenApiParameter(
                "from",
                str,
                OpenApiParameter.QUERY,
                required=True,
                description="A tree (`sha256:<64 hex>`), or `empty`.",
            ),
            OpenApiParameter("to", str, OpenApiParameter.QUERY, required=True),
            OpenApiParameter("limit", int, OpenApiParameter.QUERY, description="1..10000, 1000."),
        ],
        responses={
            200: OutputSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND),
        },
    )
    def get(self, request: Request, workspace_id: UUID) -> Response:
        raw_from, raw_to = request.query_params.get("from"), request.query_params.get("to")
        if raw_from is None or raw_to is None:
            missing = [n for n, v in (("from", raw_from), ("to", raw_to)) if v is None]
            raise InvalidRequest(fields={name: ["This parameter is required."] for name in missing})
        from_tree = None if raw_from == EMPTY_TREE else tree_name(raw_from, "from")
        limit = _integer(request, "limit", DIFF_LIMIT_DEFAULT, DIFF_LIMIT_MAX)
        diff = workspace_diff(
            actor=actor_for(request),
            workspace_id=workspace_id,
            from_tree=from_tree,
            to_tree=tree_name(raw_to, "to"),
            limit=limit or DIFF_LIMIT_DEFAULT,
        )
        return Response(diff_json(diff))


class WorkspaceFilesApi(APIView):
    permission_classes = (IsAuthenticated, IsBoard)

    def perform_content_negotiation(
        self, request: Request, force: bool = False
    ) -> tuple[BaseRenderer, str]:
        # A file's bytes bypass renderers (a download may ask for octet-stream); errors and
        # directories are JSON.
        result: tuple[BaseRenderer, str] = super().perform_content_negotiation(request, force=True)
        return result

    @extend_schema(
        operation_id="execution_workspace_files",
        summary="A directory's entries, or a file's bytes, at a recorded tree (board)",
        parameters=[
            OpenApiParameter("tree", str, OpenApiParameter.QUERY, required=True),
            OpenApiParameter("path", str, OpenApiParameter.QUERY, description="Default: root."),
        ],
        responses={
            (200, "application/json"): OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="A directory: `{tree, path, type: dir, entries}`; a symlink: "
                "`{tree, path, type: symlink, target}`.",
            ),
            (200, "application/octet-stream"): OpenApiResponse(
                OpenApiTypes.BINARY, description="A file's bytes, with Content-Length."
            ),
            **error_responses(
                *AUTH_ERRORS,
                INVALID_REQUEST,
                NOT_FOUND,
                FILE_TOO_LARGE,
                (422, "blob_unreadable"),
                (503, "blob_store_unavailable"),
            ),
        },
    )
    def get(self, request: Request, workspace_id: UUID) -> Response | StreamingHttpResponse:
        tree = request.query_params.get("tree")
        if tree is None:
            raise InvalidRequest(fields={"tree": ["This parameter is required."]})
        node = workspace_tree_node(
            actor=actor_for(request),
            workspace_id=workspace_id,
            tree=tree,
            path=request.query_params.get("path", ""),
        )
        if node.entry is None or node.entry.type != "file":
            return Response(node.as_json())
        reader = file_reader(node=node)
        response = StreamingHttpResponse(reader.chunks, content_type="application/octet-stream")
        response["Content-Length"] = str(reader.size)
        return response


class WorkspaceRestoreApi(APIView):
    permission_classes = (IsAuthenticated, IsBoard)

    @extend_schema_serializer(component_name="WorkspaceRestoreInput")
    class InputSerializer(StrictInputSerializer):
        tree = serializers.CharField(help_text="A tree of this workspace's history.")
        expected_head = serializers.CharField(
            allow_null=True, help_text="The head the board saw (null: empty)."
        )
        note = serializers.CharField(
            min_length=MIN_NOTE_CHARS,
            max_length=MAX_NOTE_CHARS,
            help_text="Why, for the history and the audit log.",
        )

    @extend_schema(
        operation_id="execution_workspace_restore",
        summary="Move the head back to a tree of the workspace's history (board)",
        request=InputSerializer,
        responses={
            200: MoveSerializer,
            **error_responses(*AUTH_ERRORS, INVALID_REQUEST, NOT_FOUND, HEAD_MOVED),
        },
    )
    def post(self, request: Request, workspace_id: UUID) -> Response:
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        move = workspace_restore(
            actor=actor_for(request), workspace_id=workspace_id, **data.validated_data
        )
        return Response(move.as_json())
