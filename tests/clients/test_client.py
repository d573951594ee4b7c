"""The client against the real API (in-process WSGI app, real PostgreSQL): typed answers, one
exception class per error code with details and remediation, fenced writes, results and
finalization, and the session-directory checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from django.core.wsgi import get_wsgi_application

from paperclip.models import Agent
from paperclip_client import Client, ServerUnreachable, errors, restore
from paperclip_client.session import CheckpointError, SessionCheckpointer
from tests.clients.conftest import World
from tests.leases.environment.factories import pending_cleanup_lease
from tests.leases.factories import expire

pytestmark = pytest.mark.django_db


def native_run(client: Client, world: World, workdir: Path) -> str:
    if workdir == world.dest.parent:  # never a directory holding a workspace's cwd
        workdir = workdir / "run"
    run = client.run_create(
        issue_id=str(world.issue.pk),
        execution_workspace_id=str(world.workspace.pk),
        workspace_dir=str(workdir),
    )
    assert run.status == "queued"
    assert run.runtime_mode == "native"
    return run.id


def test_me_and_reads_are_typed(client: Client, world: World) -> None:
    me = client.me()
    assert me.actor_type == "agent"
    assert me.agent_id == str(world.agent.pk)
    assert me.company_ids == [str(world.agent.company_id)]
    issue = client.issue_get(str(world.issue.pk))
    assert issue.status == "in_progress"
    assert issue.hidden_at is None
    workspace = client.execution_workspace_get(str(world.workspace.pk))
    assert workspace.cwd == str(world.dest)


def test_run_lifecycle_and_fenced_operation(client: Client, world: World, tmp_path: Path) -> None:
    ws = str(world.workspace.pk)
    run_id = native_run(client, world, tmp_path)
    claim = client.runtime_lease_claim(ws, run_id=run_id, ttl_seconds=60)
    assert claim.outcome == "created"
    assert claim.owner_key == f"run:{run_id}"
    assert claim.lease is not None
    generation = claim.lease.generation
    renewed = client.runtime_lease_claim(ws, run_id=run_id, ttl_seconds=60)
    assert (renewed.outcome, renewed.lease and renewed.lease.generation) == ("renewed", generation)
    assert client.run_update(run_id, status="running").status == "running"
    op = client.workspace_operation_create(
        ws, generation=generation, phase="start", status="running", run_id=run_id, command="x"
    )
    assert (op.lease_generation, op.phase, op.heartbeat_run_id) == (generation, "start", run_id)
    with pytest.raises(errors.WorkspaceRuntimeLeaseSuperseded) as superseded:
        client.workspace_operation_create(
            ws, generation=generation + 1, phase="x", status="running", run_id=run_id
        )
    assert superseded.value.status == 409
    assert superseded.value.details["current_generation"] == generation
    state = client.runtime_lease_get(ws)
    assert state.lease is not None
    assert state.lease.owner_run_id == run_id
    assert client.runtime_lease_release(ws, run_id=run_id).released is True
    assert client.runtime_lease_get(ws).lease is None


def test_a_conflict_carries_details_and_remediation(
    client: Client, world: World, tmp_path: Path
) -> None:
    ws = str(world.workspace.pk)
    first = native_run(client, world, tmp_path)
    second = native_run(client, world, tmp_path)
    client.runtime_lease_claim(ws, run_id=first)
    with pytest.raises(errors.WorkspaceRuntimeLeaseConflict) as conflict:
        client.runtime_lease_claim(ws, run_id=second)
    exc = conflict.value
    assert isinstance(exc, errors.ConflictError)
    assert exc.code == "workspace_runtime_lease_conflict"
    assert exc.details["owner_key"] == f"run:{first}"
    assert exc.remediation
    expire(world.workspace)
    reclaim = client.runtime_lease_claim(ws, run_id=second)
    assert reclaim.outcome == "reclaimed"
    assert reclaim.reclaimed_from is not None
    assert reclaim.reclaimed_from.reason == "lease_expired"


def test_error_kinds_for_unknown_objects_and_bad_input(client: Client, world: World) -> None:
    with pytest.raises(errors.NotFound):
        client.run_get("00000000-0000-4000-8000-000000000000")
    with pytest.raises(errors.InvalidRequest) as invalid:
        client.runtime_lease_claim(str(world.workspace.pk), ttl_seconds=5)
    assert "ttl_seconds" in invalid.value.fields
    run = client.run_create(issue_id=str(world.issue.pk))
    with pytest.raises(errors.InvalidRunTransition):
        client.run_update(run.id, status="succeeded")


def test_result_is_idempotent_and_finalization_reports_its_state(
    client: Client, world: World, tmp_path: Path
) -> None:
    run_id = native_run(client, world, tmp_path)
    with pytest.raises(errors.FinalizationNotReady):
        client.finalize(run_id)
    client.run_update(run_id, status="running")
    first = client.result_post(
        run_id, result={"summary": "ok"}, run_terminal_state="succeeded", caller_result_id="r1"
    )
    again = client.result_post(
        run_id, result={"summary": "ok"}, run_terminal_state="succeeded", caller_result_id="r1"
    )
    assert first.id == again.id
    assert first.schema_status == "accepted"
    with pytest.raises(errors.NativeResultConflict):
        client.result_post(run_id, result={"summary": "other"}, run_terminal_state="failed")
    answer = client.finalize(run_id)
    assert answer.status == "queued"
    assert not answer.committed


def controller_owner(client: Client, run_id: str) -> dict[str, object]:
    lease = client.controller_lease_acquire(run_id, boot_id="b" * 8, ttl_seconds=60)
    assert lease.outcome == "acquired"
    renewed = client.controller_lease_acquire(
        run_id, boot_id="b" * 8, lease_owner=lease.lease_owner, ttl_seconds=60
    )
    assert (renewed.outcome, renewed.generation) == ("renewed", lease.generation)
    return {"boot_id": "b" * 8, "lease_owner": lease.lease_owner, "generation": lease.generation}


def snapshot(root: Path) -> dict[str, tuple[bytes, int] | None]:
    """Every file (bytes, mode) and every directory (None) under `root`."""
    found: dict[str, tuple[bytes, int] | None] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        found[rel] = None if path.is_dir() else (path.read_bytes(), path.stat().st_mode & 0o777)
    return found


def test_session_checkpoint_round_trip_saves_only_what_changed(
    client: Client, world: World, tmp_path: Path
) -> None:
    run_id = native_run(client, world, tmp_path / "work")
    owner = controller_owner(client, run_id)
    session = tmp_path / "session"
    (session / "a" / "b").mkdir(parents=True)
    (session / "empty-dir" / "deeper").mkdir(parents=True)
    (session / "a" / "b" / "bin.dat").write_bytes(bytes(range(256)) * 3 + b"\x00")
    (session / "empty.txt").write_bytes(b"")
    (session / "ünïcode name.txt").write_text("héllo\n")
    (session / "run.sh").write_text("#!/bin/sh\n")
    (session / "run.sh").chmod(0o700)
    (session / "big.bin").write_bytes(os.urandom(10_000))  # 4 chunks of at most 3 KiB
    (tmp_path / "elsewhere").mkdir()
    (session / "link-to-dir").symlink_to(tmp_path / "elsewhere")
    (session / "link-to-file").symlink_to(session / "empty.txt")

    # small limits: 4 KiB parts, 6 KiB writes, so files span parts and saves span writes
    saver = SessionCheckpointer(
        client, run_id, session, owner=lambda: owner, max_part_bytes=4096, max_write_bytes=6144
    )
    first = saver.save()
    assert first.changed_files == 5
    assert first.writes > 1
    stored = {p.part for p in client.checkpoint_parts(run_id)}
    assert "header" in stored

    unchanged = saver.save()
    assert (unchanged.changed_files, unchanged.parts_written, unchanged.parts_removed) == (0, 0, 0)

    (session / "empty.txt").write_bytes(b"now not empty")
    (session / "big.bin").unlink()
    changed = saver.save()
    assert (changed.changed_files, changed.removed_files) == (1, 1)
    assert changed.parts_written == 1  # only the changed file's chunk
    assert changed.parts_removed == 4  # only the removed file's chunks
    assert changed.writes == 1

    restored = tmp_path / "restored"
    header = restore(client, run_id, restored)
    assert header["recoveryEvidence"]["normalizedSessionId"] == saver.session_id
    (session / "link-to-dir").unlink()  # links are not saved
    (session / "link-to-file").unlink()
    assert snapshot(restored) == snapshot(session)
    # the session id the header records is what the server's restore check compares
    parts = client.checkpoint_read(run_id, normalized_session_id=saver.session_id)
    assert parts.keys() == {p.part for p in client.checkpoint_parts(run_id)}
    header_text = client.checkpoint_header(run_id)
    assert header_text is not None
    assert saver.session_id in header_text


def test_restore_refuses_a_non_empty_directory_and_a_run_without_checkpoint(
    client: Client, world: World, tmp_path: Path
) -> None:
    run_id = native_run(client, world, tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        restore(client, run_id, tmp_path / "full")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        restore(client, run_id, tmp_path / "fresh")


def test_a_stale_controller_owner_cannot_write(
    client: Client, world: World, tmp_path: Path
) -> None:
    run_id = native_run(client, world, tmp_path)
    owner = controller_owner(client, run_id)
    stale = {**owner, "generation": int(str(owner["generation"])) + 1}
    with pytest.raises(errors.NativeRunnerCheckpointOwnerLost):
        client.checkpoint_write(run_id, owner=stale, changed={"p": "x"})
    assert client.checkpoint_write(run_id, owner=owner, changed={"p": "x"}) == 1
    assert client.controller_lease_expire(
        run_id, boot_id="b" * 8, lease_owner=str(owner["lease_owner"])
    )
    with pytest.raises(errors.NativeRunnerCheckpointOwnerLost):
        client.checkpoint_write(run_id, owner=owner, changed={"p": "y"})


def test_recovery_actions_read(client: Client, world: World) -> None:
    assert client.recovery_actions(str(world.issue.pk)) == []


def test_environment_cleanup_claim_and_receipt(client: Client, world: World) -> None:
    Agent.objects.filter(pk=world.agent.pk).update(role=Agent.Role.PROVIDER)
    lease = pending_cleanup_lease(world.agent.company)
    claim = client.cleanup_claim(str(lease.pk))
    assert claim.stop_only is True
    assert claim.lease.id == str(lease.pk)
    assert claim.lease.status == "pending_cleanup"
    with pytest.raises(errors.CleanupInFlight):
        client.cleanup_claim(str(lease.pk))
    settled = client.cleanup_receipt(
        str(lease.pk),
        attempt_id=claim.attempt_id,
        provider_lease_id=str(lease.provider_lease_id),
        state="stopped",
    )
    assert (settled.status, settled.cleanup_status) == ("released", "success")
    with pytest.raises(errors.CleanupAttemptStale):
        client.cleanup_receipt(
            str(lease.pk),
            attempt_id=claim.attempt_id,
            provider_lease_id=str(lease.provider_lease_id),
            state="stopped",
        )


class FailingPut(httpx.BaseTransport):
    """The app, except that checkpoint writes number `fail_at` (1-based) never get through."""

    def __init__(self, *fail_at: int) -> None:
        self.app = httpx.WSGITransport(app=get_wsgi_application())
        self.fail_at = set(fail_at)
        self.puts = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PUT":
            self.puts += 1
            if self.puts in self.fail_at:
                raise httpx.ConnectError("refused", request=request)
        return self.app.handle_request(request)


def test_a_save_that_fails_half_way_is_completed_by_the_next(
    client: Client, world: World, tmp_path: Path
) -> None:
    run_id = native_run(client, world, tmp_path / "work")
    owner = controller_owner(client, run_id)
    session = tmp_path / "session"
    session.mkdir()
    for i in range(6):
        (session / f"f{i}").write_bytes(os.urandom(3000))
    with Client("http://testserver", world.key, transport=FailingPut(2), retries=0) as flaky:
        saver = SessionCheckpointer(
            flaky, run_id, session, owner=lambda: owner, max_part_bytes=4096, max_write_bytes=6144
        )
        with pytest.raises(ServerUnreachable):
            saver.save()  # the first write (with reset) got through, the second did not
        assert client.checkpoint_header(run_id) is None  # no header yet: nothing to restore
        saver.save()
    header = restore(client, run_id, tmp_path / "restored")
    assert len(header["files"]) == 6
    assert snapshot(tmp_path / "restored") == snapshot(session)
