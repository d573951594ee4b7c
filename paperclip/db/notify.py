"""Wake-ups through PostgreSQL's LISTEN / NOTIFY on Django's own connection.

A request that waits for the worker (`?wait=` on a finalization) used to poll with a growing
interval, and so answered up to that interval after the worker's commit. The worker now
notifies a channel when such a job ends (`notify`, payload: what ended), and the waiter
sleeps in `listening(...)`'s `wait`, which returns as soon as that payload arrives. A
notification is only a hint: the waiter always reads the state again, and keeps polling at
its own interval, so a lost or never-sent one (the worker killed, a commit made elsewhere)
costs latency, never correctness.

Inside a transaction (an atomic block: a test's, the admin's) no notification can arrive
before it ends, so `wait` there is a plain sleep.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Final

import psycopg
from django.db import DatabaseError, connection

FINALIZATION_CHANNEL: Final = "paperclip_finalization_ended"
_CHANNEL: Final = re.compile(r"[a-z_]{1,63}")

type Wait = Callable[[float, str], bool]  # (timeout seconds, payload) -> notified


def notify(channel: str, payload: str) -> None:
    """Notify `channel` with `payload` (delivered when the current transaction commits; at
    once in autocommit). Best effort: a failure only costs the waiters latency."""
    with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, %s)", [channel, payload])


def _sleep(timeout: float, payload: str) -> bool:
    del payload
    time.sleep(timeout)
    return False


@contextlib.contextmanager
def listening(channel: str) -> Iterator[Wait]:
    """LISTEN on `channel` for the duration of the block (UNLISTEN after, and what arrived
    meanwhile dropped: the connection may serve other requests later). Yields `wait(timeout,
    payload)`: True as soon as a notification with `payload` arrives, False after `timeout`
    seconds without one."""
    if connection.in_atomic_block:
        yield _sleep
        return
    if not _CHANNEL.fullmatch(channel):  # an identifier of ours, never a caller's text
        raise ValueError(f"not a channel name: {channel!r}")
    with connection.cursor() as cursor:
        cursor.execute(f"LISTEN {channel}")
    raw = connection.connection
    assert isinstance(raw, psycopg.Connection)  # noqa: S101 - the psycopg backend

    def wait(timeout: float, payload: str) -> bool:
        return any(
            n.channel == channel and n.payload == payload
            for n in raw.notifies(timeout=max(0.0, timeout))
        )

    try:
        yield wait
    finally:
        with contextlib.suppress(DatabaseError, psycopg.Error):
            with connection.cursor() as cursor:
                cursor.execute(f"UNLISTEN {channel}")
            for _ in raw.notifies(timeout=0):
                pass
