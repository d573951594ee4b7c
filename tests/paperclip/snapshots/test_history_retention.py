"""Collection keeps the trees of the history's recent moves (docs/snapshots.md#retention): a
move within PAPERCLIP_WORKSPACE_HISTORY_DAYS keeps both its trees; an older one keeps its row,
and its trees go once nothing else reaches them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from paperclip.models import Company
from paperclip.snapshots.collect import cas_collect
from paperclip.snapshots.models import WorkspaceHeadMove
from tests.paperclip.factories import ExecutionWorkspaceFactory
from tests.paperclip.snapshots.helpers import NOTHING, kept
from tests.paperclip.snapshots.test_collect import age, tree_of

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("backend")]


def _moved(company: Company, tree: str, previous: str | None, days_ago: int) -> None:
    workspace = ExecutionWorkspaceFactory(company=company)
    WorkspaceHeadMove.objects.create(
        company=company,
        workspace=workspace,
        seq=1,
        tree=tree,
        previous_tree=previous,
        kind="publish",
        actor_type="system",
        actor_id="test",
        at=timezone.now() - timedelta(days=days_ago),
    )


@pytest.mark.parametrize("days_ago", [1, 89])
def test_a_recent_moves_trees_are_kept(company: Company, days_ago: int) -> None:
    tree, reached = tree_of(company.pk, {"a.txt": b"A", "src/b.py": b"B"})
    before, earlier = tree_of(company.pk, {"a.txt": b"A0"})
    _moved(company, tree, before, days_ago)
    age(*reached, *earlier)
    assert cas_collect(batch_size=10).deleted == 0
    assert all(kept(company.pk, name)["row"] for name in reached + earlier)


def test_an_old_moves_trees_go_and_its_row_stays(company: Company, settings: Any) -> None:
    settings.PAPERCLIP_WORKSPACE_HISTORY_DAYS = 30
    tree, reached = tree_of(company.pk, {"a.txt": b"A", "src/b.py": b"B"})
    _moved(company, tree, None, 31)
    age(*reached)
    assert cas_collect(batch_size=10).deleted == len(reached)
    assert all(kept(company.pk, name) == NOTHING for name in reached)
    assert WorkspaceHeadMove.objects.filter(tree=tree).exists()
