"""A restore submitted twice at once (a double click on the console's Restore, a client's
retry while the first attempt is still in flight): the second waits for the first's row lock
and then answers the first's move (200 through the API, "Restored" in the console), not "the
head moved meanwhile, nothing changed", and writes nothing of its own. The race is forced:
the first is held inside its transaction after its update of the head until the second is
seen waiting for the row lock."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from django.urls import reverse

from paperclip.models import ActivityEvent, ExecutionWorkspace
from paperclip.snapshots import restore as restore_module
from paperclip.snapshots.models import WorkspaceHeadMove
from tests.console.test_pages import staff
from tests.console.test_workspace_history import NOTE, _history
from tests.helpers import assert_error, wait_for_lock_waiters
from tests.paperclip.factories import CompanyFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _race(monkeypatch: pytest.MonkeyPatch, call: Callable[[], Any]) -> tuple[Any, Any]:
    """`call` twice: the first held after its update of the head (at its audit row) until
    the second waits for the workspace row; each on its own connection."""
    moved, release = threading.Event(), threading.Event()
    original = restore_module.activity_record

    def held(**kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("first"):
            moved.set()
            assert release.wait(timeout=30)
        return original(**kwargs)

    monkeypatch.setattr(restore_module, "activity_record", held)

    def on_own_connection() -> Any:
        try:
            return call()
        finally:
            connection.close()

    with (
        ThreadPoolExecutor(1, thread_name_prefix="first") as one,
        ThreadPoolExecutor(1, thread_name_prefix="second") as two,
    ):
        first = one.submit(on_own_connection)
        assert moved.wait(timeout=30)
        second = two.submit(on_own_connection)
        assert wait_for_lock_waiters(1, until=second.done)  # queued behind the first's lock
        release.set()
        return first.result(timeout=30), second.result(timeout=30)


def test_the_api_restore_sent_twice_at_once_answers_its_move_both_times(
    monkeypatch: pytest.MonkeyPatch, make_board_client: Any
) -> None:
    company = CompanyFactory()
    workspace, trees = _history(company)
    board = make_board_client(company)
    url = f"/api/execution-workspaces/{workspace.pk}/restore"
    body = {"tree": trees[0], "expected_head": trees[1], "note": NOTE}
    audits = ActivityEvent.objects.count()
    a, b = _race(monkeypatch, lambda: board.post(url, body, format="json"))
    assert a.status_code == 200, a.content
    assert (b.status_code, b.json()) == (200, a.json())
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[0]
    assert WorkspaceHeadMove.objects.filter(workspace_id=workspace.pk).count() == 3
    assert ActivityEvent.objects.count() == audits + 1  # the first's, none of the second's


def test_the_console_restore_submitted_twice_reports_what_happened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    company = CompanyFactory()
    workspace, trees = _history(company)
    first_client = staff(company)
    second_client = Client()  # the same operator, its own cookies (a second tab, a retry)
    user = get_user_model().objects.get(pk=first_client.session["_auth_user_id"])
    second_client.force_login(user)
    clients = iter([first_client, second_client])
    url = reverse("admin:paperclip_executionworkspace_move_restore", args=[workspace.pk, 1])
    form = {"note": NOTE, "expected_head": trees[1]}
    first_page, second_page = (
        page.content.decode()
        for page in _race(monkeypatch, lambda: next(clients).post(url, form, follow=True))
    )
    assert ExecutionWorkspace.objects.get(pk=workspace.pk).head_tree == trees[0]
    assert WorkspaceHeadMove.objects.filter(workspace_id=workspace.pk).count() == 3
    assert "Restored: the head is now" in first_page
    assert "Nothing changed" not in second_page
    assert f"Restored: the head is now {trees[0]} (move 3" in second_page


def test_another_members_identical_restore_is_not_answered_as_its_own(
    monkeypatch: pytest.MonkeyPatch, make_board_client: Any
) -> None:
    """Two board members restoring the same version with the same note at once: the second
    is told the head moved (409), not handed the first's move as if it were its own; and so
    is the same request repeated later by another member."""
    company = CompanyFactory()
    workspace, trees = _history(company)
    alice, bob = make_board_client(company), make_board_client(company)
    clients = iter([alice, bob])
    url = f"/api/execution-workspaces/{workspace.pk}/restore"
    body = {"tree": trees[0], "expected_head": trees[1], "note": NOTE}
    a, b = _race(monkeypatch, lambda: next(clients).post(url, body, format="json"))
    assert a.status_code == 200, a.content
    assert_error(b, 409, "workspace_head_moved")
    assert_error(bob.post(url, body, format="json"), 409, "workspace_head_moved")
    assert alice.post(url, body, format="json").json() == a.json()  # hers, repeated
    assert WorkspaceHeadMove.objects.filter(workspace_id=workspace.pk).count() == 3
