"""The lease keepers against the real API (in-process WSGI app, committed data: the keepers
renew from their own thread, which has its own database connection): background renewals,
release on exit, lost on a takeover, on an ended run and on renewals failing past the TTL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from django.core.wsgi import get_wsgi_application

from leases.models import WorkspaceRuntimeLease
from paperclip.models import NativeRunFinalization
from paperclip_client import Client, ControllerLeaseKeeper, LeaseLost, RuntimeLeaseKeeper
from paperclip_client.errors import WorkspaceRuntimeLeaseConflict
from tests.checkpoints.factories import expire_lease
from tests.clients.conftest import World
from tests.leases.factories import expire

pytestmark = pytest.mark.django_db(transaction=True)


class Switch(httpx.BaseTransport):
    """The app, until `down` is set: then every request fails to connect."""

    def __init__(self) -> None:
        self.app = httpx.WSGITransport(app=get_wsgi_application())
        self.down = False
        self.paths: list[str] = []  # of every request sent

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.down:
            raise httpx.ConnectError("down", request=request)
        return self.app.handle_request(request)


@pytest.fixture
def switch() -> Switch:
    return Switch()


@pytest.fixture
def api(world: World, switch: Switch) -> Iterator[Client]:
    with Client("http://testserver", world.key, transport=switch, retries=0) as c:
        yield c


def wait_until(condition: Callable[[], object], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def new_run(api: Client, world: World, tmp_path: Path) -> str:
    return api.run_create(
        issue_id=str(world.issue.pk),
        execution_workspace_id=str(world.workspace.pk),
        workspace_dir=str(tmp_path),
    ).id


class Lost:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


def test_renews_in_the_background_and_releases_on_exit(
    api: Client, world: World, tmp_path: Path
) -> None:
    run_id = new_run(api, world, tmp_path)
    ws = str(world.workspace.pk)
    with RuntimeLeaseKeeper(api, ws, run_id=run_id, ttl_seconds=60, renew_fraction=0.01) as lease:
        first = WorkspaceRuntimeLease.objects.get(execution_workspace_id=ws).renewed_at
        wait_until(lambda: lease.renewals >= 2, "two background renewals")
        row = WorkspaceRuntimeLease.objects.get(execution_workspace_id=ws)
        assert row.renewed_at > first
        assert row.generation == lease.generation
        assert not lease.lost
    assert not WorkspaceRuntimeLease.objects.filter(execution_workspace_id=ws).exists()


def test_a_takeover_makes_the_keeper_lost_and_it_writes_nothing_more(
    api: Client, world: World, tmp_path: Path
) -> None:
    ws = str(world.workspace.pk)
    mine, theirs = new_run(api, world, tmp_path), new_run(api, world, tmp_path)
    lost = Lost()
    keeper = RuntimeLeaseKeeper(api, ws, run_id=mine, ttl_seconds=60, on_lost=lost)
    with keeper:
        keeper.operation(phase="start", status="running")
        with pytest.raises(WorkspaceRuntimeLeaseConflict):
            api.runtime_lease_claim(ws, run_id=theirs)
        expire(world.workspace)
        taken = api.runtime_lease_claim(ws, run_id=theirs)
        assert taken.outcome in {"reclaimed", "created"}
        keeper.wake()
        assert lost.event.wait(timeout=20)
        assert "workspace_runtime_lease_conflict" in lost.reasons[0]
        with pytest.raises(LeaseLost):
            keeper.ensure_held()
        with pytest.raises(LeaseLost):
            keeper.operation(phase="late", status="running")
    assert lost.reasons == [lost.reasons[0]]  # called once
    row = WorkspaceRuntimeLease.objects.get(execution_workspace_id=ws)  # not released by us
    assert row.owner_key == f"run:{theirs}"


def test_a_waiting_keeper_takes_the_lease_once_the_holder_is_stale(
    api: Client, world: World, tmp_path: Path
) -> None:
    ws = str(world.workspace.pk)
    holder, waiter = new_run(api, world, tmp_path), new_run(api, world, tmp_path)
    api.runtime_lease_claim(ws, run_id=holder)
    seen: list[WorkspaceRuntimeLeaseConflict] = []

    def on_wait(conflict: WorkspaceRuntimeLeaseConflict) -> None:
        seen.append(conflict)
        expire(world.workspace)

    keeper = RuntimeLeaseKeeper(
        api, ws, run_id=waiter, wait=True, poll_seconds=0.01, on_wait=on_wait
    )
    with keeper:
        assert keeper.claim is not None
        assert keeper.claim.outcome == "reclaimed"
    assert seen[0].details["owner_key"] == f"run:{holder}"


def test_renewals_failing_until_the_deadline_make_the_keeper_lost(
    api: Client, switch: Switch, world: World, tmp_path: Path
) -> None:
    now = [1000.0]
    lost = Lost()
    keeper = RuntimeLeaseKeeper(
        api,
        str(world.workspace.pk),
        run_id=new_run(api, world, tmp_path),
        ttl_seconds=60,
        on_lost=lost,
        clock=lambda: now[0],
    )
    with keeper:
        switch.down = True
        keeper.ensure_held()  # one failed renew inside the TTL: still held
        assert not keeper.lost
        now[0] += 61
        with pytest.raises(LeaseLost, match="could not renew"):
            keeper.ensure_held()
    assert lost.event.is_set()


def test_the_controller_keeper_is_lost_when_its_run_ends(
    api: Client, world: World, tmp_path: Path
) -> None:
    run_id = new_run(api, world, tmp_path)
    api.run_update(run_id, status="running")
    lost = Lost()
    with ControllerLeaseKeeper(api, run_id, ttl_seconds=60, on_lost=lost) as controller:
        owner = controller.owner()
        assert api.checkpoint_write(run_id, owner=owner, changed={"p": "1"}) == 1
        controller.ensure_held()
        assert controller.owner() == owner  # a renew keeps the owner and generation
        api.run_update(run_id, status="failed")
        with pytest.raises(LeaseLost, match="controller_lease_run_terminal"):
            controller.ensure_held()
    assert lost.reasons


def test_a_lease_lost_passing_through_a_keeper_leaves_its_lease_unreleased(
    api: Client, world: World, tmp_path: Path
) -> None:
    run_id = new_run(api, world, tmp_path)
    ws = str(world.workspace.pk)
    with (
        pytest.raises(LeaseLost),
        RuntimeLeaseKeeper(api, ws, run_id=run_id, ttl_seconds=60),
    ):
        raise LeaseLost("the controller lease was refused")
    assert WorkspaceRuntimeLease.objects.get(execution_workspace_id=ws).owner_key == f"run:{run_id}"


def test_keepers_renewed_together_renew_both_leases_in_one_request(
    api: Client, world: World, tmp_path: Path, switch: Switch
) -> None:
    run_id = new_run(api, world, tmp_path)
    api.run_update(run_id, status="running")
    ws = str(world.workspace.pk)
    lost = Lost()
    with RuntimeLeaseKeeper(api, ws, run_id=run_id, ttl_seconds=600) as runtime:
        controller = ControllerLeaseKeeper(api, run_id, ttl_seconds=600, on_lost=lost)
        controller.renew_with(runtime)
        with controller:
            lease_before = WorkspaceRuntimeLease.objects.get(execution_workspace_id=ws)
            expiry_before = NativeRunFinalization.objects.get(pk=run_id).lease_expires_at
            switch.paths.clear()
            runtime.ensure_held()
            assert switch.paths == ["/api/leases/renew"]  # one request, both leases
            assert (runtime.renewals, controller.renewals) == (1, 1)
            lease_after = WorkspaceRuntimeLease.objects.get(execution_workspace_id=ws)
            assert lease_after.expires_at > lease_before.expires_at
            assert lease_after.generation == lease_before.generation
            assert NativeRunFinalization.objects.get(pk=run_id).lease_expires_at > expiry_before
            # A refused lease marks only its own keeper lost: the other is renewed all the same.
            expire_lease(run_id)
            switch.paths.clear()
            runtime.ensure_held()
            assert switch.paths == ["/api/leases/renew"]
            assert controller.lost
            assert "controller_lease_held" in (controller.lost_reason or "")
            assert not runtime.lost
            assert runtime.renewals == 2
            with pytest.raises(LeaseLost):
                controller.ensure_held()
            # Once its partner is lost, a keeper renews alone, on its own endpoint.
            switch.paths.clear()
            runtime.ensure_held()
            assert switch.paths == [f"/api/execution-workspaces/{ws}/runtime-lease/claim"]
    assert lost.reasons


def test_a_write_soon_after_a_renew_does_not_renew_again(
    api: Client, switch: Switch, world: World, tmp_path: Path
) -> None:
    now = [1000.0]
    ws = str(world.workspace.pk)
    run_id = new_run(api, world, tmp_path)
    keeper = RuntimeLeaseKeeper(api, ws, run_id=run_id, ttl_seconds=60, clock=lambda: now[0])
    with keeper:
        switch.paths.clear()
        now[0] += 1.9
        keeper.ensure_held(recent=2.0)  # the claim, sent 1.9 s ago, vouches for the lease
        keeper.operation(phase="start", status="running", recent=2.0)
        assert switch.paths == [f"/api/execution-workspaces/{ws}/operations"]
        now[0] += 0.2  # 2.1 s since the claim: renewed first
        switch.paths.clear()
        keeper.ensure_held(recent=2.0)
        keeper.ensure_held(recent=2.0)  # ...and that renew vouches for the next
        assert switch.paths == [f"/api/execution-workspaces/{ws}/runtime-lease/claim"]
        # At most a tenth of the TTL: with 60 s, `recent` beyond 6 s is 6 s.
        now[0] += 6.5
        switch.paths.clear()
        keeper.ensure_held(recent=600.0)
        assert len(switch.paths) == 1
        # Without `recent`, a renew every time (as before).
        switch.paths.clear()
        keeper.ensure_held()
        assert len(switch.paths) == 1


def test_a_lease_lost_within_the_recent_window_is_refused_by_the_write_itself(
    api: Client, switch: Switch, world: World, tmp_path: Path
) -> None:
    """The window skips a renew, never the server's fence: a lease taken over a moment after
    the keeper's renew refuses the fenced write, and the keeper is lost, writing nothing."""
    ws = str(world.workspace.pk)
    mine, theirs = new_run(api, world, tmp_path), new_run(api, world, tmp_path)
    lost = Lost()
    with RuntimeLeaseKeeper(api, ws, run_id=mine, ttl_seconds=600, on_lost=lost) as keeper:
        expire(world.workspace)
        assert api.runtime_lease_claim(ws, run_id=theirs).outcome == "reclaimed"
        switch.paths.clear()
        with pytest.raises(LeaseLost, match="workspace_runtime_lease_superseded"):
            keeper.operation(phase="start", status="running", recent=60.0)
        assert switch.paths == [f"/api/execution-workspaces/{ws}/operations"]  # no renew first
        assert keeper.lost
        assert lost.reasons
    row = WorkspaceRuntimeLease.objects.get(execution_workspace_id=ws)
    assert row.owner_key == f"run:{theirs}"
