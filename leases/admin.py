"""Admin of runtime leases: who holds which workspace, whether the owner is still live, and the
operator's "Force-release selected leases" action (confirmation page, reason, audited).

Leases are state-bearing, so the change form is read-only and there is no add/delete: every
change goes through `leases.services` (the admin's own transaction could not host their
durable transactions anyway). "Force-release all N matching…" runs the same service on every
lease the list's filter matches (paperclip.admin.bulk). The live stale reason of a whole page
is computed in the one changelist query (`with_stale_reason`), never per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from leases.errors import RuntimeLeaseSuperseded
from leases.models import WorkspaceRuntimeLease
from leases.selectors import (
    STALE,
    STALE_REASON,
    STALE_REASONS,
    among_stale_candidates,
    lease_renewal,
    with_renewal_age,
    with_stale_reason,
)
from leases.services import runtime_lease_force_release
from paperclip.access import Actor
from paperclip.admin.bulk import BulkAction, BulkByFilterMixin
from paperclip.admin.lists import FlatCostListMixin
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    ActivityTimelineMixin,
    DetailActionsMixin,
    named_id,
    named_link,
    short_id,
)
from paperclip.errors import DomainError
from paperclip.models import Agent, BoardMembership, HeartbeatRun, Issue
from paperclip.templatetags.console import stamp

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[WorkspaceRuntimeLease]
    _Queryset = QuerySet[WorkspaceRuntimeLease]
else:  # ModelAdmin is not subscriptable at runtime (no django_stubs_ext monkeypatch here)
    _ModelAdmin = admin.ModelAdmin
    _Queryset = QuerySet

CONFIRMATION_TEMPLATE = "admin/leases/workspaceruntimelease/force_release_confirmation.html"

# docs/leases.md#stale-reasons, in words for the lease's page.
STALE_REASON_TEXT: dict[str, str] = {
    "lease_expired": "Its TTL ran out: the owner stopped renewing it.",
    "owner_issue_missing": "The issue named by its owner key no longer exists.",
    "owner_issue_hidden": "The issue that owns it is hidden.",
    "owner_issue_terminal": "The issue that owns it is done or cancelled.",
    "owner_run_missing": "The run named by its owner key no longer exists.",
    "owner_run_terminal": "The run that owns it has ended.",
}


class StalenessFilter(admin.SimpleListFilter):
    title = "owner"
    parameter_name = "staleness"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("live", "Live owner"),
            ("stale", "Stale (any reason)"),
            ("expired", "Expired"),
        ]

    def queryset(self, request: HttpRequest, queryset: _Queryset) -> _Queryset:
        if self.value() == "live":
            return queryset.exclude(**STALE)
        if self.value() == "stale":
            return among_stale_candidates(queryset).filter(**STALE)
        if self.value() == "expired":
            # Through the floor's index; `expires_at` itself is the verdict.
            return queryset.filter(expiry_floor__lte=Now(), expires_at__lte=Now())
        return queryset


class StaleReasonFilter(admin.SimpleListFilter):
    title = "stale reason"
    parameter_name = "stale_reason"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(reason, reason.replace("_", " ")) for reason in STALE_REASONS]

    def queryset(self, request: HttpRequest, queryset: _Queryset) -> _Queryset:
        value = self.value()
        if value in STALE_REASONS:
            return among_stale_candidates(queryset).filter(**{STALE_REASON: value})
        return queryset


def _force_release_one(actor: Actor, lease: WorkspaceRuntimeLease, reason: str) -> str:
    # Pinned to the generation the filter matched: a lease reclaimed since is someone else's.
    result = runtime_lease_force_release(
        company_id=lease.company_id,
        execution_workspace_id=lease.execution_workspace_id,
        actor_type="user",
        actor_id=actor.actor_id,
        reason=reason,
        expected_generation=lease.generation,
    )
    return "released" if result.released else "gone"


FORCE_RELEASE_BULK = BulkAction(
    slug="force-release",
    action="force_release_selected",
    verb="Force-release",
    title="Force-release every matching runtime lease",
    act=_force_release_one,
    outcomes={"released": "released", "gone": "already gone (nothing written)"},
    name=lambda lease: lease.execution_workspace,
    explanation="Force-releasing deletes each workspace's lease whatever its owner, so the "
    "next claim gets the workspace; a lease claimed or reclaimed since this page was made is "
    "kept (its owner is not one shown here), and so is one reclaimed while the release runs "
    "(refused: runtime_lease_superseded).",
    unchanged_since="claimed_xid",
    reason_help="Why the owners are being evicted; kept in each lease's audit row.",
    columns=(
        ("Owner", lambda lease: lease.owner_key),
        ("Stale reason", lambda lease: getattr(lease, STALE_REASON, None) or "— (owner live)"),
        ("Expires", lambda lease: lease.expires_at),
    ),
)


class ForceReleaseForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=2000,
        strip=True,
        help_text="Why the owners are being evicted; kept in each lease's audit row.",
    )


@admin.register(WorkspaceRuntimeLease)
class WorkspaceRuntimeLeaseAdmin(
    BulkByFilterMixin, FlatCostListMixin, DetailActionsMixin, ActivityTimelineMixin, _ModelAdmin
):
    # Key columns first: at 1400 px the stale reason and renewal must stay on screen.
    list_display = (
        "workspace",
        "company",
        "stale_reason",
        "renewed",
        "expires",
        "owner",
        "generation",
        "last_action",
    )
    list_select_related = (
        "execution_workspace",
        "company",
        "owner_issue",
        "owner_run__agent",
        "owner_agent",
    )
    list_filter = (StalenessFilter, StaleReasonFilter, COMPANY_FILTER, "last_action")
    search_fields = ("owner_key", "execution_workspace__name", "company__name")
    ordering = ("expires_at",)
    actions = ("force_release_selected",)
    bulk_actions = (FORCE_RELEASE_BULK,)
    fields = (
        "company",
        "execution_workspace",
        "owner_key",
        "owner_issue",
        "owner_run",
        "owner_agent",
        "last_action",
        "generation",
        "claimed_at",
        "renewed_at",
        "expires_at",
        "stale_reason",
        "metadata",
        "created_at",
        "updated_at",
    )
    readonly_fields = fields

    def timeline_entity_ids(self, obj: WorkspaceRuntimeLease) -> list[str]:
        # Lease audit rows name the workspace (the lease row itself is deleted on release).
        return [str(obj.pk), str(obj.execution_workspace_id)]

    @admin.display(description="expires (UTC)", ordering="expires_at")
    def expires(self, lease: WorkspaceRuntimeLease) -> SafeString | str:
        return stamp(lease.expires_at)

    @admin.display(description="last renewal", ordering="renewed_at")
    def renewed(self, lease: WorkspaceRuntimeLease) -> SafeString | str:
        cadence = lease_renewal(lease)
        return format_html(
            '<span title="{}; renewed {}">{}{}</span>',
            cadence.text,
            lease.renewed_at.isoformat(),
            cadence.short,
            format_html(' <strong class="console-late">late</strong>') if cadence.missed else "",
        )

    @admin.display(description="workspace", ordering="execution_workspace__name")
    def workspace(self, lease: WorkspaceRuntimeLease) -> SafeString | str:
        # Not a link of its own: the first column is the row's link to the lease.
        return named_id(lease.execution_workspace.name, lease.execution_workspace_id, limit=28)

    @admin.display(description="owner", ordering="owner_key")
    def owner(self, lease: WorkspaceRuntimeLease) -> SafeString | str:
        return lease_owner_link(lease)

    def detail_title(self, obj: WorkspaceRuntimeLease) -> str:
        return (
            f"{obj.execution_workspace.name} ({short_id(obj.execution_workspace_id)}), "
            f"held by {lease_owner_name(obj)}"
        )

    def detail_panels(self, request: HttpRequest, obj: WorkspaceRuntimeLease) -> list[SafeString]:
        reason = getattr(obj, STALE_REASON, None)
        return [
            SafeString(
                render_to_string(
                    "admin/leases/workspaceruntimelease/stale_panel.html",
                    {
                        "lease": obj,
                        "reason": reason,
                        "text": STALE_REASON_TEXT.get(reason or ""),
                        "owner": lease_owner_link(obj),
                        "renewal": lease_renewal(obj).text,
                    },
                )
            )
        ]

    def detail_actions(
        self, request: HttpRequest, obj: WorkspaceRuntimeLease
    ) -> list[dict[str, Any]]:
        return [
            {
                "action": "force_release_selected",
                "label": "Force-release this lease…",
                "primary": bool(getattr(obj, STALE_REASON, None)),
            }
        ]

    def get_queryset(self, request: HttpRequest) -> _Queryset:
        queryset = with_renewal_age(with_stale_reason(super().get_queryset(request)))
        user = request.user
        if not getattr(user, "is_superuser", False):
            # Board members see (and can act on) only their companies' leases.
            companies = BoardMembership.objects.filter(user__pk=user.pk or 0).values("company_id")
            queryset = queryset.filter(company_id__in=companies)
        return queryset

    @admin.display(description="stale reason", ordering=STALE_REASON)
    def stale_reason(self, lease: WorkspaceRuntimeLease) -> str:
        reason = getattr(lease, STALE_REASON, None)
        return reason or "— (owner live)"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # use "Force-release selected leases": it is audited

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return bool(
            user.is_active
            and user.is_staff
            and user.has_perm("leases.change_workspaceruntimelease")
        )

    @admin.action(description="Force-release selected leases", permissions=["force_release"])
    def force_release_selected(
        self, request: HttpRequest, queryset: _Queryset
    ) -> TemplateResponse | None:
        # The generation each lease had when the operator looked: a lease reclaimed or
        # re-created since then belongs to someone the operator never saw, so it is kept.
        leases = list(queryset.select_related(*self.list_select_related).order_by("pk"))
        form = ForceReleaseForm(request.POST if request.POST.get("confirm") == "yes" else None)
        if form.is_bound and form.is_valid():
            self._force_release(request, form.cleaned_data["reason"], leases)
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Force-release runtime leases",
            "opts": self.model._meta,
            "leases": leases,
            # Who loses each workspace, and whether it is still renewing.
            "rows": [
                (lease, lease_owner_link(lease), lease_renewal(lease).text) for lease in leases
            ],
            "form": form,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "action_name": "force_release_selected",
        }
        return TemplateResponse(request, CONFIRMATION_TEMPLATE, context)

    def _force_release(
        self, request: HttpRequest, reason: str, leases: list[WorkspaceRuntimeLease]
    ) -> None:
        pinned = _pinned_generations(request.POST.getlist("pin"))
        if not pinned:
            self.message_user(request, "No leases to release.", messages.WARNING)
        current = {lease.pk: lease for lease in leases}
        for lease_id, generation in pinned.items():
            lease = current.get(lease_id)
            if lease is None:
                self.message_user(
                    request, f"Lease {lease_id}: already gone; nothing to do.", messages.INFO
                )
                continue
            workspace = lease.execution_workspace
            try:
                result = runtime_lease_force_release(
                    company_id=lease.company_id,
                    execution_workspace_id=lease.execution_workspace_id,
                    actor_type="user",
                    actor_id=str(request.user.pk),
                    reason=reason,
                    expected_generation=generation,
                )
            except RuntimeLeaseSuperseded as exc:
                self.message_user(
                    request,
                    f"{workspace}: not released, the lease changed since you selected it "
                    f"(generation {generation} → {exc.details.get('current_generation')}, owner "
                    f"now {lease.owner_key}) ({exc.code}).",
                    messages.WARNING,
                )
                continue
            except DomainError as exc:
                self.message_user(
                    request, f"{workspace}: not released ({exc.code}).", messages.ERROR
                )
                continue
            if result.released:
                self.message_user(
                    request,
                    f"{workspace}: released the lease of {result.owner_key} "
                    f"(generation {generation}).",
                    messages.SUCCESS,
                )
            else:
                self.message_user(request, f"{workspace}: already gone.", messages.INFO)


def lease_owner_name(lease: WorkspaceRuntimeLease) -> str:
    """The owner in words: `issue “Fix login” (73bf1a2c)`, `run 73bf1a2c of agent-3`,
    `agent agent-3 (73bf1a2c)`; the owner key when the owner row is gone."""
    kind, _, ident = lease.owner_key.partition(":")
    if kind == "issue" and lease.owner_issue is not None:
        return f"issue “{lease.owner_issue.title}” ({short_id(ident)})"
    if kind == "run" and lease.owner_run is not None:
        return f"run {short_id(ident)} of {lease.owner_run.agent.name}"
    if kind == "agent" and lease.owner_agent is not None:
        return f"agent {lease.owner_agent.name} ({short_id(ident)})"
    return lease.owner_key


def lease_owner_link(lease: WorkspaceRuntimeLease) -> SafeString | str:
    """The owner's name beside its short id, linked to its page (the owner key, with the
    whole key in the title, when the owner row is gone)."""
    kind, _, ident = lease.owner_key.partition(":")
    model = {"issue": Issue, "run": HeartbeatRun, "agent": Agent}.get(kind)
    target = {
        "issue": lease.owner_issue_id,
        "run": lease.owner_run_id,
        "agent": lease.owner_agent_id,
    }.get(kind)
    if model is None or target is None or str(target) != ident:
        return format_html('<code title="{}">{}</code>', lease.owner_key, lease.owner_key[:20])
    return named_link(model, target, f"{kind}: {_owner_row_name(lease, kind)}", limit=30)


def _owner_row_name(lease: WorkspaceRuntimeLease, kind: str) -> str:
    if kind == "issue" and lease.owner_issue is not None:
        return lease.owner_issue.title
    if kind == "run" and lease.owner_run is not None:
        return f"run of {lease.owner_run.agent.name}"
    if kind == "agent" and lease.owner_agent is not None:
        return lease.owner_agent.name
    return "gone"


def _pinned_generations(values: list[str]) -> dict[UUID, int]:
    """`<lease id>:<generation>` pairs from the confirmation page; malformed ones are ignored
    (they could only come from a tampered form, and ignoring them releases nothing)."""
    pinned: dict[UUID, int] = {}
    for value in values:
        lease_id, _, generation = value.partition(":")
        try:
            pinned[UUID(lease_id)] = int(generation)
        except ValueError:
            continue
    return pinned
