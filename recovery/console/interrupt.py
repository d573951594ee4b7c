"""The board's "Interrupt run…" (a list action and a button on the run's page): a confirmation
page that shows each selected run (agent, issue, status, whether it is orphaned), a required
reason, then `paperclip.services.run_interrupt`, the service behind
`POST /api/heartbeat-runs/{id}/interrupt`, once a run. The service writes the audit row; the
message says which runs were interrupted and which were refused and why. `INTERRUPT_BULK`
runs the same service on every run matching the list's filter (paperclip.admin.bulk).
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django import forms
from django.contrib import admin
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from leases.orphans import orphaned_runs
from paperclip.access import Actor, board_actor
from paperclip.admin.bulk import BulkAction
from paperclip.admin.toolkit import act_on_each, report_each
from paperclip.models import HeartbeatRun
from paperclip.services import run_interrupt

CONFIRMATION_TEMPLATE = "admin/console/interrupt_confirmation.html"
MAX_REASON_CHARS = 2000  # as the API's InputSerializer


def _interrupt_one(actor: Actor, run: HeartbeatRun, reason: str) -> str:
    run_interrupt(
        company_ids=actor.company_ids,
        run_id=run.pk,
        actor_type=actor.actor_type,
        actor_id=actor.actor_id,
        reason=reason,
    )
    return "interrupted"


INTERRUPT_BULK = BulkAction(
    slug="interrupt",
    action="interrupt_selected",
    verb="Interrupt",
    title="Interrupt every matching run",
    act=_interrupt_one,
    outcomes={"interrupted": "interrupted (their issues' execution locks released)"},
    name=lambda run: f"run {run.pk}",
    explanation="Interrupting ends each live run at once: it becomes interrupted, its "
    "controller lease ends and its issue's execution lock is released. A run that has "
    "already ended is refused and left as it is.",
    reason_help="Why the runs are ended (for example: the host their agents ran on is gone); "
    "kept in each run's audit row.",
    columns=(
        ("Agent", lambda run: run.agent.name),
        ("Issue", lambda run: run.issue.title if run.issue_id else "—"),
        ("Status", lambda run: run.status),
    ),
)


class InterruptRunForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=MAX_REASON_CHARS,
        strip=True,
        help_text="Why the run is ended (for example: its agent's host is gone); kept in the "
        "run's audit row.",
    )


class InterruptRunMixin:
    """For the run admin: the action `interrupt_selected`, gated by `has_interrupt_permission`."""

    def has_interrupt_permission(self, request: HttpRequest) -> bool:
        user: Any = request.user
        return bool(
            user.is_active and user.is_staff and user.has_perm("paperclip.change_heartbeatrun")
        )

    @admin.action(
        description="Interrupt selected runs (reason required)", permissions=["interrupt"]
    )
    def interrupt_selected(
        self, request: HttpRequest, queryset: QuerySet[HeartbeatRun]
    ) -> HttpResponse | None:
        runs = list(queryset.select_related("agent", "issue").order_by("pk"))
        form = InterruptRunForm(request.POST if "apply" in request.POST else None)
        if form.is_bound and form.is_valid():
            self._interrupt_each(request, [run.pk for run in runs], form.cleaned_data["reason"])
            return None
        orphaned = {
            o.run_id: o.since
            for o in orphaned_runs(run_ids=[run.pk for run in runs], limit=len(runs) or 1)
        }
        model_admin: Any = self
        context = {
            **model_admin.admin_site.each_context(request),
            "title": "Interrupt runs",
            "opts": HeartbeatRun._meta,
            "runs": [(run, run.pk in orphaned, orphaned.get(run.pk)) for run in runs],
            "live": sum(1 for run in runs if not run.is_terminal),
            "form": form,
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "action_name": "interrupt_selected",
        }
        return TemplateResponse(request, CONFIRMATION_TEMPLATE, context)

    def _interrupt_each(self, request: HttpRequest, run_ids: list[UUID], reason: str) -> None:
        actor = board_actor(request.user)

        def act(run_id: UUID) -> str:
            run_interrupt(
                company_ids=actor.company_ids,
                run_id=run_id,
                actor_type=actor.actor_type,
                actor_id=actor.actor_id,
                reason=reason,
            )
            return "interrupted"

        done = act_on_each(run_ids, act, name=lambda run_id: f"run {run_id}")
        report_each(
            self,
            request,
            f"Interrupted {done.counts['interrupted']} run(s): each now reads interrupted and "
            "its issue's execution lock is released. Refused: ",
            done.failed,
        )
