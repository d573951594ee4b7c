"""The console's pages for a workspace's history (docs/snapshots.md#the-console): the history
panel of the workspace's page, the diff of a move against its predecessor (with a side-by-side
view of a changed text file), a file browser at a move's tree, and "Restore this version…"
with its confirmation page. Each page calls the history's services; none re-reads the store.
"""

from __future__ import annotations

import difflib
from typing import Any, Final
from uuid import UUID

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.safestring import SafeString, mark_safe

from paperclip.access import Actor, board_actor
from paperclip.admin.names import run_link
from paperclip.errors import DomainError, InvalidRequest, NotFoundError
from paperclip.ids import parse_count
from paperclip.models import ExecutionWorkspace, HeartbeatRun
from paperclip.snapshots.files import FileTooLarge, file_reader, workspace_tree_node
from paperclip.snapshots.history import (
    Move,
    WorkspaceHeadMoved,
    workspace_diff,
    workspace_history,
    workspace_move,
)
from paperclip.snapshots.models import WorkspaceHeadMove
from paperclip.snapshots.restore import MIN_NOTE_CHARS, workspace_restore
from paperclip.snapshots.store.names import BlobStoreUnavailable, BlobUnreadable

PAGE_MOVES: Final = 20
DIFF_SHOWN: Final = 1000
TEXT_MAX_BYTES: Final = 256 * 1024  # larger files are not shown side by side


def _workspace(model_admin: Any, request: HttpRequest, object_id: str) -> ExecutionWorkspace:
    """The workspace if the user may see it (another company's is 404, as elsewhere)."""
    try:
        pk = UUID(object_id)
    except ValueError as exc:
        raise Http404 from exc
    workspace: ExecutionWorkspace | None = model_admin.get_queryset(request).filter(pk=pk).first()
    if workspace is None:
        raise Http404
    if not model_admin.has_view_or_change_permission(request, workspace):
        raise PermissionDenied
    return workspace


def _move(actor: Actor, workspace: ExecutionWorkspace, seq: int) -> Move:
    try:
        return workspace_move(actor=actor, workspace_id=workspace.pk, seq=seq)
    except NotFoundError as exc:
        raise Http404(exc.text) from exc


def _diff(actor: Actor, workspace: ExecutionWorkspace, before: str | None, after: str) -> Any:
    try:
        return workspace_diff(
            actor=actor,
            workspace_id=workspace.pk,
            from_tree=before,
            to_tree=after,
            limit=DIFF_SHOWN,
        )
    except NotFoundError as exc:  # a tree the store no longer holds
        raise Http404(exc.text) from exc


def _url(name: str, workspace: ExecutionWorkspace, *args: Any) -> str:
    return reverse(f"admin:paperclip_executionworkspace_{name}", args=[workspace.pk, *args])


def _moves_shown(moves: list[Move], workspace: ExecutionWorkspace) -> list[dict[str, Any]]:
    # The head is the newest move's tree: an older move to the same tree (the one a restore
    # went back to) is not the head, and keeps its "Restore this version…".
    newest = (
        WorkspaceHeadMove.objects.filter(workspace_id=workspace.pk)
        .order_by("-seq")
        .values_list("seq", flat=True)
        .first()
    )
    runs = {
        run.pk: run
        for run in HeartbeatRun.objects.filter(
            pk__in=[m.run_id for m in moves if m.run_id]
        ).select_related("agent")
    }
    return [
        {
            "move": move,
            "run": run_link(runs[move.run_id]) if move.run_id in runs else None,
            "is_head": move.seq == newest and move.tree == workspace.head_tree,
            "diff_url": _url("move_diff", workspace, move.seq),
            "files_url": _url("move_files", workspace, move.seq),
            "restore_url": _url("move_restore", workspace, move.seq),
        }
        for move in moves
    ]


def cwd_state(workspace: ExecutionWorkspace) -> str:
    """The cwd's state in words: at head, behind, failing (as the behind-head tile sees it)."""
    if not workspace.cwd:
        return "no cwd"
    if workspace.head_tree is None or workspace.cwd_tree == workspace.head_tree:
        return "at its head"
    if workspace.materialize_error:
        return f"failing: {workspace.materialize_error[:200]}"
    return "behind its head"


def history_panel(request: HttpRequest, workspace: ExecutionWorkspace) -> SafeString:
    """The workspace page's history: head, cwd state, the moves newest first, one page."""
    before = request.GET.get("before")
    try:
        page = workspace_history(
            actor=board_actor(request.user),
            workspace_id=workspace.pk,
            limit=PAGE_MOVES,
            before=parse_count(before, high=2**62) or None,
        )
    except DomainError as exc:
        return mark_safe(f"<p class='errornote'>{exc.text}</p>")  # noqa: S308 - a fixed text
    return render_to_string(
        "admin/console/workspace_history.html",
        {
            "workspace": workspace,
            "cwd_state": cwd_state(workspace),
            "moves": _moves_shown(page.moves, workspace),
            "next": page.next,
            "first_page": before is not None,
        },
        request=request,
    )


def _read_text(actor: Actor, workspace: ExecutionWorkspace, tree: str | None, path: str) -> Any:
    """A file's lines at `tree`, or a string saying why it is not shown as text."""
    if tree is None:
        return []
    try:
        node = workspace_tree_node(actor=actor, workspace_id=workspace.pk, tree=tree, path=path)
    except NotFoundError:
        return []
    if node.entry is None or node.entry.type != "file":
        return f"not a file ({node.kind})"
    if node.entry.size > TEXT_MAX_BYTES:
        return f"a large file ({node.entry.size} bytes): not shown"
    try:
        data = b"".join(file_reader(node=node).chunks)
    except FileTooLarge:
        return f"a large file ({node.entry.size} bytes): not shown"
    except NotFoundError:
        return "its bytes are gone from the store"
    except BlobUnreadable as exc:
        return f"unreadable: blob {exc.details.get('digest')} is {exc.details.get('reason')}"
    except BlobStoreUnavailable:
        return "the blob store cannot be reached: reload the page shortly"
    if b"\0" in data:
        return f"a binary file ({len(data)} bytes): not shown"
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        return f"a binary file ({len(data)} bytes): not shown"


def side_by_side(
    actor: Actor, workspace: ExecutionWorkspace, before: str | None, after: str, path: str
) -> dict[str, Any]:
    old = _read_text(actor, workspace, before, path)
    new = _read_text(actor, workspace, after, path)
    if isinstance(old, str) or isinstance(new, str):
        return {"path": path, "said": old if isinstance(old, str) else new}
    table = difflib.HtmlDiff(wrapcolumn=90).make_table(old, new, "before", "after", context=True)
    return {"path": path, "table": mark_safe(table)}  # noqa: S308 - HtmlDiff escapes the lines


def diff_view(model_admin: Any, request: HttpRequest, object_id: str, seq: int) -> HttpResponse:
    workspace = _workspace(model_admin, request, object_id)
    actor = board_actor(request.user)
    move = _move(actor, workspace, seq)
    diff = _diff(actor, workspace, move.previous_tree, move.tree)
    shown = request.GET.get("path")
    file_view = None
    if shown:
        if not any(c.path == shown for c in diff.changes):
            raise Http404("The move did not change this path.")
        file_view = side_by_side(actor, workspace, move.previous_tree, move.tree, shown)
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.model._meta,
        "title": f"Move {move.seq} of {workspace.name}",
        "workspace": workspace,
        "move": move,
        "changes": diff.changes,
        "truncated": diff.truncated,
        "change_url": request.path,
        "file_view": file_view,
        "files_url": _url("move_files", workspace, move.seq),
    }
    return TemplateResponse(request, "admin/console/workspace_diff.html", context)


def files_view(model_admin: Any, request: HttpRequest, object_id: str, seq: int) -> HttpResponse:
    workspace = _workspace(model_admin, request, object_id)
    actor = board_actor(request.user)
    move = _move(actor, workspace, seq)
    where = request.GET.get("path", "")
    try:
        node = workspace_tree_node(
            actor=actor, workspace_id=workspace.pk, tree=move.tree, path=where
        )
    except (NotFoundError, InvalidRequest) as exc:
        raise Http404(exc.text) from exc
    text = None
    if node.entries is None and node.entry is not None and node.entry.type == "file":
        lines = _read_text(actor, workspace, move.tree, node.path)
        text = lines if isinstance(lines, str) else "\n".join(lines)
    parts = node.path.split("/") if node.path else []
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.model._meta,
        "title": f"{workspace.name} at move {move.seq}: /{node.path}",
        "workspace": workspace,
        "move": move,
        "node": node,
        "text": text,
        "crumbs": [("/".join(parts[: i + 1]), part) for i, part in enumerate(parts)],
        "prefix": f"{node.path}/" if node.path else "",
    }
    return TemplateResponse(request, "admin/console/workspace_files.html", context)


def restore_view(model_admin: Any, request: HttpRequest, object_id: str, seq: int) -> HttpResponse:
    workspace = _workspace(model_admin, request, object_id)
    if not model_admin.has_change_permission(request, workspace):
        raise PermissionDenied
    actor = board_actor(request.user)
    move = _move(actor, workspace, seq)
    page = _url("change", workspace)
    error = None
    note = ""
    if request.method == "POST":
        note = request.POST.get("note", "")
        expected = request.POST.get("expected_head") or None
        try:
            done = workspace_restore(
                actor=actor,
                workspace_id=workspace.pk,
                tree=move.tree,
                expected_head=expected,
                note=note,
            )
        except WorkspaceHeadMoved as exc:
            messages.warning(
                request,
                f"Nothing changed: the head moved to {exc.details.get('head') or 'empty'} "
                "since the preview (another run published or another restore happened). "
                "Look at the history again and decide against the head of now.",
            )
            return HttpResponseRedirect(page)
        except InvalidRequest as exc:
            fields = exc.details.get("fields") or {}
            error = "; ".join(f"{k}: {' '.join(v)}" for k, v in fields.items()) or exc.text
        else:
            messages.success(
                request,
                f"Restored: the head is now {done.tree} (move {done.seq}, "
                f"{done.counts.added} added, {done.counts.removed} removed, "
                f"{done.counts.modified} modified).",
            )
            return HttpResponseRedirect(page)
        workspace.refresh_from_db()
    diff = _diff(actor, workspace, workspace.head_tree, move.tree)
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": model_admin.model._meta,
        "title": f"Restore {workspace.name} to move {move.seq}?",
        "workspace": workspace,
        "move": move,
        "changes": diff.changes,
        "truncated": diff.truncated,
        "expected_head": workspace.head_tree or "",
        "min_note": MIN_NOTE_CHARS,
        "note": note,
        "error": error,
        "page_url": page,
    }
    return TemplateResponse(request, "admin/console/workspace_restore.html", context)


def history_urls(model_admin: Any) -> list[URLPattern]:
    """The pages' routes, placed before the admin's own `<object_id>/...` catch-all."""
    wrap = model_admin.admin_site.admin_view

    def bind(view: Any) -> Any:
        return wrap(lambda request, object_id, seq: view(model_admin, request, object_id, seq))

    prefix = "paperclip_executionworkspace"
    return [
        path("<str:object_id>/moves/<int:seq>/diff/", bind(diff_view), name=f"{prefix}_move_diff"),
        path(
            "<str:object_id>/moves/<int:seq>/files/", bind(files_view), name=f"{prefix}_move_files"
        ),
        path(
            "<str:object_id>/moves/<int:seq>/restore/",
            bind(restore_view),
            name=f"{prefix}_move_restore",
        ),
    ]
