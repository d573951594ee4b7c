"""Admin for recovery actions: read-only here; state changes only through the board's
confirmations, each through the same service as the API: the owner-stop confirmation, the
workspace conflict resolution, and the resolution (outcome and note) of any other live action
waiting for the board."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from paperclip.access import Actor, board_actor
from paperclip.admin.lists import FlatCostListMixin, IndexedValuesListFilter
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    ActivityTimelineMixin,
    DetailActionsMixin,
    act_on_each,
    member_company_ids,
    report_each,
)
from paperclip.errors import InvalidRequest
from recovery.admin.action_displays import (
    HoldFilter,
    RecoveryActionDisplays,
    as_dict,
    board_resolvable,
    evidence_run_id,
    is_owner_hold,
)
from recovery.admin.action_forms import (
    ConflictResolutionForm,
    ExportRetryForm,
    OwnerStopForm,
    ResolveActionForm,
)
from recovery.admin.conflict_preview import conflict_preview, posted_head, what_happened
from recovery.models import LIVE_STATUSES, IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE
from recovery.selectors.exports import is_held_export
from recovery.selectors.verdict import owner_hold_verdict
from recovery.services import recovery_owner_stop_confirm
from recovery.services.actions import recovery_action_resolve
from recovery.services.conflicts import CONFLICT_CAUSE, workspace_conflict_resolve
from recovery.services.export_repair import EXPORT_REPAIR_CAUSE, workspace_export_retry

# Django's admin classes are not subscriptable at runtime (no django-stubs-ext patch).
if TYPE_CHECKING:
    _ActionAdmin = admin.ModelAdmin[IssueRecoveryAction]
else:
    _ActionAdmin = admin.ModelAdmin

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

_DETAILS_FIELDSET: tuple[str, Any] = ("Details", {"fields": _DETAIL_FIELDS})


@admin.register(IssueRecoveryAction)
class IssueRecoveryActionAdmin(
    RecoveryActionDisplays,
    FlatCostListMixin,
    DetailActionsMixin,
    ActivityTimelineMixin,
    _ActionAdmin,
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
        if is_owner_hold(obj):
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
        # The model's change permission, as force-release and interrupt ask theirs: a staff
        # user who may only view the holds sees them, and no action.
        user: Any = request.user
        return bool(
            user.is_active
            and user.is_staff
            and user.has_perm("recovery.change_issuerecoveryaction")
        )

    @admin.action(
        description="Confirm owner stopped and resume finalization",
        permissions=["confirm_owner_stop"],
    )
    def confirm_owner_stop(
        self, request: HttpRequest, queryset: QuerySet[IssueRecoveryAction]
    ) -> HttpResponse | None:
        def confirm(actor: Actor, hold: IssueRecoveryAction, run_id: UUID, form: Any) -> str:
            owner = as_dict(as_dict(hold.evidence).get("owner"))
            answer = recovery_owner_stop_confirm(
                actor=actor,
                issue_id=hold.source_issue_id,
                action_id=hold.pk,
                run_id=run_id,
                owner_token=str(owner.get("token", "")),
                stop_evidence=form.cleaned_data["stop_evidence"],
                controller_and_copyback_stopped=form.cleaned_data["confirmed"],
            )
            return "repeated" if answer.replayed else "confirmed"

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
                "resolves once the run is committed). "
                + (
                    f"{counts['repeated']} already confirmed (nothing changed). "
                    if counts["repeated"]
                    else ""
                )
                + "Refused: "
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
                expected_head=posted_head(request, hold, form.cleaned_data["resolution"]),
            )
            if answer.replayed:
                return "repeated"
            queued.append((hold, run_id, answer.job_id))
            return "resolved"

        def summary(counts: Counter[str], form: Any) -> str:
            happened = [
                what_happened(hold, run_id, job_id, RESOLVE_WAIT_SECONDS)
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
            row=lambda hold: (hold, as_dict(hold.evidence), conflict_preview(request, hold)),
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
                run_id = evidence_run_id(hold)
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
