"""The workspace conflict resolution's page and message: the preview of each resolution
against the head of now, the head posted back, and what the worker did once resolved."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.http import HttpRequest

from paperclip.access import board_actor
from paperclip.admin.toolkit import short_id
from paperclip.errors import DomainError, InvalidRequest
from paperclip.models import ActivityEvent
from paperclip.snapshots.resolutions import MAX_PREVIEW_CHANGES
from paperclip.snapshots.trees import BLOB_NAME
from recovery.models import IssueRecoveryAction
from recovery.selectors.finalization import finalization_await
from recovery.services.conflict_resolution import workspace_conflict_preview
from recovery.services.conflicts import HeadExpected


@dataclass(frozen=True, slots=True)
class PreviewRow:
    """One resolution of the preview as the resolve page lists it."""

    name: str
    label: str
    tree: str | None
    added: list[str]
    removed: list[str]
    modified: list[str]
    truncated: bool
    error: str | None
    changes: list[Any]  # the shown changes, drawn by admin/console/changes.html


def conflict_preview(request: HttpRequest, hold: IssueRecoveryAction) -> dict[str, Any]:
    """The preview of each resolution against the head of now, for the resolve page; an
    unreadable tree or a hold that names no run is shown as such, not as a failed page."""
    try:
        preview = workspace_conflict_preview(
            actor=board_actor(request.user), issue_id=hold.source_issue_id, action_id=hold.pk
        )
    except DomainError as exc:
        return {"error": f"{exc.code}: {exc.text}"}
    rows = []
    labels = {"publish": "Publish", "keep_head": "Keep the head"}
    for name, outcome in preview.outcomes.items():
        label = labels[name]
        shown = outcome.changes[:MAX_PREVIEW_CHANGES]
        rows.append(
            PreviewRow(
                name=name,
                label=label,
                tree=outcome.tree,
                added=[c.path for c in shown if c.change == "added"],
                removed=[c.path for c in shown if c.change == "removed"],
                modified=[c.path for c in shown if c.change == "modified"],
                truncated=len(outcome.changes) > MAX_PREVIEW_CHANGES,
                error=outcome.error,
                changes=list(shown),
            )
        )
    return {
        "head": preview.head,
        "expected": preview.head or EMPTY_HEAD,
        "conflicts": [
            {
                "path": c.path,
                "base": _entry_text(c.base),
                "head": _entry_text(c.head),
                "run": _entry_text(c.run),
            }
            for c in preview.conflicts
        ],
        "conflict_count": preview.conflict_count,
        "outcomes": rows,
    }


EMPTY_HEAD = "empty"


def _entry_text(entry: Any) -> str:
    if entry is None:
        return "absent"
    if entry.type == "dir":
        return f"directory {entry.mode:o}"
    if entry.type == "symlink":
        return f"symlink → {entry.target}"
    digest = entry.digest or (entry.chunks[0] if entry.chunks else "")
    return f"file {entry.mode:o}, {entry.size} bytes, {digest[7:19]}"


def posted_head(
    request: HttpRequest, hold: IssueRecoveryAction, resolution: str
) -> HeadExpected | None:
    """The head the page previewed for `hold` (posted back). Publishing the run's tree or
    keeping the head decides against that head and needs it: without it (a page whose preview
    failed, a form cut short) the decision would apply to whatever the head is by then,
    which nobody saw, so it is refused. Discarding the run's tree leaves the head as it is
    and needs no preview (None)."""
    posted = request.POST.get(f"expected_head_{hold.pk}")
    if posted is None or posted == "":
        if resolution == "discard":
            return None
        raise InvalidRequest(
            "No previewed head was posted for this hold (its preview failed or the form was"
            " cut short): only Discard can be decided without one. Open the resolve page"
            " again."
        )
    if posted == EMPTY_HEAD:
        return HeadExpected(None)
    if not BLOB_NAME.fullmatch(posted):
        raise InvalidRequest("The previewed head is not a tree name.")
    return HeadExpected(posted)


def what_happened(
    hold: IssueRecoveryAction, run_id: UUID, job_id: int | None, timeout: float
) -> str:
    """What the worker did with the resolved run, once its attempt ended (or that it has not
    yet, after `timeout` seconds)."""
    state = finalization_await(
        company_id=hold.company_id, run_id=run_id, job_id=job_id, timeout=timeout
    )
    run = f"Run {short_id(run_id)}"
    if state.state == "committed":
        published = (
            ActivityEvent.objects.filter(
                company_id=hold.company_id, action="workspace.head_published", run_id=run_id
            )
            .order_by("-created_at")
            .values_list("details", flat=True)
            .first()
        )
        if isinstance(published, dict) and published.get("resolution"):
            return (
                f"{run} committed: the workspace head is now {published.get('head')} "
                f"(its {published.get('resolution')} merged into {published.get('previousHead')})."
            )
        return f"{run} committed: nothing of it was published (the head did not change)."
    if state.state == "held":
        return (
            f"{run} is held again: the head moved after your decision and changed paths the "
            "resolution changes too; open its new hold to preview against the new head."
        )
    return (
        f"{run}: finalization {state.state.replace('_', ' ')}; the worker has not finished "
        "yet, its page shows the outcome."
    )
