"""The takeover rule of finalization ownership as plain functions (recovery/takeover.py): no
database, no processes. Where a recorded owner ran is decided by host name and kernel boot id;
every combination of what a receipt can say and what the three probes can answer is ruled on,
and the safety properties hold for each; each probe is called only when the rule reaches it,
at most once."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from paperclip.receipts import OwnerReceipt
from recovery.adapters.identity import ControllerIdentity, TakeoverDecision
from recovery.takeover import HostMatch, RecordedOwner, Ruling, owner_host, takeover_ruling

DEAD = TakeoverDecision(True, "controller_process_dead")
RECYCLED = TakeoverDecision(True, "controller_pid_recycled")
ALIVE = TakeoverDecision(False, "controller_still_alive")


def _owners() -> Iterator[RecordedOwner]:
    for readable, same_host, same_process, live_here, joined_here in itertools.product(
        [False, True], repeat=5
    ):
        # A receipt that does not parse names no process; this process is on this host.
        if not readable and (same_host or same_process or live_here or joined_here):
            continue
        if same_process and not same_host:
            continue
        yield RecordedOwner(readable, same_host, same_process, live_here, joined_here)


CASES = [
    (owner, proof, process, barrier)
    for owner in _owners()
    for proof in (False, True)
    for process in (DEAD, RECYCLED, ALIVE)
    for barrier in (False, True)
]


def rule(
    owner: RecordedOwner, proof: bool, process: TakeoverDecision, barrier: bool
) -> tuple[Ruling, Counter[str]]:
    calls: Counter[str] = Counter()

    def probe[T](name: str, value: T) -> T:
        calls[name] += 1
        return value

    ruling = takeover_ruling(
        owner,
        stop_proof=lambda: probe("stop_proof", proof),
        process=lambda: probe("process", process),
        copyback_barrier=lambda: probe("copyback_barrier", barrier),
    )
    return ruling, calls


@pytest.mark.parametrize(("owner", "proof", "process", "barrier"), CASES)
def test_the_ruling_keeps_every_safety_property(
    owner: RecordedOwner, proof: bool, process: TakeoverDecision, barrier: bool
) -> None:
    ruling, calls = rule(owner, proof, process, barrier)
    assert max(calls.values(), default=0) <= 1  # each probe at most once

    # Our own action still running here is never taken over, whatever else is true.
    assert (ruling.verdict == "own_action_live") == (owner.same_process and owner.live_here)
    if ruling.verdict != "take_over":
        assert ruling.basis is None
        return
    # A takeover always names one of the three bases, and its evidence was seen.
    if ruling.basis == "platform_stop_proof":
        assert owner.readable
        assert calls["stop_proof"] == 1
        assert proof
    elif ruling.basis == "same_boot_joined":
        assert owner.same_process
        assert owner.joined_here
        assert not owner.live_here
        assert calls["process"] == 0  # no OS check needed for our own finished action
    else:
        # Same host only, never on the clock: a dead or recycled process and the barrier.
        assert owner.readable
        assert owner.same_host
        assert process.allowed
        assert barrier
        assert calls["process"] == calls["copyback_barrier"] == 1
        assert ruling.basis == f"{process.reason}+copyback_barrier"


@pytest.mark.parametrize(("owner", "proof", "process", "barrier"), CASES)
def test_probes_are_called_only_when_the_rule_reaches_them(
    owner: RecordedOwner, proof: bool, process: TakeoverDecision, barrier: bool
) -> None:
    _, calls = rule(owner, proof, process, barrier)
    own_live = owner.same_process and owner.live_here
    assert calls["stop_proof"] == int(owner.readable and not own_live)
    reaches_os = (
        owner.readable
        and owner.same_host
        and not own_live
        and not proof
        and not (owner.same_process and owner.joined_here)
    )
    assert calls["process"] == int(reaches_os)
    assert calls["copyback_barrier"] == int(reaches_os and process.allowed)


def test_an_unreadable_receipt_needs_the_board_without_any_probe() -> None:
    ruling, calls = rule(RecordedOwner(False, False, False, False, False), True, DEAD, True)
    assert ruling == Ruling("verify_stop", why="receipt_unreadable")
    assert not calls


def test_another_host_needs_the_board_unless_the_platform_proved_the_stop() -> None:
    foreign = RecordedOwner(True, False, False, False, False)
    assert rule(foreign, False, DEAD, True)[0] == Ruling("verify_stop", why="not_this_host")
    assert rule(foreign, True, ALIVE, False)[0] == Ruling("take_over", "platform_stop_proof")


@pytest.mark.parametrize(
    ("process", "barrier", "expected"),
    [
        (ALIVE, True, Ruling("verify_stop", why="process_alive")),
        # orphaned copy children may still run
        (DEAD, False, Ruling("verify_stop", why="no_copyback_barrier")),
        (DEAD, True, Ruling("take_over", "controller_process_dead+copyback_barrier")),
        (RECYCLED, True, Ruling("take_over", "controller_pid_recycled+copyback_barrier")),
    ],
)
def test_a_same_host_owner_is_taken_over_only_when_dead_and_past_the_barrier(
    process: TakeoverDecision, barrier: bool, expected: Ruling
) -> None:
    same_host = RecordedOwner(True, True, False, False, False)
    assert rule(same_host, False, process, barrier)[0] == expected


def test_our_own_process_live_action_is_kept_and_a_joined_one_is_taken_over() -> None:
    live = RecordedOwner(True, True, True, True, False)
    joined = RecordedOwner(True, True, True, False, True)
    assert rule(live, True, DEAD, True) == (Ruling("own_action_live"), Counter())
    assert rule(joined, False, ALIVE, False)[0] == Ruling("take_over", "same_boot_joined")


STARTED = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BOOT = "3c89d313-8d71-4341-ab24-dd3696470a0f"
REBOOTED = "9b1e0f44-2a6c-4d1e-8f3a-55c0de7a9b12"


def _here(kernel_boot_id: str | None) -> ControllerIdentity:
    return ControllerIdentity("c-here", 4242, STARTED, "ctl-3", kernel_boot_id, 1234)


def _recorded(hostname: str, kernel_boot_id: str | None) -> OwnerReceipt:
    # The same PID and start time as `_here`: only host name and boot may tell them apart.
    return OwnerReceipt("t", hostname, 4242, STARTED, "c-old", kernel_boot_id, None, None)


@pytest.mark.parametrize(
    ("hostname", "recorded_boot", "here_boot", "expected"),
    [
        ("ctl-3", BOOT, BOOT, "this_host"),
        # Same name, another boot: a PID reused after a reboot, or a namesake machine.
        ("ctl-3", REBOOTED, BOOT, "other_boot"),
        # This process can't read its own boot: the recorded one can't be shown to be ours.
        ("ctl-3", BOOT, None, "other_boot"),
        # A receipt from before kernel boot ids: judged by name, as it always was.
        ("ctl-3", None, BOOT, "this_host"),
        ("ctl-3", None, None, "this_host"),
        ("ctl-9", BOOT, BOOT, "other_host"),
        ("ctl-9", None, None, "other_host"),
    ],
)
def test_an_owner_is_on_this_host_only_under_this_name_and_this_boot(
    hostname: str, recorded_boot: str | None, here_boot: str | None, expected: HostMatch
) -> None:
    assert owner_host(_recorded(hostname, recorded_boot), _here(here_boot)) == expected


def test_an_owner_of_another_boot_is_never_probed_even_when_dead() -> None:
    match = owner_host(_recorded("ctl-3", REBOOTED), _here(BOOT))
    owner = RecordedOwner(True, match == "this_host", False, False, False)
    ruling, calls = rule(owner, False, DEAD, True)
    assert ruling == Ruling("verify_stop", why="not_this_host")
    assert calls["process"] == 0
