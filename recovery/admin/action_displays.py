"""What a recovery action's admin pages show: the list's hold filter and columns (with the
runs its evidence names read once per page), the detail page's fields, panels and buttons."""

from __future__ import annotations

import json
import logging
from typing import Any
from uuid import UUID

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Q, QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases.models import EnvironmentLease
from paperclip.admin.names import CORE_KINDS, names_by_kind
from paperclip.admin.toolkit import admin_id_link, named_link, short_id
from paperclip.ids import parse_uuid
from paperclip.models import HeartbeatRun, Issue
from paperclip.receipts import owner_line, raw_owner
from paperclip.templatetags.console import stamp
from recovery.admin.source_panel import source_panel_html
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.attention import held_finalization_actions
from recovery.selectors.exports import HELD_EXPORT, is_held_export, lease_stop_confirmed
from recovery.selectors.holds import TILE_REASONS, board_holds
from recovery.selectors.verdict import owner_hold_verdict
from recovery.services.conflicts import CONFLICT_CAUSE
from recovery.services.export_repair import evidence_retry

logger = logging.getLogger(__name__)


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def board_resolvable(
    queryset: QuerySet[IssueRecoveryAction],
) -> QuerySet[IssueRecoveryAction]:
    """Live actions that wait for the board and have no button of their own: owner-stop holds
    and workspace-head conflicts are closed by their own confirmations, never by a note."""
    return queryset.filter(
        owner_type=IssueRecoveryAction.OwnerType.BOARD, status__in=LIVE_STATUSES
    ).exclude(Q(cause__in=(OWNER_UNVERIFIED_CAUSE, CONFLICT_CAUSE)) | HELD_EXPORT)


class HoldFilter(admin.SimpleListFilter):
    """The dashboard's "held for the board" tiles: every board hold of a run, or those of one
    reason (`recovery.selectors.holds.board_holds`)."""

    title = "board hold"
    parameter_name = "hold"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("board", "Waiting for the board"),
            *((reason, f"Waiting for the board: {words}") for reason, words in TILE_REASONS),
        ]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[IssueRecoveryAction]
    ) -> QuerySet[IssueRecoveryAction]:
        value = self.value()
        if value == "board":
            return board_holds(queryset)
        if value is not None:
            return board_holds(queryset, reason=value)
        return queryset


def is_owner_hold(obj: IssueRecoveryAction | None) -> bool:
    return obj is not None and obj.cause == OWNER_UNVERIFIED_CAUSE


def evidence_run_id(action: IssueRecoveryAction) -> UUID | None:
    return parse_uuid(as_dict(action.evidence).get("runId"))


def _run_names(actions: list[IssueRecoveryAction]) -> dict[tuple[str, UUID], str]:
    """The names of the runs the actions' evidence names (one query for the page)."""
    ids = {run_id for run_id in map(evidence_run_id, actions) if run_id is not None}
    return names_by_kind({"heartbeat_run": ids}, CORE_KINDS)


class NamedRunChangeList(ChangeList):
    """The recovery-action list, with the runs its evidence names read once per page."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        actions: list[IssueRecoveryAction] = list(self.result_list)
        names = _run_names(actions)
        for action in actions:  # per row, not on the (shared) model admin
            action.console_run_names = names  # type: ignore[attr-defined]


class RecoveryActionDisplays:
    """What a recovery action's pages show: the list's columns, the detail page's fields and
    panels, its buttons and its history's title. First among the admin's bases: its methods
    replace the toolkit mixins' defaults."""

    def timeline_entity_ids(self, obj: IssueRecoveryAction) -> list[str]:
        return [str(obj.pk)]

    def timeline_run_id(self, obj: IssueRecoveryAction) -> Any:
        evidence = as_dict(obj.evidence)
        return parse_uuid(evidence.get("runId"))

    def detail_panels(self, request: HttpRequest, obj: IssueRecoveryAction) -> list[SafeString]:
        if not is_owner_hold(obj):
            return []
        verdict = owner_hold_verdict(obj)
        return [
            SafeString(
                render_to_string(
                    "admin/recovery/verdict_panel.html", {"verdict": verdict, "action": obj}
                )
            )
        ]

    def detail_actions(
        self, request: HttpRequest, obj: IssueRecoveryAction
    ) -> list[dict[str, Any]]:
        if obj.cause == CONFLICT_CAUSE and obj.status in LIVE_STATUSES:
            return [
                {
                    "action": "resolve_workspace_conflict",
                    "label": "Resolve workspace conflict (preview each resolution)…",
                    "primary": True,
                }
            ]
        if is_held_export(obj) and obj.status in LIVE_STATUSES:
            if evidence_retry(obj):
                return []  # queued: the next action says where the outcome shows
            return [
                {
                    "action": "retry_workspace_export",
                    "label": "Retry workspace export…",
                    "primary": True,
                }
            ]
        if obj.cause != OWNER_UNVERIFIED_CAUSE:
            if board_resolvable(IssueRecoveryAction.objects.filter(pk=obj.pk)).exists():
                return [
                    {
                        "action": "resolve_recovery_action",
                        "label": "Resolve recovery action…",
                        "primary": True,
                    }
                ]
            return []
        if not held_finalization_actions().filter(pk=obj.pk).exists():
            return []
        return [
            {
                "action": "confirm_owner_stop",
                "label": "Confirm owner stopped and resume finalization…",
                "primary": True,
            }
        ]

    @admin.display(description="created (UTC)", ordering="created_at")
    def created(self, obj: IssueRecoveryAction) -> SafeString | str:
        return stamp(obj.created_at)

    @admin.display(description="cause", ordering="cause")
    def cause_short(self, obj: IssueRecoveryAction) -> SafeString:
        short = obj.cause.removeprefix("native_workspace_finalization_").replace("_", " ")
        return format_html('<span title="{}">{}</span>', obj.cause, short)

    @admin.display(description="action", ordering="id")
    def ref(self, obj: IssueRecoveryAction) -> SafeString:
        return format_html('<code title="{}">{}</code>', obj.pk, short_id(obj.pk))

    @admin.display(description="source issue", ordering="source_issue__title")
    def issue(self, obj: IssueRecoveryAction) -> SafeString | str:
        return named_link(Issue, obj.source_issue_id, obj.source_issue.title, limit=32)

    @admin.display(description="run")
    def run(self, obj: IssueRecoveryAction) -> SafeString | str:
        run_id = evidence_run_id(obj)
        if run_id is None:
            return "—"
        names = getattr(obj, "console_run_names", None)
        if names is None:  # a detail page: this one run
            names = _run_names([obj])
        name = names.get(("heartbeat_run", run_id))
        if name is not None:
            return named_link(HeartbeatRun, run_id, name, limit=24)
        label = format_html('<code title="{}">{}</code>', run_id, short_id(run_id))
        return admin_id_link(HeartbeatRun, run_id, label)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return NamedRunChangeList

    def detail_title(self, obj: IssueRecoveryAction) -> str:
        return f"{obj.cause.replace('_', ' ')} ({obj.status}) on “{obj.source_issue.title}”"

    @admin.display(description="attempts")
    def attempts(self, obj: IssueRecoveryAction) -> str:
        return f"{obj.attempt_count}/{obj.max_attempts if obj.max_attempts else '∞'}"

    @admin.display(description="evidence")
    def evidence_pretty(self, obj: IssueRecoveryAction) -> SafeString:
        return format_html(
            "<pre style='white-space:pre-wrap'>{}</pre>",
            json.dumps(obj.evidence, indent=2, sort_keys=True),
        )

    @admin.display(description="recorded owner")
    def recorded_owner(self, obj: IssueRecoveryAction) -> str:
        evidence = as_dict(obj.evidence)
        owner = evidence.get("owner")
        if owner is None:
            return "—"
        token = owner.get("token") if isinstance(owner, dict) else None
        return f"{owner_line(owner)} (token {token})"

    @admin.display(description="run's current receipt")
    def current_receipt(self, obj: IssueRecoveryAction) -> SafeString | str:
        evidence = as_dict(obj.evidence)
        run_id = evidence.get("runId")
        run = (
            HeartbeatRun.objects.filter(pk=run_id, company_id=obj.company_id).first()
            if isinstance(run_id, str) and parse_uuid(run_id) is not None
            else None
        )
        if run is None:
            return "run not found"
        current = raw_owner(run.runner_profile_json)
        link = format_html(
            '<a href="{}">run {}</a>',
            reverse("admin:paperclip_heartbeatrun_change", args=[run.pk]),
            run.pk,
        )
        if current is None:
            return format_html(
                "{}: no owner receipt (phase {}, {})", link, run.native_phase, run.status
            )
        token = current.get("token") if isinstance(current, dict) else None
        return format_html("{}: {} (token {})", link, owner_line(current), token)

    @admin.display(description="owner stop confirmation")
    def owner_stop(self, obj: IssueRecoveryAction) -> str:
        evidence = as_dict(obj.evidence)
        stop = evidence.get("workspaceOwnerStop")
        if not isinstance(stop, dict):
            return "not confirmed"
        return (
            f"confirmed by user {stop.get('actorId')} at {stop.get('confirmedAt')}: "
            f"{stop.get('stopEvidence')} — finalization of result {stop.get('resultId')} queued"
        )

    @admin.display(description="last export failure")
    def export_failure(self, obj: IssueRecoveryAction) -> str:
        failure = as_dict(as_dict(obj.evidence).get("failure"))
        if not failure:
            return "—"
        return (
            f"{failure.get('code')} after {failure.get('attempts')} attempt(s): "
            f"{failure.get('detail')}"
        )

    @admin.display(description="what the export moves, and the sandbox")
    def export_binding(self, obj: IssueRecoveryAction) -> SafeString | str:
        evidence = as_dict(obj.evidence)
        descriptor = as_dict(evidence.get("descriptor"))
        if descriptor.get("kind") == "tree":
            moved = format_html("snapshot tree <code>{}</code>", descriptor.get("tree"))
        else:
            moved = format_html(
                "directory <code>{}</code>", descriptor.get("source") or "(none recorded)"
            )
        destination = descriptor.get("destination")
        into = (
            format_html("into <code>{}</code>", destination)
            if destination
            else "into the store only (the workspace has no cwd)"
        )
        lease_id = parse_uuid(evidence.get("leaseId"))
        lease = (
            EnvironmentLease.objects.filter(pk=lease_id, company_id=obj.company_id).first()
            if lease_id is not None
            else None
        )
        if lease_id is None:
            sandbox = "no environment lease (nothing to stop)"
        elif lease is None:
            sandbox = f"environment lease {lease_id}: gone"
        else:
            stopped = (
                "stop confirmed"
                if lease_stop_confirmed(lease)
                else "stop NOT confirmed yet: retry is refused until the provider reports it"
            )
            sandbox = format_html(
                '<a href="{}">environment lease {}</a> ({} {}, {}, cleanup {}): {}',
                reverse("admin:leases_environmentlease_change", args=[lease.pk]),
                short_id(lease.pk),
                lease.provider,
                lease.provider_lease_id,
                lease.status,
                lease.cleanup_status or "none",
                stopped,
            )
        return format_html("{} {}<br>{}", moved, into, sandbox)

    @admin.display(description="retry")
    def export_retry(self, obj: IssueRecoveryAction) -> str:
        retry = evidence_retry(obj)
        earlier = as_dict(obj.evidence).get("retries")
        count = len(earlier) if isinstance(earlier, list) else 0
        tried = f" ({count} earlier retr{'y' if count == 1 else 'ies'} failed)" if count else ""
        if not retry:
            return "none queued" + tried
        return (
            f"queued by user {retry.get('actorId')} at {retry.get('requestedAt')}: "
            f"{retry.get('repairNote')}{tried}"
        )

    @admin.display(description="recovery source")
    def recovery_source(self, obj: IssueRecoveryAction) -> SafeString | str:
        try:
            html = source_panel_html(obj)
        except Exception:
            # The inspection is advisory here; a failure must not take the hold's page down.
            logger.exception("recovery source panel failed for action %s", obj.pk)
            return "recovery source inspection failed (see server log)"
        return SafeString(html)  # the panel renders through a template (autoescaped)
