"""LISTEN / NOTIFY wake-ups (paperclip/db/notify.py): a waiter on Django's connection wakes
as soon as another session notifies its payload, not at its next poll; the worker's
finalization job notifies when it ends; and `finalization_await` (`?wait=`) answers at once
on that notification even with a poll interval far longer than the test."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from django.db import connection, transaction

from paperclip.db.notify import FINALIZATION_CHANNEL, listening, notify
from recovery import tasks
from recovery.selectors import finalization as selector
from tests.helpers import raw_connection

pytestmark = pytest.mark.django_db(transaction=True)


def _notify_later(payload: str, delay: float = 0.3) -> threading.Thread:
    def send() -> None:
        time.sleep(delay)
        with raw_connection() as other:
            other.execute("SELECT pg_notify(%s, 'someone else')", [FINALIZATION_CHANNEL])
            other.execute("SELECT pg_notify(%s, %s)", [FINALIZATION_CHANNEL, payload])

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def _listening_channels() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_listening_channels()")
        return [row[0] for row in cursor.fetchall()]


def test_a_waiter_wakes_on_its_payload_and_stops_listening_after() -> None:
    with listening(FINALIZATION_CHANNEL) as wait:
        sender = _notify_later("mine")
        started = time.monotonic()
        assert wait(20.0, "mine") is True
        woke = time.monotonic() - started
        sender.join()
        assert 0.2 < woke < 5, woke  # the notification, not the 20 s timeout
        assert wait(0.2, "mine") is False  # nothing more came
    assert _listening_channels() == []


def test_other_payloads_do_not_wake_a_waiter() -> None:
    with listening(FINALIZATION_CHANNEL) as wait:
        sender = _notify_later("not mine", delay=0.05)
        started = time.monotonic()
        assert wait(0.8, "mine") is False
        assert time.monotonic() - started >= 0.75
        sender.join()


def test_inside_a_transaction_the_wait_is_a_sleep_and_nothing_is_listened_to() -> None:
    with transaction.atomic(), listening(FINALIZATION_CHANNEL) as wait:
        assert wait(0.05, "mine") is False
        assert _listening_channels() == []


def test_a_channel_name_is_never_a_callers_text() -> None:
    with pytest.raises(ValueError, match="not a channel name"), listening("x; DROP TABLE y"):
        pass


def test_the_finalization_job_notifies_when_it_ends_whatever_the_outcome() -> None:
    run_id = str(uuid.uuid4())  # no such run: the attempt ends at once, unfinalizable
    with raw_connection() as listener:
        listener.execute(f"LISTEN {FINALIZATION_CHANNEL}")
        answer = tasks.finalize_run(str(uuid.uuid4()), run_id)
        assert answer.startswith("not finalizable"), answer
        payloads = [n.payload for n in listener.notifies(timeout=2, stop_after=1)]
    assert payloads == [run_id]


def test_finalization_await_answers_on_the_notification_not_its_next_poll(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The state's own rules are tested elsewhere (tests/recovery): here it is "running"
    until the other session commits, and the poll interval is far longer than the test."""
    committed = threading.Event()

    def state(_run: Any) -> selector.FinalizationState:
        name = "committed" if committed.is_set() else "running"
        return selector.FinalizationState(name, None, 1, None, None, None)

    class Run:
        objects = type("M", (), {"get": staticmethod(lambda **kw: object())})

    monkeypatch.setattr(selector, "finalization_state", state)
    monkeypatch.setattr(selector, "HeartbeatRun", Run)
    monkeypatch.setattr(selector, "job_status", lambda job_id: "doing")
    monkeypatch.setattr(selector, "AWAIT_POLL_FIRST", 30.0)
    run_id = uuid.uuid4()

    def commit_then_notify() -> None:
        time.sleep(0.3)
        committed.set()
        with raw_connection() as other:
            other.execute("SELECT pg_notify(%s, %s)", [FINALIZATION_CHANNEL, str(run_id)])

    thread = threading.Thread(target=commit_then_notify)
    thread.start()
    started = time.monotonic()
    current = selector.finalization_await(
        company_id=uuid.uuid4(), run_id=run_id, job_id=1, timeout=30
    )
    thread.join()
    assert current.state == "committed"
    assert time.monotonic() - started < 5


def test_notify_in_a_transaction_is_sent_at_its_commit() -> None:
    with raw_connection() as listener:
        listener.execute(f"LISTEN {FINALIZATION_CHANNEL}")
        with transaction.atomic():
            notify(FINALIZATION_CHANNEL, "at commit")
            assert list(listener.notifies(timeout=0.2)) == []
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == ["at commit"]
