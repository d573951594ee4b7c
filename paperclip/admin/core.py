"""Admin for the core models.

The board sets up companies, memberships, agents, issues and execution workspaces here as
ordinary editable records (each save writes an audit row). Records whose state changes only
through services (results, workspace operations, credentials) are read-only; credentials are
revoked through an action that calls the service. Runs, coordinators and the audit log have
their pages in the console and in recovery (they link to every app's rows).
"""

from __future__ import annotations

from datetime import UTC
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import URLPattern
from django.utils.html import format_html
from django.utils.safestring import SafeString

from paperclip.admin.history import history_panel, history_urls
from paperclip.admin.lists import IndexedValuesListFilter, recent_filter
from paperclip.admin.names import RunIssueColumns, run_link, run_name, workspace_link
from paperclip.admin.toolkit import (
    COMPANY_FILTER,
    AuditedAdmin,
    CompanyListFilter,
    ReadOnlyAdmin,
    act_on_each,
    console_panel,
    member_company_ids,
    report_each,
    short_id,
)
from paperclip.credentials import agent_key_revoke, board_token_revoke
from paperclip.errors import WorkspaceCwdNotAllowed
from paperclip.models import (
    Agent,
    AgentApiKey,
    BoardApiToken,
    BoardMembership,
    Company,
    ExecutionWorkspace,
    ExecutionWorkspaceSnapshot,
    Issue,
    NativeRunResult,
    WorkspaceOperation,
)
from paperclip.services import absolute_path_error, workspace_cwd_check_in_tx
from paperclip.snapshots.adopt import workspace_cwd_adopt_defer_in_tx
from paperclip.snapshots.behind import (
    MaterializeRetry,
    behind_for_attention,
    workspace_materialize_retry,
)
from paperclip.templatetags.console import stamp

# Django's admin and form classes are not subscriptable at runtime (no django-stubs-ext patch).
if TYPE_CHECKING:
    _TabularInline = admin.TabularInline[Any, Any]
    _ModelForm = forms.ModelForm[Any]
else:
    _TabularInline = admin.TabularInline
    _ModelForm = forms.ModelForm


@admin.register(Company)
class CompanyAdmin(AuditedAdmin):
    company_lookup = "id"
    audit_entity = "company"
    list_display = ("name", "id", "created_at")
    search_fields = ("name", "id")
    readonly_fields = ("id", "created_at", "updated_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        # As in the API: only superusers create companies.
        return bool(getattr(request.user, "is_superuser", False))


@admin.register(BoardMembership)
class BoardMembershipAdmin(AuditedAdmin):
    audit_entity = "board_membership"
    list_display = ("user", "company", "created_at")
    list_filter = (COMPANY_FILTER,)
    search_fields = ("user__username", "company__name")
    autocomplete_fields = ("company",)
    readonly_fields = ("created_at",)


class AgentApiKeyInline(_TabularInline):
    model = AgentApiKey
    extra = 0
    can_delete = False
    fields = ("prefix", "name", "created_at", "last_used_at", "revoked_at")
    readonly_fields = fields
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Agent)
class AgentAdmin(AuditedAdmin):
    audit_entity = "agent"
    list_display = ("name", "company", "role", "status", "id", "created_at")
    list_filter = ("role", "status", COMPANY_FILTER)
    search_fields = ("name", "id")
    autocomplete_fields = ("company",)
    readonly_fields = ("id", "created_at", "updated_at")
    inlines = (AgentApiKeyInline,)


class _CredentialAdmin(ReadOnlyAdmin):
    @admin.display(boolean=True, description="active")
    def active(self, obj: AgentApiKey | BoardApiToken) -> bool:
        return obj.revoked_at is None

    def _revoke_each(self, request: HttpRequest, ids: list[Any], revoke: Any, arg: str) -> None:
        def act(pk: Any) -> str:
            result = revoke(**{arg: pk}, actor_type="user", actor_id=str(request.user.pk))
            return "revoked" if result.changed else "unchanged"

        done = act_on_each(ids, act, name=lambda pk: pk)
        report_each(
            self,
            request,
            f"Revoked {done.counts['revoked']}; already revoked {done.counts['unchanged']}; "
            "failed: ",
            done.failed,
        )


@admin.register(AgentApiKey)
class AgentApiKeyAdmin(_CredentialAdmin):
    company_lookup = "agent__company_id"
    list_display = ("__str__", "agent", "name", "active", "created_at", "last_used_at")
    list_filter = (
        ("revoked_at", admin.EmptyFieldListFilter),
        ("agent__company", CompanyListFilter),
    )
    search_fields = ("prefix", "name", "agent__name", "agent__id")
    list_select_related = ("agent",)
    exclude = ("secret_sha256",)
    actions = ("revoke_selected",)

    @admin.action(description="Revoke selected agent keys", permissions=["revoke"])
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[AgentApiKey]) -> None:
        ids = list(queryset.order_by("pk").values_list("pk", flat=True))
        self._revoke_each(request, ids, agent_key_revoke, "key_id")

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        # Visible keys belong to the user's companies (get_queryset); board staff with the
        # keys' change permission may revoke them (view alone shows them).
        user: Any = request.user
        return bool(
            getattr(user, "is_staff", False) and user.has_perm("paperclip.change_agentapikey")
        )


@admin.register(BoardApiToken)
class BoardApiTokenAdmin(_CredentialAdmin):
    list_display = ("__str__", "user", "name", "active", "created_at", "last_used_at")
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("prefix", "name", "user__username")
    list_select_related = ("user",)
    exclude = ("secret_sha256",)
    actions = ("revoke_selected",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[BoardApiToken]:
        queryset = admin.ModelAdmin.get_queryset(self, request)
        user: Any = request.user
        return queryset if user.is_superuser else queryset.filter(user=user)

    @admin.action(description="Revoke selected board tokens", permissions=["revoke"])
    def revoke_selected(self, request: HttpRequest, queryset: QuerySet[BoardApiToken]) -> None:
        ids = list(queryset.order_by("pk").values_list("pk", flat=True))
        self._revoke_each(request, ids, board_token_revoke, "token_id")

    def has_revoke_permission(self, request: HttpRequest) -> bool:
        return bool(getattr(request.user, "is_staff", False))


def _record_company_id(form: forms.ModelForm[Any], data: dict[str, Any]) -> Any:
    """The company chosen on the add page, or an existing record's own: its company is shown
    read-only on the change page (`AuditedAdmin`), so that form has no such field."""
    company = data.get("company")
    return company.pk if company is not None else form.instance.company_id


class IssueAdminForm(_ModelForm):
    class Meta:
        model = Issue
        fields = (
            "company",
            "title",
            "status",
            "hidden_at",
            "assignee_agent",
            "execution_workspace",
        )

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        company_id = _record_company_id(self, data)
        for field in ("assignee_agent", "execution_workspace"):
            related = data.get(field)
            if related is not None and company_id is not None and related.company_id != company_id:
                self.add_error(field, "Must belong to the issue's company.")
        return data


@admin.register(Issue)
class IssueAdmin(AuditedAdmin):
    form = IssueAdminForm
    audit_entity = "issue"
    list_display = (
        "title",
        "company",
        "status",
        "assignee_agent",
        "execution_run_named",
        "hidden_at",
        "updated_at",
    )
    list_filter = ("status", ("hidden_at", admin.EmptyFieldListFilter), COMPANY_FILTER)
    search_fields = ("title", "id")
    list_select_related = ("company", "assignee_agent", "execution_run__agent")
    autocomplete_fields = ("company", "assignee_agent", "execution_workspace")
    # The execution lock moves only with run status changes (services).
    readonly_fields = (
        "id",
        "execution_run_named",
        "checkout_run_named",
        "execution_locked_at",
        "created_at",
        "updated_at",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Issue]:
        # The change page names the runs holding the issue by their agents.
        return (
            super()
            .get_queryset(request)
            .select_related(*self.list_select_related, "checkout_run__agent")
        )

    @admin.display(description="execution run", ordering="execution_run__agent__name")
    def execution_run_named(self, obj: Issue) -> SafeString | str:
        return run_link(obj.execution_run)

    @admin.display(description="checkout run")
    def checkout_run_named(self, obj: Issue) -> SafeString | str:
        return run_link(obj.checkout_run)


class ExecutionWorkspaceAdminForm(_ModelForm):
    class Meta:
        model = ExecutionWorkspace
        fields = (
            "company",
            "name",
            "status",
            "cwd",
            "source_issue",
            "mode",
            "strategy_type",
            "provider_type",
            "provider_ref",
            "metadata",
        )

    # Set per request by ExecutionWorkspaceAdmin.get_form: a superuser may give any cwd.
    superuser = False

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        company_id = _record_company_id(self, data)
        issue = data.get("source_issue")
        if issue is not None and company_id is not None and issue.company_id != company_id:
            self.add_error("source_issue", "Must belong to the workspace's company.")
        cwd = data.get("cwd")
        moved = {"cwd", "company"} & set(self.changed_data)
        if cwd and company_id is not None and moved:
            # The admin's change view runs inside a transaction: the advisory lock taken here
            # is held until the save commits.
            try:
                workspace_cwd_check_in_tx(cwd=cwd, company_id=company_id, superuser=self.superuser)
            except WorkspaceCwdNotAllowed as exc:
                self.add_error("cwd", exc.message)
        return data

    def clean_cwd(self) -> str | None:
        cwd = self.cleaned_data.get("cwd") or None
        if cwd is not None and (problem := absolute_path_error(cwd)):
            raise forms.ValidationError(problem)
        return cwd


class BehindHeadFilter(admin.SimpleListFilter):
    """Workspaces whose cwd does not hold their head: the last materialization failed, or the
    head moved over a minute ago (the dashboard's "Workspaces behind their head" tile)."""

    title = "cwd state"
    parameter_name = "behind"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Behind its head")]

    def queryset(
        self, request: HttpRequest, queryset: QuerySet[ExecutionWorkspace]
    ) -> QuerySet[ExecutionWorkspace]:
        if self.value() != "yes":
            return queryset
        return behind_for_attention(queryset)


def _retry_said(name: str, outcome: MaterializeRetry) -> str:
    """What "Retry materialization now" did to one workspace, in words."""
    if outcome.status == "deferred":
        return f"{name}: job {outcome.job_id} deferred to write {short_tree(outcome.head)} " + (
            f"over {short_tree(outcome.cwd_tree)}"
            if outcome.cwd_tree is not None
            else "over what the cwd holds (its tree unknown: compared with the disk)"
        )
    if outcome.status == "already_queued":
        return f"{name}: a materialization job was already waiting; it runs next"
    if outcome.status == "no_cwd":
        return f"{name}: no cwd, nothing to materialize"
    return f"{name}: the cwd already holds the head {short_tree(outcome.head)}, nothing to do"


def _behind(obj: ExecutionWorkspace) -> bool:
    return bool(obj.cwd) and obj.head_tree is not None and obj.cwd_tree != obj.head_tree


def short_tree(tree: str | None) -> str:
    return "nothing" if tree is None else f"{tree[:19]}…"


@admin.register(ExecutionWorkspace)
class ExecutionWorkspaceAdmin(AuditedAdmin):
    form = ExecutionWorkspaceAdminForm
    audit_entity = "execution_workspace"
    list_display = (
        "name",
        "company",
        "status",
        "cwd",
        "materialization",
        "runtime_lease_generation",
        "last_used_at",
    )
    list_filter = (
        "status",
        BehindHeadFilter,
        ("provider_type", IndexedValuesListFilter),
        COMPANY_FILTER,
    )
    actions = ("retry_materialization",)
    search_fields = ("name", "id", "cwd")
    list_select_related = ("company",)
    autocomplete_fields = ("company", "source_issue")

    # The change page is an operator's view: the head's history (detail panels) and state
    # first, the editable settings folded away below (docs/snapshots.md#the-console).
    STATE_FIELDS = (
        "head_tree",
        "head_run_named",
        "head_committed_at",
        "cwd_tree",
        "materialize_error",
        "materialize_failed_at",
        "materialize_attempts",
        "materialize_next_at",
        "runtime_lease_generation",
        "id",
        "opened_at",
        "created_at",
        "updated_at",
    )
    # The lease generation is a fencing counter owned by the lease service; the head moves only
    # when a run commits (docs/snapshots.md#publishing): the state is read-only.
    readonly_fields = STATE_FIELDS

    def get_fieldsets(self, request: HttpRequest, obj: ExecutionWorkspace | None = None) -> Any:
        if obj is None:
            return super().get_fieldsets(request, obj)
        return [
            ("State", {"fields": self.STATE_FIELDS}),
            (
                "Settings",
                {"fields": ExecutionWorkspaceAdminForm.Meta.fields, "classes": ("collapse",)},
            ),
        ]

    def get_urls(self) -> list[URLPattern]:
        return history_urls(self) + super().get_urls()

    def get_form(
        self, request: HttpRequest, obj: Any | None = None, change: bool = False, **kwargs: Any
    ) -> type[_ModelForm]:
        # A class of this request's own, so the flag is this user's alone.
        form = super().get_form(request, obj, change, **kwargs)
        superuser = bool(getattr(request.user, "is_superuser", False))
        return type(form.__name__, (form,), {"superuser": superuser})

    def get_queryset(self, request: HttpRequest) -> QuerySet[ExecutionWorkspace]:
        # The change page names the run that published the head by its agent.
        return super().get_queryset(request).select_related("company", "head_run__agent")

    @admin.display(description="head run")
    def head_run_named(self, obj: ExecutionWorkspace) -> SafeString | str:
        return run_link(obj.head_run)

    @admin.display(description="cwd state")
    def materialization(self, obj: ExecutionWorkspace) -> SafeString | str:
        """Whether the cwd holds the head, and the last failure to make it (with the next
        attempt) when there is one."""
        if not obj.cwd or obj.head_tree is None:
            return "-"
        if obj.cwd_tree == obj.head_tree:
            return "at its head"
        if obj.materialize_error is None:
            return "behind its head"
        return format_html(
            "behind: {} <span class='help'>(attempt {}; next {})</span>",
            obj.materialize_error[:200],
            obj.materialize_attempts,
            stamp(obj.materialize_next_at) if obj.materialize_next_at else "not scheduled",
        )

    def detail_actions(self, request: HttpRequest, obj: ExecutionWorkspace) -> list[dict[str, Any]]:
        if not _behind(obj):
            return []
        return [
            {
                "action": "retry_materialization",
                "label": "Retry materialization now",
                "primary": True,
            }
        ]

    def detail_panels(self, request: HttpRequest, obj: ExecutionWorkspace) -> list[SafeString]:
        history = history_panel(request, obj)
        if not _behind(obj):
            return [history]
        lines = [
            f"Head {obj.head_tree}; the cwd holds {obj.cwd_tree or 'an unknown tree'}.",
            "Agents' checkouts read the head from the store and keep working meanwhile.",
        ]
        if obj.materialize_error is None:
            headline = "The worker has not written the head into the cwd yet."
        else:
            headline = f"Materialization failed: {obj.materialize_error[:500]}"
            when = obj.materialize_next_at
            lines.append(
                f"Failures in a row: {obj.materialize_attempts}; the worker tries again "
                + (
                    f"at {when.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC."
                    if when
                    else "when the head moves."
                )
            )
            lines.append(
                "Fix what the error names (disk space, the cwd's permissions, a lost blob), "
                "then Retry materialization now."
            )
        return [
            history,
            console_panel(
                panel_id="materialization",
                state="behind",
                title="cwd behind its head",
                headline=headline,
                lines=lines,
            ),
        ]

    @admin.action(description="Retry materialization now", permissions=["change"])
    def retry_materialization(
        self, request: HttpRequest, queryset: QuerySet[ExecutionWorkspace]
    ) -> None:
        names = dict(queryset.order_by("pk").values_list("pk", "name"))
        company_ids = member_company_ids(request)
        said: list[str] = []

        def act(pk: Any) -> str:
            outcome = workspace_materialize_retry(
                workspace_id=pk, company_ids=company_ids, actor_id=str(request.user.pk)
            )
            said.append(_retry_said(names[pk], outcome))
            return outcome.status

        done = act_on_each(list(names), act, name=lambda pk: names[pk])
        report_each(
            self, request, f"{'; '.join(said) or 'Nothing selected'}. Failed: ", done.failed
        )

    def save_model(
        self, request: HttpRequest, obj: ExecutionWorkspace, form: Any, change: bool
    ) -> None:
        super().save_model(request, obj, form, change)
        if not change and obj.cwd:
            # As the API's create: what the cwd holds becomes the first head.
            workspace_cwd_adopt_defer_in_tx(company_id=obj.company_id, workspace_id=obj.pk)


def _ref(pk: Any) -> SafeString:
    """A row's own short id (its first column, the link to its page), the whole id on hover."""
    return format_html('<code title="{}">{}</code>', pk, short_id(pk))


@admin.register(ExecutionWorkspaceSnapshot)
class ExecutionWorkspaceSnapshotAdmin(ReadOnlyAdmin):
    list_display = ("snapshot", "workspace", "company", "status", "created_at")
    list_display_links = ("snapshot",)
    list_filter = ("status", COMPANY_FILTER)
    search_fields = ("id", "execution_workspace__id", "execution_workspace__name")
    list_select_related = ("company", "execution_workspace")

    def get_queryset(self, request: HttpRequest) -> QuerySet[ExecutionWorkspaceSnapshot]:
        return super().get_queryset(request).select_related(*self.list_select_related)

    @admin.display(description="snapshot", ordering="id")
    def snapshot(self, obj: ExecutionWorkspaceSnapshot) -> SafeString:
        return _ref(obj.pk)

    @admin.display(description="workspace", ordering="execution_workspace__name")
    def workspace(self, obj: ExecutionWorkspaceSnapshot) -> SafeString | str:
        return workspace_link(obj.execution_workspace)

    def detail_title(self, obj: ExecutionWorkspaceSnapshot) -> str:
        workspace = obj.execution_workspace
        return (
            f"snapshot {short_id(obj.pk)} of {workspace.name} ({short_id(workspace.pk)}), "
            f"{obj.status}"
        )


@admin.register(NativeRunResult)
class NativeRunResultAdmin(RunIssueColumns, ReadOnlyAdmin):
    list_display = (
        "result",
        "run_named",
        "issue_named",
        "schema_status",
        "rejection_code",
        "caller_result_id",
        "created_at",
    )
    list_display_links = ("result",)
    list_filter = ("schema_status", COMPANY_FILTER)
    search_fields = (
        "id",
        "run__id",
        "caller_result_id",
        "server_fingerprint",
        "run__agent__name",
        "issue__title",
    )
    list_select_related = ("run__agent", "issue")

    def get_queryset(self, request: HttpRequest) -> QuerySet[NativeRunResult]:
        # The change page names the run's agent and the issue (detail_title).
        return super().get_queryset(request).select_related(*self.list_select_related)

    @admin.display(description="result", ordering="id")
    def result(self, obj: NativeRunResult) -> SafeString:
        return _ref(obj.pk)

    def detail_title(self, obj: NativeRunResult) -> str:
        return (
            f"result {short_id(obj.pk)} ({obj.schema_status}) of {run_name(obj.run)} "
            f"({short_id(obj.run_id)}) on “{obj.issue.title}”"
        )


@admin.register(WorkspaceOperation)
class WorkspaceOperationAdmin(ReadOnlyAdmin):
    list_display = (
        "phase",
        "company",
        "status",
        "workspace",
        "run",
        "lease_generation",
        "exit_code",
        "started_at",
        "finished_at",
    )
    list_filter = ("phase", "status", recent_filter("started_at", "started"), COMPANY_FILTER)
    search_fields = ("id", "heartbeat_run__id", "execution_workspace__id", "command")
    list_select_related = ("company", "execution_workspace", "heartbeat_run__agent")

    @admin.display(description="workspace", ordering="execution_workspace__name")
    def workspace(self, obj: WorkspaceOperation) -> SafeString | str:
        return workspace_link(obj.execution_workspace)

    @admin.display(description="run")
    def run(self, obj: WorkspaceOperation) -> SafeString | str:
        return run_link(obj.heartbeat_run)
