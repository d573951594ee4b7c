"""Admin for recovery actions: read-only here; state changes only through the board's
confirmations, each through the same service as the API: the owner-stop confirmation, the
workspace conflict resolution, and the resolution (outcome and note) of any other live action
waiting for the board."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.views.main import ChangeList
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases.models import EnvironmentLease
from paperclip.access import Actor, board_actor
from paperclip.admin.lists import FlatCostListMixin, IndexedValuesListFilter
from paperclip.admin.names import CORE_KINDS, names_by_kind, run_link
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    ActivityTimelineMixin,
    DetailActionsMixin,
    act_on_each,
    admin_id_link,
    member_company_ids,
    named_link,
    report_each,
    short_id,
)
from paperclip.errors import DomainError, InvalidRequest
from paperclip.ids import parse_uuid
from paperclip.models import ActivityEvent, HeartbeatRun, Issue
from paperclip.receipts import owner_line, raw_owner
from paperclip.snapshots.resolutions import MAX_PREVIEW_CHANGES
from paperclip.snapshots.trees import BLOB_NAME
from paperclip.templatetags.console import stamp
from recovery.errors import SourceFailure, SourceInspectionLimit
from recovery.models import LIVE_STATUSES, IssueRecoveryAction, WorkerStopReceipt
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.attention import held_finalization_actions
from recovery.selectors.exports import HELD_EXPORT, is_held_export, lease_stop_confirmed
from recovery.selectors.finalization import finalization_await
from recovery.selectors.holds import TILE_REASONS, board_holds
from recovery.selectors.source import (
    MAXIMUM_SOURCES,
    recovery_source_inspect,
)
from recovery.selectors.verdict import owner_hold_verdict
from recovery.services import recovery_owner_stop_confirm
from recovery.services.actions import recovery_action_resolve
from recovery.services.conflict_resolution import workspace_conflict_preview
from recovery.services.conflicts import CONFLICT_CAUSE, HeadExpected, workspace_conflict_resolve
from recovery.services.export_repair import (
    EXPORT_REPAIR_CAUSE,
    evidence_retry,
    workspace_export_retry,
)
from recovery.services.owner_stop import (
    MAX_STOP_EVIDENCE_CHARS,
    MIN_STOP_EVIDENCE_CHARS,
    nonblank_length,
)

logger = logging.getLogger(__name__)

# Django's admin classes are not subscriptable at runtime (no django-stubs-ext patch).
if TYPE_CHECKING:
    _ActionAdmin = admin.ModelAdmin[IssueRecoveryAction]
    _ReceiptAdmin = admin.ModelAdmin[WorkerStopReceipt]
else:
    _ActionAdmin = _ReceiptAdmin = admin.ModelAdmin


# The "Details" fieldset: what every recovery action's page shows below its summary.
_DETAIL_FIELDS = (
    "evidence_pretty",
    "fingerprint",
    "attempt_count",
    "max_attempts",
    "return_owner_agent",
    "owner_agent",
    "wake_policy",
    "resolution_note",
    "created_at",
    "updated_at",
    "resolved_at",
)
_ALL_FIELDS = (
    "company",
    "run",
    "source_issue",
    "kind",
    "status",
    "owner_type",
    "cause",
    "outcome",
    "next_action",
    "recorded_owner",
    "current_receipt",
    "owner_stop",
    "recovery_source",
    *_DETAIL_FIELDS,
)


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


class OwnerStopForm(forms.Form):
    stop_evidence = forms.CharField(
        label="Deployment stop evidence",
        widget=forms.Textarea(attrs={"rows": 6, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        strip=False,
        help_text=(
            "What the deployment platform shows: the controller and every copy-back process "
            f"it started have exited (at least {MIN_STOP_EVIDENCE_CHARS} non-blank characters)."
        ),
    )
    confirmed = forms.BooleanField(
        label="I verified that this controller and all its copy-back processes have stopped.",
        required=True,
    )

    def clean_stop_evidence(self) -> str:
        value: str = self.cleaned_data["stop_evidence"]
        if nonblank_length(value) < MIN_STOP_EVIDENCE_CHARS:
            raise forms.ValidationError(
                f"Give at least {MIN_STOP_EVIDENCE_CHARS} non-blank characters of evidence."
            )
        return value


class ConflictResolutionForm(forms.Form):
    resolution = forms.ChoiceField(
        label="Resolution",
        choices=(
            (
                "publish",
                "Publish: the run's side of each conflicting path, merged with every other "
                "change of the run and of the head",
            ),
            (
                "keep_head",
                "Keep the head: the head's side of each conflicting path, and the run's other "
                "changes still published",
            ),
            ("discard", "Discard: commit the run without publishing anything of it"),
        ),
        widget=forms.RadioSelect,
    )
    note = forms.CharField(
        label="Note",
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        help_text="Why: recorded in the hold's evidence and the audit log.",
    )


class ExportRetryForm(forms.Form):
    repair_note = forms.CharField(
        label="Repair performed",
        widget=forms.Textarea(attrs={"rows": 4, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        strip=False,
        help_text=(
            "What you repaired so the export can succeed now (disk space, permissions, the "
            f"workspace cwd, the sandbox): at least {MIN_STOP_EVIDENCE_CHARS} non-blank "
            "characters, kept on the hold and in the audit log."
        ),
    )

    def clean_repair_note(self) -> str:
        value: str = self.cleaned_data["repair_note"]
        if nonblank_length(value) < MIN_STOP_EVIDENCE_CHARS:
            raise forms.ValidationError(
                f"Say what you repaired in at least {MIN_STOP_EVIDENCE_CHARS} non-blank characters."
            )
        return value


class ResolveActionForm(forms.Form):
    outcome = forms.ChoiceField(
        label="Outcome",
        choices=(
            ("restored", "Restored: the problem is fixed and the work can go on"),
            ("false_positive", "False positive: nothing was wrong"),
            ("blocked", "Blocked: it cannot be recovered (the note says why)"),
            ("cancelled", "Cancelled: the work is no longer wanted (the action is cancelled)"),
        ),
        widget=forms.RadioSelect,
    )
    note = forms.CharField(
        label="Note",
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=MAX_STOP_EVIDENCE_CHARS,
        strip=True,
        help_text="What you did or found: kept as the action's resolution note and audited.",
    )


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


_DETAILS_FIELDSET: tuple[str, Any] = ("Details", {"fields": _DETAIL_FIELDS})


def _is_owner_hold(obj: IssueRecoveryAction | None) -> bool:
    return obj is not None and obj.cause == OWNER_UNVERIFIED_CAUSE


def _evidence_run_id(action: IssueRecoveryAction) -> UUID | None:
    return parse_uuid(_as_dict(action.evidence).get("runId"))


def _run_names(actions: list[IssueRecoveryAction]) -> dict[tuple[str, UUID], str]:
    """The names of the runs the actions' evidence names (one query for the page)."""
    ids = {run_id for run_id in map(_evidence_run_id, actions) if run_id is not None}
    return names_by_kind({"heartbeat_run": ids}, CORE_KINDS)


class _NamedRunChangeList(ChangeList):
    """The recovery-action list, with the runs its evidence names read once per page."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        actions: list[IssueRecoveryAction] = list(self.result_list)
        names = _run_names(actions)
        for action in actions:  # per row, not on the (shared) model admin
            action.console_run_names = names  # type: ignore[attr-defined]


@admin.register(IssueRecoveryAction)
class IssueRecoveryActionAdmin(
    FlatCostListMixin, DetailActionsMixin, ActivityTimelineMixin, _ActionAdmin
):
    list_display = (
        "ref",
        "company",
        "issue",
        "run",
        "cause_short",
        "status",
        "owner_type",
        "attempts",
        "created",
        "updated_at",
    )
    list_filter = (
        HoldFilter,
        "status",
        ("cause", IndexedValuesListFilter),
        "owner_type",
        "kind",
        COMPANY_FILTER,
    )
    list_select_related = ("company", "source_issue")
    list_display_links = ("ref",)
    search_fields = ("=id", "cause", "fingerprint", "next_action", "source_issue__title")
    ordering = ("-updated_at",)
    actions = (
        "confirm_owner_stop",
        "resolve_workspace_conflict",
        "retry_workspace_export",
        "resolve_recovery_action",
    )
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "company",
                    "source_issue",
                    "run",
                    "kind",
                    "status",
                    "owner_type",
                    "cause",
                    "outcome",
                )
            },
        ),
        ("What to do", {"fields": ("next_action",)}),
        ("Recovery source", {"fields": ("recovery_source",)}),
        _DETAILS_FIELDSET,
    )

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        # Panels only where they apply: an owner hold is about the recorded owner, never about
        # a recovery source (whose inspection would fail for reasons unrelated to the hold).
        if _is_owner_hold(obj):
            return (
                self.fieldsets[0],
                (
                    "What to do",
                    {
                        "fields": (
                            "next_action",
                            "recorded_owner",
                            "current_receipt",
                            "owner_stop",
                        )
                    },
                ),
                _DETAILS_FIELDSET,
            )
        if is_held_export(obj):
            return (
                self.fieldsets[0],
                (
                    "What to do",
                    {"fields": ("next_action", "export_failure", "export_binding", "export_retry")},
                ),
                # The run still waits for its export: no recovery source to inspect.
                _DETAILS_FIELDSET,
            )
        if obj is not None and obj.cause == CONFLICT_CAUSE:
            # A conflict is about two trees, never about a recovery source.
            return (
                self.fieldsets[0],
                ("What to do", {"fields": ("next_action",)}),
                _DETAILS_FIELDSET,
            )
        return self.fieldsets

    def timeline_entity_ids(self, obj: IssueRecoveryAction) -> list[str]:
        return [str(obj.pk)]

    def timeline_run_id(self, obj: IssueRecoveryAction) -> Any:
        evidence = _as_dict(obj.evidence)
        return parse_uuid(evidence.get("runId"))

    def detail_panels(self, request: HttpRequest, obj: IssueRecoveryAction) -> list[SafeString]:
        if not _is_owner_hold(obj):
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
        run_id = _evidence_run_id(obj)
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
        return _NamedRunChangeList

    def detail_title(self, obj: IssueRecoveryAction) -> str:
        return f"{obj.cause.replace('_', ' ')} ({obj.status}) on “{obj.source_issue.title}”"

    def get_queryset(self, request: HttpRequest) -> QuerySet[IssueRecoveryAction]:
        qs = super().get_queryset(request).select_related("source_issue", "company")
        company_ids = member_company_ids(request)
        return qs if company_ids is None else qs.filter(company_id__in=company_ids)

    def get_readonly_fields(
        self, request: HttpRequest, obj: IssueRecoveryAction | None = None
    ) -> tuple[str, ...]:
        # State changes only through services (the change form runs inside atomic()).
        return _ALL_FIELDS

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: IssueRecoveryAction | None = None
    ) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: IssueRecoveryAction | None = None
    ) -> bool:
        return False  # read-only: no Save buttons; state moves only through the actions

    def has_resolve_workspace_conflict_permission(self, request: HttpRequest) -> bool:
        return self.has_confirm_owner_stop_permission(request)

    def has_retry_workspace_export_permission(self, request: HttpRequest) -> bool:
        return self.has_confirm_owner_stop_permission(request)

    def has_resolve_recovery_action_permission(self, request: HttpRequest) -> bool:
        return self.has_confirm_owner_stop_permission(request)

    def has_confirm_owner_stop_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

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
        evidence = _as_dict(obj.evidence)
        owner = evidence.get("owner")
        if owner is None:
            return "—"
        token = owner.get("token") if isinstance(owner, dict) else None
        return f"{owner_line(owner)} (token {token})"

    @admin.display(description="run's current receipt")
    def current_receipt(self, obj: IssueRecoveryAction) -> SafeString | str:
        evidence = _as_dict(obj.evidence)
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
        evidence = _as_dict(obj.evidence)
        stop = evidence.get("workspaceOwnerStop")
        if not isinstance(stop, dict):
            return "not confirmed"
        return (
            f"confirmed by user {stop.get('actorId')} at {stop.get('confirmedAt')}: "
            f"{stop.get('stopEvidence')} — finalization of result {stop.get('resultId')} queued"
        )

    @admin.display(description="last export failure")
    def export_failure(self, obj: IssueRecoveryAction) -> str:
        failure = _as_dict(_as_dict(obj.evidence).get("failure"))
        if not failure:
            return "—"
        return (
            f"{failure.get('code')} after {failure.get('attempts')} attempt(s): "
            f"{failure.get('detail')}"
        )

    @admin.display(description="what the export moves, and the sandbox")
    def export_binding(self, obj: IssueRecoveryAction) -> SafeString | str:
        evidence = _as_dict(obj.evidence)
        descriptor = _as_dict(evidence.get("descriptor"))
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
        earlier = _as_dict(obj.evidence).get("retries")
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

    @admin.action(
        description="Confirm owner stopped and resume finalization",
        permissions=["confirm_owner_stop"],
    )
    def confirm_owner_stop(
        self, request: HttpRequest, queryset: QuerySet[IssueRecoveryAction]
    ) -> HttpResponse | None:
        def confirm(actor: Actor, hold: IssueRecoveryAction, run_id: UUID, form: Any) -> str:
            owner = _as_dict(_as_dict(hold.evidence).get("owner"))
            recovery_owner_stop_confirm(
                actor=actor,
                issue_id=hold.source_issue_id,
                action_id=hold.pk,
                run_id=run_id,
                owner_token=str(owner.get("token", "")),
                stop_evidence=form.cleaned_data["stop_evidence"],
                controller_and_copyback_stopped=form.cleaned_data["confirmed"],
            )
            return "confirmed"

        return self._act_on_holds(
            request,
            queryset,
            cause=OWNER_UNVERIFIED_CAUSE,
            what="an unverified workspace-owner hold",
            form_class=OwnerStopForm,
            act=confirm,
            summary=lambda counts, _form: (
                f"Confirmed {counts['confirmed']}; finalization queued for the worker: the "
                "outcome will show in each run's finalization state on its page (the hold "
                "resolves once the run is committed). Refused: "
            ),
            title="Confirm owner stopped and resume finalization",
            template="admin/recovery/confirm_owner_stop.html",
            row=lambda hold: (
                hold,
                self.recorded_owner(hold),
                self.current_receipt(hold),
                owner_hold_verdict(hold),
            ),
        )

    @admin.action(
        description="Resolve workspace conflict (preview, then publish, keep the head or discard)",
        permissions=["resolve_workspace_conflict"],
    )
    def resolve_workspace_conflict(
        self, request: HttpRequest, queryset: QuerySet[IssueRecoveryAction]
    ) -> HttpResponse | None:
        queued: list[tuple[IssueRecoveryAction, UUID, int | None]] = []

        def resolve(actor: Actor, hold: IssueRecoveryAction, run_id: UUID, form: Any) -> str:
            answer = workspace_conflict_resolve(
                actor=actor,
                issue_id=hold.source_issue_id,
                action_id=hold.pk,
                run_id=run_id,
                resolution=form.cleaned_data["resolution"],
                note=form.cleaned_data["note"],
                expected_head=_posted_head(request, hold),
            )
            if answer.replayed:
                return "repeated"
            queued.append((hold, run_id, answer.job_id))
            return "resolved"

        def summary(counts: Counter[str], form: Any) -> str:
            happened = [
                _what_happened(hold, run_id, job_id, RESOLVE_WAIT_SECONDS)
                for hold, run_id, job_id in queued
            ]
            return (
                f"Resolved {counts['resolved']} ({form.cleaned_data['resolution']}) against the "
                f"head you previewed, {counts['repeated']} already resolved so. "
                + " ".join(happened)
                + (" " if happened else "")
                + "Refused: "
            )

        return self._act_on_holds(
            request,
            queryset,
            cause=CONFLICT_CAUSE,
            what="a workspace head conflict",
            form_class=ConflictResolutionForm,
            act=resolve,
            summary=summary,
            title="Resolve workspace conflict",
            template="admin/recovery/resolve_workspace_conflict.html",
            row=lambda hold: (hold, _as_dict(hold.evidence), _conflict_preview(request, hold)),
        )

    @admin.action(
        description="Retry workspace export (after repairing its cause)",
        permissions=["retry_workspace_export"],
    )
    def retry_workspace_export(
        self, request: HttpRequest, queryset: QuerySet[IssueRecoveryAction]
    ) -> HttpResponse | None:
        def retry(actor: Actor, hold: IssueRecoveryAction, run_id: UUID, form: Any) -> str:
            answer = workspace_export_retry(
                actor=actor,
                issue_id=hold.source_issue_id,
                action_id=hold.pk,
                run_id=run_id,
                repair_note=form.cleaned_data["repair_note"],
            )
            return "repeated" if answer.replayed else "queued"

        return self._act_on_holds(
            request,
            queryset,
            cause=EXPORT_REPAIR_CAUSE,
            what="a held workspace export",
            form_class=ExportRetryForm,
            act=retry,
            summary=lambda counts, _form: (
                f"Export retry queued for {counts['queued']} run(s), "
                f"{counts['repeated']} already queued (nothing changed); the worker "
                "attempts each export now: the outcome shows in each run's finalization state "
                "on its page, and the hold resolves when the run commits or asks for the next "
                "repair if the export fails again. Refused: "
            ),
            title="Retry workspace export",
            template="admin/recovery/retry_workspace_export.html",
            row=lambda hold: (hold, self.export_failure(hold), self.export_binding(hold)),
        )

    def _act_on_holds(
        self,
        request: HttpRequest,
        queryset: QuerySet[IssueRecoveryAction],
        *,
        cause: str,
        what: str,
        form_class: type[forms.Form],
        act: Callable[[Actor, IssueRecoveryAction, UUID, Any], str],
        summary: Callable[[Counter[str], Any], str],
        title: str,
        template: str,
        row: Callable[[IssueRecoveryAction], tuple[Any, ...]],
    ) -> HttpResponse | None:
        """A board hold's own confirmation, for the selected holds of `cause`: the page with
        `form` (one `row` a hold), then `act` once a hold with the run its evidence names, and
        a message of what was done (`summary`), repeated, or refused and why."""
        holds = list(queryset.filter(cause=cause).select_related("source_issue").order_by("pk"))
        if not holds:
            self.message_user(request, f"Select {what} (cause {cause}).", messages.WARNING)
            return None
        form = form_class(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            actor = board_actor(request.user)

            def one(hold: IssueRecoveryAction) -> str:
                run_id = _evidence_run_id(hold)
                if run_id is None:
                    raise InvalidRequest("The hold names no run.")
                return act(actor, hold, run_id, form)

            done = act_on_each(holds, one, name=lambda hold: hold.pk)
            report_each(self, request, summary(done.counts, form), done.failed)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "holds": [row(hold) for hold in holds],
            "form": form,
            "opts": self.model._meta,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, template, context)

    @admin.action(
        description="Resolve selected recovery actions waiting for the board (note required)",
        permissions=["resolve_recovery_action"],
    )
    def resolve_recovery_action(
        self, request: HttpRequest, queryset: QuerySet[IssueRecoveryAction]
    ) -> HttpResponse | None:
        selected = list(queryset.select_related("source_issue").order_by("pk"))
        eligible_ids = set(board_resolvable(queryset).values_list("pk", flat=True))
        eligible = [action for action in selected if action.pk in eligible_ids]
        others = [
            f"{action.pk}: not_board_resolvable ({_why_not_resolvable(action)})"
            for action in selected
            if action.pk not in eligible_ids
        ]
        if not eligible:
            self.message_user(
                request,
                "Nothing to resolve: select live recovery actions owned by the board (owner-stop "
                "holds and workspace conflicts have their own actions). Skipped: "
                + ", ".join(others),
                messages.WARNING,
            )
            return None
        form = ResolveActionForm(request.POST if "apply" in request.POST else None)
        if "apply" in request.POST and form.is_valid():
            actor = board_actor(request.user)
            outcome = form.cleaned_data["outcome"]
            status = (
                IssueRecoveryAction.Status.CANCELLED
                if outcome == "cancelled"
                else IssueRecoveryAction.Status.RESOLVED
            )

            def resolve(action: IssueRecoveryAction) -> str:
                closed = recovery_action_resolve(
                    company_id=action.company_id,
                    source_issue_id=action.source_issue_id,
                    action_id=action.pk,
                    outcome=outcome,
                    resolution_note=form.cleaned_data["note"],
                    actor_type=actor.actor_type,
                    actor_id=actor.actor_id,
                    status=status,
                )
                return str(closed.status)

            done = act_on_each(eligible, resolve, name=lambda action: action.pk)
            report_each(
                self,
                request,
                f"Closed {done.counts[status]} recovery action(s): {status} with outcome "
                f"{outcome}, your note kept as each one's resolution note; nothing else was "
                "changed (the issue and its runs are as they were). Refused: ",
                others + done.failed,
            )
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Resolve recovery actions",
            "actions_to_resolve": eligible,
            "skipped": others,
            "form": form,
            "opts": self.model._meta,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/recovery/resolve_recovery_action.html", context)


# How long the console waits for the worker's attempt after a resolution, to say what it did
# (the run's page shows it later when the worker is slower).
RESOLVE_WAIT_SECONDS = 5.0


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


def _conflict_preview(request: HttpRequest, hold: IssueRecoveryAction) -> dict[str, Any]:
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


def _posted_head(request: HttpRequest, hold: IssueRecoveryAction) -> HeadExpected | None:
    """The head the page previewed for `hold` (posted back), or None when it showed none."""
    posted = request.POST.get(f"expected_head_{hold.pk}")
    if posted is None or posted == "":
        return None
    if posted == EMPTY_HEAD:
        return HeadExpected(None)
    if not BLOB_NAME.fullmatch(posted):
        raise InvalidRequest("The previewed head is not a tree name.")
    return HeadExpected(posted)


def _what_happened(
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


def _why_not_resolvable(action: IssueRecoveryAction) -> str:
    if action.status not in LIVE_STATUSES:
        return f"already {action.status}"
    if action.cause == OWNER_UNVERIFIED_CAUSE:
        return "an owner-stop hold: use Confirm owner stopped"
    if action.cause == CONFLICT_CAUSE:
        return "a workspace conflict: use Resolve workspace conflict"
    if is_held_export(action):
        return "a held workspace export: use Retry workspace export"
    return f"owned by {action.owner_type}, not the board"


@admin.register(WorkerStopReceipt)
class WorkerStopReceiptAdmin(_ReceiptAdmin):
    list_display = ("worker_id", "run_named", "owner_token", "stopped_at", "recorded_at")
    search_fields = ("worker_id", "owner_token", "=run__id", "run__agent__name")
    list_select_related = ("run__agent",)
    readonly_fields = (
        "company",
        "run_named",
        "owner_token",
        "worker_id",
        "stopped_at",
        "signature",
        "recorded_at",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[WorkerStopReceipt]:
        qs = super().get_queryset(request).select_related(*self.list_select_related)
        company_ids = member_company_ids(request)
        return qs if company_ids is None else qs.filter(company_id__in=company_ids)

    @admin.display(description="run", ordering="run__agent__name")
    def run_named(self, obj: WorkerStopReceipt) -> SafeString | str:
        return run_link(obj.run)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def source_panel_html(action: IssueRecoveryAction) -> str:
    """The inspection of `action`'s recorded source as safe HTML for its admin page: the
    sources, or the failure with its code, reason and disposition. The run is the one named
    by `action.evidence.runId`."""
    evidence = _as_dict(action.evidence)
    raw_run = evidence.get("runId")
    context: dict[str, Any] = {"action": action, "run_id": raw_run}
    run_id = parse_uuid(raw_run)
    if run_id is None:
        context["missing_run"] = True
        return render_to_string("admin/recovery/source_panel.html", context)
    try:
        inspection = recovery_source_inspect(
            company_id=action.company_id,
            issue_id=action.source_issue_id,
            run_id=run_id,
            action_id=action.pk,
            maximum_sources=MAXIMUM_SOURCES,
        )
    except SourceFailure as failure:
        context["failure"] = {
            "code": failure.code,
            "message": failure.text,
            "reason": failure.reason,
            "disposition": failure.disposition,
            "observed_lease_policy": failure.observed_lease_policy,
        }
    except SourceInspectionLimit as limit:
        context["failure"] = {
            "code": limit.code,
            "message": limit.text,
            "reason": None,
            "disposition": None,
            "observed_lease_policy": None,
        }
    else:
        context["sources"] = inspection.sources
    return render_to_string("admin/recovery/source_panel.html", context)
