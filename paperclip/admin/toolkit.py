"""The admin toolkit every app's admin builds on: company scoping (a staff user who is not a
superuser sees only the companies they are a board member of), the company filter, links to
console pages, the activity timeline and detail actions of a change page, and the read-only
and audited base admins.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar
from uuid import UUID

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from paperclip.activity import activity_record
from paperclip.admin.lists import FlatCostListMixin
from paperclip.compat import admin_object_missing_redirect
from paperclip.errors import DomainError
from paperclip.models import (
    ActivityEvent,
    BoardMembership,
    Company,
)

# Django's admin and form classes are not subscriptable at runtime (no django-stubs-ext patch).
if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Any]
else:
    _ModelAdmin = admin.ModelAdmin


class CompanyListFilter(admin.RelatedFieldListFilter):
    """The company filter, offering only the operator's companies (the stock one would list
    every company's name to any staff user)."""

    def field_choices(self, field: Any, request: HttpRequest, model_admin: Any) -> list[Any]:
        ids = member_company_ids(request)
        companies = Company.objects.order_by("name")
        if ids is not None:
            companies = companies.filter(pk__in=ids)
        return [(c.pk, c.name) for c in companies]


COMPANY_FILTER = ("company", CompanyListFilter)


def console_panel(
    *,
    panel_id: str,
    state: str,
    title: str,
    headline: str,
    lines: list[str] | tuple[str, ...] = (),
    ok: bool = False,
) -> SafeString:
    """A "why, in words" panel for the top of a detail page (rendered with autoescaping)."""
    return SafeString(
        render_to_string(
            "admin/console/panel.html",
            {
                "panel_id": panel_id,
                "state": state,
                "title": title,
                "headline": headline,
                "lines": lines,
                "ok": ok,
            },
        )
    )


def admin_link(obj: Any, label: Any = None) -> SafeString | str:
    """A link to `obj`'s admin page (its change view); plain text if it has none. Pages are
    company-scoped, so a link never shows more than the operator may see."""
    if obj is None:
        return "—"
    opts = obj._meta
    if not admin.site.is_registered(type(obj)):
        return str(label if label is not None else obj)
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk])
    return format_html('<a href="{}">{}</a>', url, label if label is not None else obj)


def admin_id_link(model: Any, pk: Any, label: Any = None) -> SafeString | str:
    """A link to the object of `model` with primary key `pk` (not loaded)."""
    if pk is None:
        return "—"
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])
    return format_html('<a href="{}">{}</a>', url, label if label is not None else pk)


# What the console shows of an id beside a name, and the shortest prefix its search accepts
# (recovery.console.lookup): the first 8 hex digits, like a short git hash.
SHORT_ID_CHARS = 8


def short_id(pk: Any) -> str:
    """The first SHORT_ID_CHARS hex digits of an id (the part before the first dash)."""
    return str(pk)[:SHORT_ID_CHARS]


def named_id(name: Any, pk: Any, *, limit: int = 40) -> SafeString:
    """`agent-3 (73bf1a2c)`: a name (cut at `limit` characters) beside the start of its id;
    the whole name and id are in the title attribute."""
    text = str(name) if name not in (None, "") else "—"
    shown = text if len(text) <= limit else f"{text[: limit - 1]}…"
    return format_html(
        '<span class="console-named" title="{} · {}">{} '
        '<span class="console-id">({})</span></span>',
        text,
        pk,
        shown,
        short_id(pk),
    )


def named_link(model: Any, pk: Any, name: Any, *, limit: int = 40) -> SafeString | str:
    """A link to the object of `model` with primary key `pk`, labelled `named_id(name, pk)`."""
    if pk is None:
        return "—"
    return admin_id_link(model, pk, named_id(name, pk, limit=limit))


class ActivityTimelineMixin:
    """The HISTORY page of a state-bearing object is its audit timeline: the ActivityEvent
    rows naming it (`timeline_entity_ids`) or, for runs, carrying its run id."""

    timeline_limit: int = 500

    def timeline_entity_ids(self, obj: Any) -> list[str]:
        return [str(obj.pk)]

    def timeline_run_id(self, obj: Any) -> Any:
        return None

    def detail_title(self, obj: Any) -> str:
        """How the object's pages (its change page, its timeline) name it: names beside ids."""
        return str(obj)

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        model_admin: Any = self
        obj = model_admin.get_object(request, unquote(object_id))
        if obj is None:
            return admin_object_missing_redirect(model_admin, request, object_id)
        if not model_admin.has_view_or_change_permission(request, obj):
            raise PermissionDenied
        condition = Q(entity_id__in=self.timeline_entity_ids(obj))
        run_id = self.timeline_run_id(obj)
        if run_id is not None:
            condition |= Q(run_id=run_id)
        events = ActivityEvent.objects.filter(condition)
        company_id = getattr(obj, "company_id", None)
        if company_id is not None:
            events = events.filter(company_id=company_id)
        ids = member_company_ids(request)
        if ids is not None:
            events = events.filter(company_id__in=ids)
        rows = list(events.order_by("-created_at", "-id")[: self.timeline_limit])
        opts = model_admin.model._meta
        context = {
            **model_admin.admin_site.each_context(request),
            "title": f"Activity of {self.detail_title(obj)}",
            "subtitle": None,
            "object": obj,
            "opts": opts,
            "events": [
                (event, json.dumps(event.details, indent=2, sort_keys=True)) for event in rows
            ],
            "limit": self.timeline_limit,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/console/timeline.html", context)


class DetailActionsMixin:
    """Actions as buttons on the detail page: each button posts the object to the changelist's
    own action (same confirmation page, same service, same permission), and panels that say
    in words why the object needs attention appear above its fields.

    An item `{"action", "label", "primary"?}` acts on this object; one that also names
    `"model"` and `"pk"` posts that object to the action of that model's admin (a run's page
    offering its hold's confirmation), shown only when that admin offers the action."""

    def response_action(  # Django 6.1 adds action_location: passed on
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        """An action on ids that are not this list's keys (a crafted POST) does nothing and
        says so, where filtering on them raised a ValidationError (a 500)."""
        model_admin: Any = self
        key = model_admin.model._meta.pk
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            try:
                key.to_python(value)
            except ValidationError:
                model_admin.message_user(
                    request, "Nothing was done: the selection names no row.", messages.ERROR
                )
                return HttpResponseRedirect(request.get_full_path())
        parent: Any = super()
        answer: HttpResponse | None = parent.response_action(request, queryset, *args, **kwargs)
        return answer

    change_form_template: ClassVar[Any] = "admin/console/change_form.html"

    def detail_actions(self, request: HttpRequest, obj: Any) -> list[dict[str, Any]]:
        return []

    def detail_panels(self, request: HttpRequest, obj: Any) -> list[SafeString]:
        return []

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        model_admin: Any = self
        obj = model_admin.get_object(request, unquote(object_id))
        extra = dict(extra_context or {})
        if obj is not None:
            extra["console_actions"] = [
                offered
                for item in self.detail_actions(request, obj)
                if (offered := self._offered(request, item, obj)) is not None
            ]
            extra["console_panels"] = self.detail_panels(request, obj)
            title = getattr(self, "detail_title", None)
            if title is not None:
                extra["subtitle"] = title(obj)
        response: HttpResponse = super().change_view(  # type: ignore[misc]
            request, object_id, form_url, extra
        )
        return response

    def _offered(
        self, request: HttpRequest, item: dict[str, Any], obj: Any
    ) -> dict[str, Any] | None:
        """The button as the template draws it (the list to post to, the object to select), or
        None when the user may not run that action there."""
        model_admin: Any = self
        target = item.get("model", type(obj))
        site = model_admin.admin_site
        if target is type(obj):
            owner = model_admin
        elif site.is_registered(target):
            owner = site.get_model_admin(target)
        else:
            return None
        if item["action"] not in owner.get_actions(request):
            return None
        opts = target._meta
        return {
            **item,
            "url": reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"),
            "selected": item.get("pk", obj.pk),
        }


class CompanyScopedAdmin(FlatCostListMixin, DetailActionsMixin, ActivityTimelineMixin, _ModelAdmin):
    """Limits rows (and foreign-key choices) to the user's companies; lists count at most
    LIST_COUNT_CAP rows (paperclip.admin.lists)."""

    company_lookup = "company_id"

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        queryset = super().get_queryset(request)
        ids = member_company_ids(request)
        if ids is None:
            return queryset
        return queryset.filter(**{f"{self.company_lookup}__in": ids})

    def formfield_for_foreignkey(
        self, db_field: Any, request: HttpRequest, **kwargs: Any
    ) -> forms.ModelChoiceField[Any] | None:
        ids = member_company_ids(request)
        if ids is not None:
            related = db_field.related_model
            if related is Company:
                kwargs["queryset"] = Company.objects.filter(pk__in=ids)
                # Instance-wide rows (no company: an environment every company may use) are
                # a superuser's to make; a member's row is always in one of their companies.
                kwargs["required"] = True
            elif any(f.name == "company" for f in related._meta.fields):
                kwargs["queryset"] = related.objects.filter(company_id__in=ids)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class NoWritesMixin:
    """Browse only: the admin never adds, edits or deletes these rows."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyAdmin(NoWritesMixin, CompanyScopedAdmin):
    """State that changes only through services: browse, never add, edit or delete."""


class AuditedAdmin(CompanyScopedAdmin):
    """Editable setup records: every admin save writes one audit row in its transaction. A
    record's company is chosen when it is added and never changed after: what hangs off it
    (a workspace's history and store, an agent's keys and runs, an issue's runs) stays in the
    company it was made in, and moving the record would show it to the other company."""

    audit_entity: str = ""

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        fields = tuple(super().get_readonly_fields(request, obj))
        has_company = any(f.name == "company" for f in self.model._meta.concrete_fields)
        if obj is not None and has_company and "company" not in fields:
            fields = (*fields, "company")
        return fields

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        """A new record saved whole; a changed one writes only the fields the form changed
        (and its `auto_now` times): a whole-row save wrote back, as read when the page was
        posted, the columns services move meanwhile (a workspace's head and lease generation,
        an issue's execution lock), undoing what a run had just committed. Nothing changed:
        nothing written, no audit row."""
        if change:
            columns = {field.name for field in obj._meta.concrete_fields}
            fields = [name for name in form.changed_data if name in columns]
            if not fields:
                return
            stamps = [
                field.name
                for field in obj._meta.concrete_fields
                if getattr(field, "auto_now", False)
            ]
            obj.save(update_fields=[*fields, *stamps])
        else:
            super().save_model(request, obj, form, change)
        company_id = obj.pk if isinstance(obj, Company) else getattr(obj, "company_id", None)
        activity_record(
            company_id=company_id,
            actor_type=ActivityEvent.ActorType.USER,
            actor_id=str(request.user.pk),
            action=f"{self.audit_entity}.{'updated' if change else 'created'}",
            entity_type=self.audit_entity,
            entity_id=str(obj.pk),
            details={"via": "admin", "fields": sorted(form.changed_data)},
        )


def member_company_ids(request: HttpRequest) -> list[UUID] | None:
    """Companies the staff user may see in the console; None means all (superuser)."""
    user: Any = request.user
    if user.is_superuser:
        return None
    return list(BoardMembership.objects.filter(user=user).values_list("company_id", flat=True))


@dataclass(frozen=True, slots=True)
class EachOutcome:
    """What an admin action did to each selected item: how many ended each way, and the ones
    that failed, each named with its error code."""

    counts: Counter[str]
    failed: list[str]


def act_on_each[T](
    items: Iterable[T], act: Callable[[T], str], *, name: Callable[[T], object]
) -> EachOutcome:
    """Apply `act` (a service call returning how it ended) to every item, one after another.
    A DomainError fails that item alone, named `name(item): code (why)`, its message saying
    why; the others go on."""
    counts: Counter[str] = Counter()
    failed: list[str] = []
    for item in items:
        try:
            counts[act(item)] += 1
        except DomainError as exc:
            failed.append(f"{name(item)}: {exc.code} ({exc.text.rstrip('.')})")
    return EachOutcome(counts, failed)


def report_each(model_admin: Any, request: HttpRequest, text: str, failed: list[str]) -> None:
    """The action's one message: `text`, then its failures (a warning when there are any)."""
    level = messages.WARNING if failed else messages.SUCCESS
    model_admin.message_user(request, f"{text}{', '.join(failed) or 'none'}", level)
