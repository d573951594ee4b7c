"""Admin of finalization: the coordinators (one per native run) with their attention filter,
and "Finalize now" (a list action and a detail button, here and on the run's page).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.utils.html import format_html
from django.utils.safestring import SafeString

from checkpoints.attention import expired_authority_coordinators
from paperclip.admin.names import RunIssueColumns, run_name
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    ReadOnlyAdmin,
    act_on_each,
    console_panel,
    report_each,
    short_id,
)
from paperclip.models import (
    HeartbeatRun,
    NativeRunFinalization,
)
from paperclip.templatetags.console import when
from recovery.errors import FinalizationNotAcquired
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import HEAD_CONFLICT_CODE, OWNER_UNVERIFIED_CAUSE, run_board_hold
from recovery.selectors.attention import failed_finalizations, retrying_finalizations
from recovery.selectors.finalization import finalization_state
from recovery.selectors.holds import HOLD_REMEDIATION
from recovery.selectors.source.inspection import WORKSPACE_EXPORT_CAUSES
from recovery.selectors.verdict import owner_hold_verdict
from recovery.services import finalization_request

# What a board hold's page offers, by cause: (admin action, its name, NotAcquired reason).
_HOLD_ACTIONS: dict[str, tuple[str, str, str]] = {
    OWNER_UNVERIFIED_CAUSE: (
        "confirm_owner_stop",
        "Confirm owner stopped and resume finalization",
        "owner_unverified",
    ),
    HEAD_CONFLICT_CODE: (
        "resolve_workspace_conflict",
        "Resolve workspace conflict",
        HEAD_CONFLICT_CODE,
    ),
    **{
        cause: ("retry_workspace_export", "Retry workspace export", "workspace_export_failed")
        for cause in WORKSPACE_EXPORT_CAUSES
    },
}
_HOLD_BUTTONS: dict[str, str] = {
    OWNER_UNVERIFIED_CAUSE: "Held: confirm owner stopped…",
    HEAD_CONFLICT_CODE: "Held: resolve workspace conflict…",
    **{cause: "Held: retry workspace export…" for cause in WORKSPACE_EXPORT_CAUSES},
}


def hold_detail_action(hold: IssueRecoveryAction) -> dict[str, Any]:
    """The button a held run's (or coordinator's) page shows in place of "Finalize now": the
    hold's own confirmation, on its recovery action."""
    action, _label, _reason = _HOLD_ACTIONS[hold.cause]
    return {
        "action": action,
        "label": _HOLD_BUTTONS[hold.cause],
        "primary": True,
        "model": IssueRecoveryAction,
        "pk": hold.pk,
    }


def hold_panel(hold: IssueRecoveryAction) -> SafeString:
    """The first panel of a held run's (or coordinator's) page: what holds it and where to act."""
    _action, label, reason = _HOLD_ACTIONS[hold.cause]
    verdict = owner_hold_verdict(hold) if hold.cause == OWNER_UNVERIFIED_CAUSE else None
    return SafeString(  # rendered through an autoescaping template
        render_to_string(
            "admin/recovery/hold_panel.html",
            {
                "hold": hold,
                "title": reason.replace("_", " "),
                "label": label,
                "verdict": verdict,
                "export": hold.cause in WORKSPACE_EXPORT_CAUSES,
            },
        )
    )


class FinalizeNowMixin:
    """ "Finalize now" (list action and detail button): `finalization_request`, as
    `POST /api/heartbeat-runs/{id}/finalize` does; audited `run.finalization_requested`. A run
    held for the board is refused here (the job would only log `not acquired`), naming the
    hold to act on instead."""

    def has_finalize_permission(self, request: HttpRequest) -> bool:
        user: Any = request.user  # the runs' change permission, as "Interrupt run" asks
        return bool(
            user.is_active and user.is_staff and user.has_perm("paperclip.change_heartbeatrun")
        )

    def _finalize_each(self, request: HttpRequest, runs: list[tuple[Any, Any]]) -> None:
        def act(run: tuple[Any, Any]) -> str:
            company_id, run_id = run
            hold = run_board_hold(company_id=company_id, run_id=run_id)
            if hold is not None:
                _action, label, reason = _HOLD_ACTIONS[hold.cause]
                raise FinalizationNotAcquired(
                    f"held for the board ({reason}), nothing queued: open recovery action "
                    f"{hold.pk} and use {label}",
                    reason=reason,
                )
            answer = finalization_request(
                company_id=company_id,
                run_id=run_id,
                actor_type="user",
                actor_id=str(request.user.pk),
            )
            if answer.status == "committed":
                return "committed"
            return "queued" if answer.created else "already_queued"

        done = act_on_each(runs, act, name=lambda run: f"run {run[1]}")
        report_each(
            self,
            request,
            f"Finalization queued for {done.counts['queued']} run(s); the outcome will show in "
            "each run's finalization state on its page (committed, retry scheduled or held) "
            f"once a worker has tried. Already queued: {done.counts['already_queued']}; "
            f"already committed: {done.counts['committed']}. Refused: ",
            done.failed,
        )


class CoordinatorAttentionFilter(admin.SimpleListFilter):
    """The dashboard's finalization tiles, with the builders of `recovery.selectors.attention`
    and `checkpoints.attention`."""

    title = "needs attention"
    parameter_name = "attention"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("failed", "Failed (retries spent)"),
            ("retrying", "Retrying"),
            ("authority_expired", "Expired runner authority"),
        ]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[NativeRunFinalization]
    ) -> QuerySet[NativeRunFinalization]:
        if self.value() == "failed":
            return failed_finalizations(queryset)
        if self.value() == "retrying":
            return retrying_finalizations(queryset)
        if self.value() == "authority_expired":
            return expired_authority_coordinators(queryset)
        return queryset


@admin.register(NativeRunFinalization)
class NativeRunFinalizationAdmin(RunIssueColumns, FinalizeNowMixin, ReadOnlyAdmin):
    # The coordinator's id is its run's: the first column links to the coordinator, the run
    # column to the run's page.
    list_display = (
        "ref",
        "run_named",
        "issue_named",
        "company",
        "phase",
        "attempt",
        "generation",
        "lease_expires",
        "failure",
        "next_attempt",
        "updated",
    )
    list_filter = (CoordinatorAttentionFilter, "phase", COMPANY_FILTER)
    search_fields = ("=run__id", "=issue__id", "lease_owner", "run__agent__name", "issue__title")
    list_select_related = ("company", "run__agent", "issue")
    list_display_links = ("ref",)
    actions = ("finalize_now",)

    def timeline_entity_ids(self, obj: NativeRunFinalization) -> list[str]:
        return [str(obj.pk)]

    def timeline_run_id(self, obj: NativeRunFinalization) -> Any:
        return obj.pk

    def get_queryset(self, request: HttpRequest) -> QuerySet[NativeRunFinalization]:
        # The page title names the run's agent and the issue (detail_title).
        return super().get_queryset(request).select_related(*self.list_select_related)

    @admin.display(description="coordinator", ordering="run_id")
    def ref(self, obj: NativeRunFinalization) -> SafeString:
        return format_html('<code title="{}">{}</code>', obj.run_id, short_id(obj.run_id))

    # Short times and codes (the whole value on hover): the list fits a 1366 px screen.
    @admin.display(description="gen.", ordering="controller_generation")
    def generation(self, obj: NativeRunFinalization) -> int:
        return obj.controller_generation

    @admin.display(description="lease expires", ordering="lease_expires_at")
    def lease_expires(self, obj: NativeRunFinalization) -> SafeString | str:
        return when(obj.lease_expires_at)

    @admin.display(description="failure", ordering="failure_code")
    def failure(self, obj: NativeRunFinalization) -> SafeString | str:
        code = obj.failure_code
        if not code:
            return "—"
        shown = code if len(code) <= 14 else f"{code[:13]}…"
        return format_html('<code title="{}">{}</code>', code, shown)

    @admin.display(description="next attempt", ordering="next_attempt_at")
    def next_attempt(self, obj: NativeRunFinalization) -> SafeString | str:
        return when(obj.next_attempt_at)

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: NativeRunFinalization) -> SafeString | str:
        return when(obj.updated_at)

    def detail_title(self, obj: NativeRunFinalization) -> str:
        return (
            f"coordinator of {run_name(obj.run)} ({short_id(obj.run_id)}) "
            f"on “{obj.issue.title}” ({obj.phase})"
        )

    def detail_panels(self, request: HttpRequest, obj: NativeRunFinalization) -> list[SafeString]:
        run = HeartbeatRun.objects.filter(pk=obj.run_id, company_id=obj.company_id).first()
        if run is None or obj.result_id is None:
            return []
        hold = run_board_hold(company_id=obj.company_id, run_id=obj.run_id)
        first = [hold_panel(hold)] if hold is not None else []
        state = finalization_state(run, coordinator=obj)
        words = {
            "failed": "Finalization failed: the copy-back retry budget is spent.",
            "retry_scheduled": "A copy-back attempt failed; the worker retries at the time below.",
            # Each hold reason has its own next step (a conflict is not an owner stop).
            "held": f"Held for the board ({state.reason}): "
            + HOLD_REMEDIATION.get(state.reason or "", "see the run's recovery action."),
            "queued": "Queued: a worker will attempt it now.",
            "running": "Running: a live owner is finalizing it.",
            "waiting": "Due, but no job waits for it yet: the reconciler defers one shortly.",
            "committed": "Committed.",
        }
        lines = [f"Attempts: {state.attempts}."]
        if state.last_error:
            lines.append(f"Last error: {state.last_error}.")
        if state.next_attempt_at:
            lines.append(f"Next attempt: {state.next_attempt_at:%Y-%m-%d %H:%M:%S} UTC.")
        if state.state == "failed":
            lines.append(
                "Fix the cause (destination directory, permissions, disk on the worker's host), "
                "then retry finalization now."
            )
        if state.state == "held":
            lines.append("Open the run's recovery action: it says what is held and why.")
        return [
            *first,
            console_panel(
                panel_id="finalization-state",
                state=state.state,
                title=f"Finalization: {state.state.replace('_', ' ')}",
                headline=words.get(state.state, state.state),
                lines=lines,
                ok=state.state in ("committed", "queued", "running"),
            ),
        ]

    def detail_actions(
        self, request: HttpRequest, obj: NativeRunFinalization
    ) -> list[dict[str, Any]]:
        if obj.result_id is None or obj.phase == NativeRunFinalization.Phase.COMMITTED:
            return []
        hold = run_board_hold(company_id=obj.company_id, run_id=obj.run_id)
        if hold is not None:
            return [hold_detail_action(hold)]
        label = "Retry finalization now" if obj.failure_code else "Finalize now"
        return [{"action": "finalize_now", "label": label, "primary": True}]

    @admin.action(description="Finalize selected runs now", permissions=["finalize"])
    def finalize_now(self, request: HttpRequest, queryset: QuerySet[NativeRunFinalization]) -> None:
        self._finalize_each(
            request, list(queryset.order_by("pk").values_list("company_id", "run_id"))
        )
