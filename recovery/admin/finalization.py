"""Admin of finalization: the coordinators (one per native run) with their attention filter,
and "Finalize now" (a list action and a detail button, here and on the run's page).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.safestring import SafeString

from checkpoints.attention import expired_authority_coordinators
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    ReadOnlyAdmin,
    act_on_each,
    admin_id_link,
    console_panel,
    report_each,
)
from paperclip.models import (
    HeartbeatRun,
    NativeRunFinalization,
)
from recovery.selectors.attention import failed_finalizations, retrying_finalizations
from recovery.selectors.finalization import finalization_state
from recovery.services import finalization_request


class FinalizeNowMixin:
    """ "Finalize now" (list action and detail button): `finalization_request`, as
    `POST /api/heartbeat-runs/{id}/finalize` does; audited `run.finalization_requested`."""

    def has_finalize_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def _finalize_each(self, request: HttpRequest, runs: list[tuple[Any, Any]]) -> None:
        def act(run: tuple[Any, Any]) -> str:
            company_id, run_id = run
            answer = finalization_request(
                company_id=company_id,
                run_id=run_id,
                actor_type="user",
                actor_id=str(request.user.pk),
            )
            return "queued" if answer.created else "unchanged"

        done = act_on_each(runs, act, name=lambda run: run[1])
        report_each(
            self,
            request,
            f"Finalization queued for {done.counts['queued']}; already queued or committed "
            f"{done.counts['unchanged']}; failed: ",
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
class NativeRunFinalizationAdmin(FinalizeNowMixin, ReadOnlyAdmin):
    list_display = (
        "run_link",
        "company",
        "phase",
        "attempt",
        "controller_generation",
        "lease_expires_at",
        "failure_code",
        "next_attempt_at",
        "updated_at",
    )
    list_filter = (CoordinatorAttentionFilter, "phase", COMPANY_FILTER)
    search_fields = ("=run__id", "=issue__id", "lease_owner")
    list_select_related = ("company",)
    actions = ("finalize_now",)

    def timeline_entity_ids(self, obj: NativeRunFinalization) -> list[str]:
        return [str(obj.pk)]

    def timeline_run_id(self, obj: NativeRunFinalization) -> Any:
        return obj.pk

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: NativeRunFinalization) -> SafeString | str:
        return admin_id_link(HeartbeatRun, obj.run_id)

    def detail_panels(self, request: HttpRequest, obj: NativeRunFinalization) -> list[SafeString]:
        run = HeartbeatRun.objects.filter(pk=obj.run_id, company_id=obj.company_id).first()
        if run is None or obj.result_id is None:
            return []
        state = finalization_state(run, coordinator=obj)
        words = {
            "failed": "Finalization failed: the copy-back retry budget is spent.",
            "retry_scheduled": "A copy-back attempt failed; the worker retries at the time below.",
            "held": "Held for the board: the previous owner can't be proven stopped.",
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
            lines.append("Open the run's recovery action and read its verdict.")
        return [
            console_panel(
                panel_id="finalization-state",
                state=state.state,
                title=f"Finalization: {state.state.replace('_', ' ')}",
                headline=words.get(state.state, state.state),
                lines=lines,
                ok=state.state in ("committed", "queued", "running"),
            )
        ]

    def detail_actions(
        self, request: HttpRequest, obj: NativeRunFinalization
    ) -> list[dict[str, Any]]:
        if obj.result_id is None or obj.phase == NativeRunFinalization.Phase.COMMITTED:
            return []
        label = "Retry finalization now" if obj.failure_code else "Finalize now"
        return [{"action": "finalize_now", "label": label, "primary": True}]

    @admin.action(description="Finalize selected runs now", permissions=["finalize"])
    def finalize_now(self, request: HttpRequest, queryset: QuerySet[NativeRunFinalization]) -> None:
        self._finalize_each(
            request, list(queryset.order_by("pk").values_list("company_id", "run_id"))
        )
