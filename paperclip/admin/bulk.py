"""Bulk actions by filter: act on every row matching a changelist's current filter, not only the
rows ticked on one page (docs/runbook.md#bulk-actions-by-filter).

A changelist whose admin names `bulk_actions` offers "<verb> all N matching…" beside its
filters. The link carries the changelist's querystring to a confirmation page that counts the
matching rows, previews the first few and requires a reason. On POST the filter is evaluated
again (the rows that match now, not those that matched when the page was drawn) and the
action's service runs once per row, in batches by primary key: each call is its own
transaction and writes its own audit row. The message counts every outcome and names each
refusal with its code and reason.

One piece of code for every model: an app's admin describes its action with a `BulkAction`
(which single-row admin action it stands for, and how to run its service on one row).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from django import forms
from django.contrib import messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import IGNORED_PARAMS, PAGE_VAR
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.db.models import BooleanField, QuerySet
from django.db.models.expressions import RawSQL
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from paperclip.access import Actor, board_actor
from paperclip.admin.toolkit import EachOutcome, act_on_each

# A filter matching more rows than this is refused: narrow it first. At one short transaction
# per row this is a few minutes of one request, the most we let a single click start.
BULK_CAP: Final = 5000
# Rows read per query while acting (keyset by primary key, so each batch is one index range).
BULK_BATCH: Final = 100
# Rows shown on the confirmation page.
BULK_PREVIEW: Final = 10
# Refusals named in the result message; the rest are counted.
REFUSALS_NAMED: Final = 20
MAX_REASON_CHARS: Final = 2000

BULK_TEMPLATE: Final = "admin/console/bulk_confirmation.html"
CHANGE_LIST_TEMPLATE: Final = "admin/console/change_list_bulk.html"


@dataclass(frozen=True, slots=True)
class BulkAction:
    """One model's bulk action.

    `action` is the admin action it stands for: whoever may not run that one (its permission)
    gets no link and a 403. `act(actor, row, reason)` calls the service on one row and
    returns how it ended (a key of `outcomes`); a DomainError refuses that row alone.
    """

    slug: str
    action: str
    verb: str  # "Interrupt": the link says "Interrupt all N matching…"
    title: str  # the confirmation page's title
    act: Callable[[Actor, Any, str], str]
    outcomes: Mapping[str, str]  # outcome key -> words for the message ("interrupted")
    name: Callable[[Any], object] = str  # how a row is named in the preview and refusals
    explanation: str = ""  # what acting does, above the preview
    reason_help: str = "Why; kept in each row's audit row."
    columns: tuple[tuple[str, Callable[[Any], object]], ...] = field(default=())
    # The column holding the id of the transaction that last gave the row's subject to its
    # holder (a lease's `claimed_xid`): rows given by a transaction that the confirmation
    # page's snapshot could not see (committed after it) are left alone, as the board never
    # saw their holder. A time would not do: a claim stamps the start of its transaction,
    # which may have waited for a lock while the page was made and committed after it.
    unchanged_since: str | None = None


class BulkReasonForm(forms.Form):
    reason = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 3, "cols": 80}),
        max_length=MAX_REASON_CHARS,
        strip=True,
    )
    # The count the operator saw; acting reports it beside the count acted on.
    seen = forms.IntegerField(widget=forms.HiddenInput, required=False, min_value=0)
    # The database's snapshot when the confirmation page was made (BulkAction.unchanged_since):
    # `xmin:xmax:xip,...` (pg_current_snapshot()).
    as_of = forms.CharField(widget=forms.HiddenInput, required=False, max_length=20000)


@dataclass(frozen=True, slots=True)
class BulkResult:
    """What a bulk run did: per-outcome counts and the named refusals."""

    done: EachOutcome

    @property
    def refused(self) -> int:
        return len(self.done.failed)


def _database_snapshot() -> str:
    """The database's snapshot now: which transactions have committed (taken before the page
    reads its rows, so that every transaction it counts as committed is in them)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_snapshot()::text")
        snapshot: str = cursor.fetchone()[0]
    return snapshot


_SNAPSHOT = re.compile(r"[0-9]{1,20}:[0-9]{1,20}:(?:[0-9]{1,20}(?:,[0-9]{1,20})*)?")


def _seen_by(queryset: QuerySet[Any], column: str, snapshot: str) -> QuerySet[Any]:
    """The rows whose `column` transaction the snapshot saw committed (or that has none)."""
    name = connection.ops.quote_name(column)  # the action's own constant
    seen = RawSQL(  # noqa: S611 - a quoted constant column; the snapshot is a parameter
        f"({name} IS NULL OR pg_visible_in_snapshot({name}::text::xid8, %s::pg_snapshot)"
        # the acting transaction's own writes (it is also the page's when one transaction
        # serves both, as in tests)
        f" OR {name} = pg_current_xact_id_if_assigned()::text::bigint)",
        [snapshot],
        output_field=BooleanField(),
    )
    return queryset.alias(_seen_by_page=seen).filter(_seen_by_page=True)


def bulk_rows(queryset: QuerySet[Any], *, batch: int = BULK_BATCH, limit: int) -> Iterator[Any]:
    """The rows of `queryset` in primary-key order, read `batch` at a time, at most `limit`.

    Keyset paging (`pk > last`) rather than offsets: acting on a row may take it out of the
    filter (an interrupted run no longer matches "running"), which would shift an offset."""
    ordered = queryset.order_by("pk")
    last: Any = None
    seen = 0
    while seen < limit:
        page = ordered if last is None else ordered.filter(pk__gt=last)
        rows = list(page[: min(batch, limit - seen)])
        if not rows:
            return
        yield from rows
        seen += len(rows)
        last = rows[-1].pk


def bulk_run(spec: BulkAction, *, actor: Actor, queryset: QuerySet[Any], reason: str) -> BulkResult:
    """Run `spec` on every row of `queryset` (at most BULK_CAP), one service call a row."""
    done = act_on_each(
        bulk_rows(queryset, limit=BULK_CAP),
        lambda row: spec.act(actor, row, reason),
        name=spec.name,
    )
    return BulkResult(done=done)


def bulk_summary(spec: BulkAction, result: BulkResult, *, seen: int | None) -> str:
    """The result message: how many ended each way, then each refusal with its reason."""
    acted = result.done.counts.total() + result.refused
    counts = ", ".join(
        f"{result.done.counts[key]} {words}"
        for key, words in spec.outcomes.items()
        if result.done.counts[key]
    )
    text = f"{spec.title}: {acted} row(s) acted on, one at a time"
    if seen is not None and seen != acted:
        text += f" ({seen} matched when you confirmed; the filter was read again)"
    text += f". Done: {counts or 'none'}. Refused: {result.refused}"
    if result.done.failed:
        named = result.done.failed[:REFUSALS_NAMED]
        more = result.refused - len(named)
        text += " (" + "; ".join(named) + (f"; and {more} more" if more else "") + ")"
    return text + "."


def describe_filter(changelist: Any, request: HttpRequest) -> list[str]:
    """The changelist's active filter in words ("status: Running", "search: builder"), read from
    the filter specs the changelist already built (no query of its own)."""
    words: list[str] = []
    covered: set[str] = set()
    for spec in changelist.filter_specs:
        expected = set(spec.expected_parameters())
        covered |= expected
        if not expected & set(request.GET):
            continue
        chosen = [str(c["display"]) for c in spec.choices(changelist) if c.get("selected")]
        words.append(f"{spec.title}: {', '.join(chosen) or '(none)'}")
    for key, values in request.GET.lists():
        if key not in covered and key not in (*IGNORED_PARAMS, PAGE_VAR):
            words.append(f"{key} = {', '.join(values)}")
    if changelist.query:
        words.append(f"search: {changelist.query}")
    return words


class BulkByFilterMixin:
    """For a ModelAdmin: the "act on all N matching" links and their confirmation pages, one
    per entry of `bulk_actions`."""

    bulk_actions: ClassVar[tuple[BulkAction, ...]] = ()
    change_list_template: ClassVar[Any] = CHANGE_LIST_TEMPLATE

    def get_urls(self) -> list[URLPattern]:
        model_admin: Any = self
        opts = model_admin.model._meta
        extra = [
            path(
                "bulk/<slug:slug>/",
                model_admin.admin_site.admin_view(self.bulk_view),
                name=f"{opts.app_label}_{opts.model_name}_bulk",
            )
        ]
        urls: list[URLPattern] = super().get_urls()  # type: ignore[misc]
        return extra + urls

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra = dict(extra_context or {})
        extra["bulk_offers"] = [
            {"verb": spec.verb, "slug": spec.slug, "url": self._bulk_url(request, spec)}
            for spec in self._bulk_offered(request)
        ]
        response: HttpResponse = super().changelist_view(request, extra)  # type: ignore[misc]
        return response

    def _bulk_offered(self, request: HttpRequest) -> list[BulkAction]:
        if not self.bulk_actions:
            return []
        model_admin: Any = self
        allowed = model_admin.get_actions(request)
        return [spec for spec in self.bulk_actions if spec.action in allowed]

    def _bulk_url(self, request: HttpRequest, spec: BulkAction) -> str:
        model_admin: Any = self
        opts = model_admin.model._meta
        params = request.GET.copy()
        params.pop("p", None)  # the page number: the bulk action takes every page
        url = reverse(f"admin:{opts.app_label}_{opts.model_name}_bulk", args=[spec.slug])
        return f"{url}?{params.urlencode()}" if params else url

    def bulk_view(self, request: HttpRequest, slug: str) -> HttpResponse:
        model_admin: Any = self
        spec = next((s for s in self.bulk_actions if s.slug == slug), None)
        if spec is None:
            raise Http404
        if spec not in self._bulk_offered(request):
            raise PermissionDenied
        opts = model_admin.model._meta
        changelist = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
        back = f"{changelist}?{request.GET.urlencode()}" if request.GET else changelist
        try:
            # The changelist's own filtering (filters, search, company scope), from the
            # querystring the link carried; the form posts back to the same URL.
            changelist_instance = model_admin.get_changelist_instance(request)
        except IncorrectLookupParameters:
            model_admin.message_user(request, "That filter is not valid.", messages.ERROR)
            return HttpResponseRedirect(changelist)
        queryset = changelist_instance.queryset
        form = BulkReasonForm(request.POST if request.method == "POST" else None)
        form.fields["reason"].help_text = spec.reason_help
        if form.is_bound and form.is_valid():
            result = self._bulk_act(request, spec, queryset, form)
            if result is not None:
                return HttpResponseRedirect(back)
        as_of = _database_snapshot() if spec.unchanged_since else None
        matched = queryset.order_by()[: BULK_CAP + 1].count()
        preview = list(queryset[:BULK_PREVIEW])
        context = {
            **model_admin.admin_site.each_context(request),
            "title": spec.title,
            "opts": opts,
            "spec": spec,
            "filter_words": describe_filter(changelist_instance, request),
            "count": min(matched, BULK_CAP),
            "too_many": matched > BULK_CAP,
            "cap": BULK_CAP,
            "preview": [
                (row, spec.name(row), [render(row) for _, render in spec.columns])
                for row in preview
            ],
            "headers": [header for header, _ in spec.columns],
            "form": form,
            "back": back,
            "as_of": as_of,
        }
        return TemplateResponse(request, BULK_TEMPLATE, context)

    def _bulk_act(
        self, request: HttpRequest, spec: BulkAction, queryset: QuerySet[Any], form: Any
    ) -> BulkResult | None:
        """Act, leave the result message and return it; None when the filter matches more
        than BULK_CAP rows (nothing done; the page says so)."""
        if queryset.order_by()[: BULK_CAP + 1].count() > BULK_CAP:
            form.add_error(None, f"More than {BULK_CAP} rows match: narrow the filter first.")
            return None
        if spec.unchanged_since is not None:
            snapshot = form.cleaned_data.get("as_of") or ""
            if not _SNAPSHOT.fullmatch(snapshot):
                form.add_error(None, "The page is out of date: confirm again from this one.")
                return None
            # Acting pins each row as read now; this keeps out those that changed hands
            # since the page the board confirmed (their owners are not the ones it saw).
            queryset = _seen_by(queryset, spec.unchanged_since, snapshot)
        result = bulk_run(
            spec,
            actor=board_actor(request.user),
            queryset=queryset,
            reason=form.cleaned_data["reason"],
        )
        level = messages.WARNING if result.refused else messages.SUCCESS
        text = bulk_summary(spec, result, seen=form.cleaned_data.get("seen"))
        model_admin: Any = self
        model_admin.message_user(request, text, level)
        return result
