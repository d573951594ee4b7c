"""Changelists whose cost stays flat (paperclip.admin.lists): the capped count, the indexed
"all values" filter and the *when* filter that stands in for date_hierarchy."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from paperclip.admin.lists import LIST_COUNT_CAP, distinct_values
from paperclip.models import ActivityEvent, Company

EVENTS = reverse("admin:paperclip_activityevent_changelist")


def events(company: Company, count: int, **fields: object) -> None:
    defaults = {
        "actor_type": "system",
        "actor_id": "test",
        "action": "issue.updated",
        "entity_type": "issue",
        "entity_id": "x",
    }
    ActivityEvent.objects.bulk_create(
        ActivityEvent(company=company, **{**defaults, **fields}) for _ in range(count)
    )


@pytest.mark.django_db
def test_a_list_longer_than_the_cap_says_more_than_and_counts_no_further(
    company: Company, superuser_client: Client
) -> None:
    events(company, LIST_COUNT_CAP + 5)
    response = superuser_client.get(EVENTS)
    assert response.status_code == 200
    changelist = response.context["cl"]
    assert changelist.result_count == LIST_COUNT_CAP
    assert changelist.paginator.capped
    assert f"more than {LIST_COUNT_CAP} activity events" in response.content.decode()


@pytest.mark.django_db
def test_a_list_within_the_cap_counts_exactly(company: Company, superuser_client: Client) -> None:
    events(company, 7)
    response = superuser_client.get(EVENTS)
    assert response.context["cl"].result_count == 7
    assert not response.context["cl"].paginator.capped
    assert "7 activity events" in response.content.decode()


@pytest.mark.django_db
def test_the_action_filter_offers_each_distinct_value_once(
    company: Company, superuser_client: Client
) -> None:
    events(company, 3, action="b.second")
    events(company, 2, action="a.first")
    assert distinct_values(ActivityEvent, "action") == ["a.first", "b.second"]
    response = superuser_client.get(EVENTS, {"action": "b.second"})
    assert response.context["cl"].result_count == 3
    assert b"?action=a.first" in response.content


@pytest.mark.django_db
def test_a_nullable_column_offers_the_empty_choice_when_a_row_is_null(company: Company) -> None:
    assert distinct_values(ActivityEvent, "run_id") == []
    events(company, 1)
    assert distinct_values(ActivityEvent, "run_id") == [None]


@pytest.mark.django_db
def test_the_when_filter_keeps_only_rows_newer_than_its_bound(
    company: Company, superuser_client: Client
) -> None:
    events(company, 2)
    events(company, 3, created_at=timezone.now() - timedelta(days=3))
    for within, expected in (("24h", 2), ("7d", 5)):
        response = superuser_client.get(EVENTS, {"created_at_within": within})
        assert response.context["cl"].result_count == expected
