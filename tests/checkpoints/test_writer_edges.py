"""Checkpoint writes at their edges (docs/checkpoints.md): a run that reached a terminal
status takes none, whatever lease is presented; a write that changes nothing writes nothing;
`removed` is bounded as `changed` is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from django.db import transaction

from checkpoints.errors import CheckpointOwnerLost
from checkpoints.models import NativeRunnerCheckpoint
from checkpoints.services import CheckpointOwner, checkpoint_write
from paperclip.errors import InvalidRequest
from paperclip.locks import run_lock_with_issue
from paperclip.models import ActivityEvent, HeartbeatRun
from paperclip.services import run_finish_in_tx
from tests.checkpoints.factories import coordinator, lease, owner_of
from tests.paperclip.factories import NativeRunFactory, NativeRunResultFactory

pytestmark = pytest.mark.django_db


def write(
    run: Any,
    owner: CheckpointOwner,
    changed: Mapping[str, str],
    removed: Sequence[str] = (),
    reset: bool = False,
) -> Any:
    return checkpoint_write(
        run_id=run.pk,
        agent_id=run.agent_id,
        owner=owner,
        reset=reset,
        changed=changed,
        removed=list(removed),
        work_command_ids=[],
        predecessor=None,
    )


@pytest.mark.parametrize("status", ["succeeded", "failed"])
def test_a_finished_run_with_an_accepted_result_takes_no_write(status: str) -> None:
    """Its owner outlives the lease's end as a tolerated one once a result was accepted: a
    reset after the run succeeded wiped its checkpoint and answered 200."""
    fin = coordinator()
    owner = owner_of(lease(fin.run, ttl_seconds=600))
    write(fin.run, owner, {"header": "h", "log": "l"})
    fin.result = NativeRunResultFactory(run=fin.run)
    fin.save(update_fields=["result"])
    with transaction.atomic():
        locked = run_lock_with_issue(run_id=fin.run_id)
        run_finish_in_tx(run=locked.run, to_status=status, actor_type="system", actor_id="t")
    with pytest.raises(CheckpointOwnerLost) as refused:
        write(fin.run, owner, {"late": "after the end"}, reset=True)
    assert refused.value.details["reason"] == "run_terminal"
    stored = NativeRunnerCheckpoint.objects.filter(run_id=fin.run_id)
    assert sorted(stored.values_list("part", flat=True)) == ["header", "log"]


def test_a_finished_run_takes_no_write_through_a_live_authority() -> None:
    """The authority run is the client's to name: a live run's lease wrote the checkpoint
    of a run of the same issue that had already failed."""
    authority = coordinator()
    attached = NativeRunFactory(
        company=authority.company, issue=authority.issue, agent=authority.run.agent
    )
    HeartbeatRun.objects.filter(pk=attached.pk).update(status="failed")
    owner = owner_of(lease(authority.run), authority_run_id=authority.run_id)
    with pytest.raises(CheckpointOwnerLost):
        write(attached, owner, {"late": "x"})
    assert not NativeRunnerCheckpoint.objects.filter(run_id=attached.pk).exists()


def test_a_write_that_changes_nothing_writes_nothing() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    write(fin.run, owner, {"a": "1"})
    audits = ActivityEvent.objects.filter(action="checkpoint.written").count()
    stamp = NativeRunnerCheckpoint.objects.get(run_id=fin.run_id).updated_at
    assert write(fin.run, owner, {}).parts == 1
    assert ActivityEvent.objects.filter(action="checkpoint.written").count() == audits
    assert NativeRunnerCheckpoint.objects.get(run_id=fin.run_id).updated_at == stamp


@pytest.mark.parametrize("reset", [False, True], ids=["removed", "reset"])
def test_removing_parts_already_gone_writes_nothing(reset: bool) -> None:
    """A removal repeated because its answer was lost (or a reset of nothing) changes
    nothing: no second audit row."""
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    write(fin.run, owner, {"header": "h", "log": "l"})
    write(fin.run, owner, {}, removed=["header", "log"])
    audits = ActivityEvent.objects.filter(action="checkpoint.written").count()
    again = write(fin.run, owner, {}, removed=[] if reset else ["log"], reset=reset)
    assert (again.parts, again.changed, again.removed) == (0, 0, 0)
    assert ActivityEvent.objects.filter(action="checkpoint.written").count() == audits


def test_removed_is_bounded_as_changed_is(settings: Any) -> None:
    """Deleted under the coordinator's lock: 300,000 names held it for 7 s."""
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    with pytest.raises(InvalidRequest) as refused:
        write(fin.run, owner, {}, removed=[f"p{i}" for i in range(20_000)])
    assert "removed" in refused.value.details["fields"]
