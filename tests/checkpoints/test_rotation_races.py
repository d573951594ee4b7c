"""Key rotation against checkpoint writes in flight: a write seals its parts before its
transaction, under the primary key of that moment. When `rotate_checkpoint_key --new-key`
changes the key meanwhile, no part may end up under the old key once the command reported
"0 part(s) remain under other keys" (the runbook then lets the operator remove that key)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection

import checkpoints.services.writer as writer_module
from checkpoints.crypto import key_file_path, keyring
from checkpoints.models import NativeRunnerCheckpoint
from checkpoints.selectors import checkpoint_load, runner_run_get
from paperclip.models import NativeRunFinalization
from tests.checkpoints.factories import coordinator, lease, owner_of
from tests.checkpoints.test_concurrency import _write
from tests.helpers import wait_for_lock_waiters

pytestmark = pytest.mark.django_db(transaction=True)


def _drop_all_but_the_primary() -> None:
    """What the runbook allows once the rotation reported 0 remaining: keep only the primary."""
    path = key_file_path()
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keys = [line for line in lines if not line.startswith("#")]
    comments = [line for line in lines if line.startswith("#")]
    path.write_text("\n".join([*comments, keys[0]]) + "\n")


def _all_readable(fin: NativeRunFinalization) -> dict[str, str]:
    binding = runner_run_get(run_id=fin.run_id, agent_id=fin.run.agent_id).binding
    return checkpoint_load(binding=binding)


def test_a_write_sealed_before_the_rotation_is_sealed_again_under_the_new_key(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    _write(fin, owner, {"header": "v1"})  # makes the key file (key A)
    out = StringIO()
    part_row = writer_module._part_row

    def sealed_then_rotated(*args: Any) -> Any:
        row = part_row(*args)  # under the primary of the moment (A)
        if not out.getvalue():
            call_command("rotate_checkpoint_key", "--new-key", stdout=out)
        return row

    monkeypatch.setattr(writer_module, "_part_row", sealed_then_rotated)
    _write(fin, owner, {"header": "v2"})
    assert "0 part(s) remain under other keys" in out.getvalue(), out.getvalue()
    _drop_all_but_the_primary()
    assert _all_readable(fin) == {"header": "v2"}


def test_the_rotations_last_count_waits_for_a_write_in_flight_and_rotates_it_too(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write checked the key (still A) and is held before its commit while the rotation
    makes B primary and runs its batches (which cannot see the write's new part): the last
    count waits for that commit, finds the part, and another pass re-encrypts it."""
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    _write(fin, owner, {"header": "v1"})
    held, release = threading.Event(), threading.Event()
    record = writer_module.activity_record

    def hold_before_commit(**kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("writer"):
            held.set()
            assert release.wait(timeout=30)
        return record(**kwargs)

    monkeypatch.setattr(writer_module, "activity_record", hold_before_commit)
    out = StringIO()

    def on_own_connection(call: Any) -> Any:
        try:
            return call()
        finally:
            connection.close()

    with (
        ThreadPoolExecutor(1, thread_name_prefix="writer") as writer,
        ThreadPoolExecutor(1, thread_name_prefix="rotation") as rotation,
    ):
        wrote = writer.submit(on_own_connection, lambda: _write(fin, owner, {"log": "new"}))
        assert held.wait(timeout=30)
        rotated = rotation.submit(
            on_own_connection,
            lambda: call_command("rotate_checkpoint_key", "--new-key", stdout=out),
        )
        waited = wait_for_lock_waiters(1, until=rotated.done)  # the last count, on the write
        release.set()
        wrote.result(timeout=30)
        rotated.result(timeout=30)
    assert waited, out.getvalue()
    assert "0 part(s) remain under other keys" in out.getvalue(), out.getvalue()
    primary = keyring().primary.key_id
    keys = set(NativeRunnerCheckpoint.objects.values_list("key_id", flat=True))
    assert keys == {primary}, out.getvalue()
    _drop_all_but_the_primary()
    assert _all_readable(fin) == {"header": "v1", "log": "new"}
