"""The operator console: the admin site whose index is the "Needs attention" dashboard, its
in-place refresh fragment and the global id search (docs/runbook.md#the-console).

`ConsoleAdminSite` is Django's `admin.site` (installed through `PaperclipAdminConfig`), so
every `admin.register` keeps working. This module is imported while the app registry loads
(INSTALLED_APPS names its config), before models can be imported: hence the imports of models
and selectors inside the functions. Every view here is staff-only (`admin_view`) and scoped
to the operator's companies exactly as the model admins are; the views only read.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from django.apps import apps
from django.conf import settings
from django.contrib import admin
from django.contrib.admin.apps import AdminConfig
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, URLResolver, path, reverse
from django.utils.http import urlencode

# Polled by the dashboard; kept short enough to notice a new hold within a minute.
REFRESH_SECONDS = 15


def member_company_ids(request: HttpRequest) -> list[UUID] | None:
    from paperclip.admin.toolkit import member_company_ids as scope

    return scope(request)


def _tile_target(kind: str, detail: str | None) -> tuple[str, dict[str, str]]:
    from recovery.console.attention import SOURCES

    source = next(source for source in SOURCES if kind in source.kinds)
    return source.link(kind, detail)


def tile_url(kind: str, detail: str | None) -> str:
    """The changelist a tile opens, filtered to exactly the rows it counts."""
    name, query = _tile_target(kind, detail)
    url = reverse(name)
    return f"{url}?{urlencode(query)}" if query else url


class ConsoleAdminSite(admin.AdminSite):
    site_header = "Paperclip control plane"
    site_title = "Paperclip console"
    index_title = "Needs attention"
    site_url = None  # no public site: the API lives under /api/
    index_template = "admin/console/index.html"
    # The app list sidebar took a quarter of a laptop screen from every list; the dashboard
    # (the index) lists the apps, one click away through the breadcrumbs.
    enable_nav_sidebar = False

    def get_urls(self) -> list[URLResolver | URLPattern]:
        return [
            path("attention/", self.admin_view(self.attention_view), name="console_attention"),
            path("search/", self.admin_view(self.search_view), name="console_search"),
            *super().get_urls(),
        ]

    def _attention_context(self, request: HttpRequest) -> dict[str, Any]:
        from recovery.console.attention import attention_summary

        user: Any = request.user
        summary = attention_summary(
            company_ids=member_company_ids(request), include_jobs=bool(user.is_superuser)
        )
        tiles: list[dict[str, Any]] = [
            {
                "tile": tile,
                "url": tile_url(tile.kind, tile.detail)
                if self._can_open(request, tile.kind, tile.detail)
                else None,
            }
            for tile in summary.tiles
        ]
        return {
            "attention": summary,
            "tiles": tiles,
            "needing": [t for t in tiles if t["tile"].count],
            "quiet": [t for t in tiles if not t["tile"].count],
            "refresh_seconds": REFRESH_SECONDS,
            "time_zone": settings.TIME_ZONE,
        }

    def index(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        from paperclip.models import ActivityEvent
        from recovery.console.names import audit_names

        ids = member_company_ids(request)
        recent = ActivityEvent.objects.order_by("-created_at")
        if ids is not None:
            recent = recent.filter(company_id__in=ids)
        events = list(recent[:10])
        names = audit_names(events)  # one query per entity type shown
        context = {
            **self._attention_context(request),
            "recent_activity": [
                (event, names.entity_link(event), names.actor(event)) for event in events
            ],
            **(extra_context or {}),
        }
        return super().index(request, context)

    def attention_view(self, request: HttpRequest) -> HttpResponse:
        """The dashboard's tiles alone: what the index polls to refresh in place."""
        return TemplateResponse(
            request, "admin/console/attention.html", self._attention_context(request)
        )

    def search_view(self, request: HttpRequest) -> HttpResponse:
        """Find a run, issue, workspace, lease, recovery action, agent or company by id, short
        id prefix, agent name or issue title (any of the operator's companies); one hit opens
        it, several are listed."""
        from recovery.console.lookup import console_lookup

        query = (request.GET.get("q") or "").strip()
        hits = console_lookup(query=query, company_ids=member_company_ids(request))
        visible = [hit for hit in hits if self._can_view(request, hit.model)]
        if len(visible) == 1 and request.GET.get("list") != "1":
            hit = visible[0]
            return redirect(_change_url(hit.model, hit.pk))
        context = {
            **self.each_context(request),
            "title": "Find",
            "query": query,
            "hits": [(hit, _change_url(hit.model, hit.pk)) for hit in visible],
        }
        return TemplateResponse(request, "admin/console/search.html", context)

    def _can_open(self, request: HttpRequest, kind: str, detail: str | None) -> bool:
        # e.g. the worker pages are for superusers: a staff user's heartbeat tile links nowhere.
        name, _ = _tile_target(kind, detail)
        app_label, model_name = (
            name.removeprefix("admin:").removesuffix("_changelist").split("_", 1)
        )
        model = apps.get_model(app_label, model_name)
        return self._can_view(request, model)

    def _can_view(self, request: HttpRequest, model: type[Any]) -> bool:
        return self.is_registered(model) and self.get_model_admin(model).has_view_permission(
            request
        )


def _change_url(model: type[Any], pk: Any) -> str:
    opts = model._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[pk])


class PaperclipAdminConfig(AdminConfig):
    default_site = "recovery.console.site.ConsoleAdminSite"
