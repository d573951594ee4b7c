"""Controller identity and takeover evaluation with real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import psutil

from paperclip.host import kernel_boot_id
from recovery.adapters.identity import (
    current_controller_identity,
    evaluate_controller_takeover,
    process_start_ticks,
    process_started_at,
)


def test_identity_is_this_process_with_its_os_start_time() -> None:
    me = current_controller_identity()
    assert me.pid == os.getpid()
    assert me is current_controller_identity()  # stable within a process
    # Both read now: the identity's own wall-clock start was read when it was made, and a
    # clock step since would move psutil's (docs/recovery.md#controller-identity).
    started, observed = process_started_at(os.getpid()), psutil.Process().create_time()
    assert started is not None
    assert abs(started.timestamp() - observed) < 0.01
    assert me.process_start_ticks == process_start_ticks(os.getpid())
    assert me.kernel_boot_id == kernel_boot_id()  # the machine's boot, beside the process's


def test_start_ticks_are_the_kernels_count_even_under_an_awkward_command_name() -> None:
    # The command name sits in parentheses in /proc/<pid>/stat and may hold ") " itself.
    code = "open('/proc/self/comm', 'w').write(') x ( 1 2'); print(flush=True); input()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        assert psutil.Process(proc.pid).name() == ") x ( 1 2"
        ticks = process_start_ticks(proc.pid)
        assert ticks is not None
        # psutil's start is the boot time plus these ticks: both read now, one boot time.
        since_boot = psutil.Process(proc.pid).create_time() - psutil.boot_time()
        assert abs(ticks / os.sysconf("SC_CLK_TCK") - since_boot) < 0.02
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert process_start_ticks(proc.pid) is None  # reaped: no such process


def test_a_stepped_clock_does_not_make_a_live_controller_look_recycled() -> None:
    # A step of the system clock moves the boot time every wall-clock start is derived from:
    # the receipt's wall-clock start is then off by the step, its ticks are not.
    me = current_controller_identity()
    assert me.process_start_ticks is not None
    for step in (timedelta(seconds=-15), timedelta(seconds=15), timedelta(hours=3)):
        decision = evaluate_controller_takeover(
            pid=me.pid, started_at=me.process_started_at + step, start_ticks=me.process_start_ticks
        )
        assert (decision.allowed, decision.reason) == (False, "controller_still_alive")


def test_other_ticks_are_another_process_whatever_the_wall_clock_says() -> None:
    me = current_controller_identity()
    assert me.process_start_ticks is not None
    for ticks in (me.process_start_ticks - 1, me.process_start_ticks + 1, 0):
        decision = evaluate_controller_takeover(
            pid=me.pid, started_at=me.process_started_at, start_ticks=ticks
        )
        assert (decision.allowed, decision.reason) == (True, "controller_pid_recycled")


def test_ticks_of_a_dead_process_are_taken_over(dead_pid: int) -> None:
    me = current_controller_identity()
    decision = evaluate_controller_takeover(
        pid=dead_pid, started_at=me.process_started_at, start_ticks=me.process_start_ticks
    )
    assert (decision.allowed, decision.reason) == (True, "controller_process_dead")


def test_live_process_with_its_start_time_is_not_taken_over() -> None:
    # A receipt without ticks, judged by its wall-clock start, read afresh (see above).
    me = current_controller_identity()
    started = process_started_at(me.pid)
    assert started is not None
    decision = evaluate_controller_takeover(pid=me.pid, started_at=started)
    assert (decision.allowed, decision.reason) == (False, "controller_still_alive")
    close = started + timedelta(milliseconds=500)
    assert not evaluate_controller_takeover(pid=me.pid, started_at=close).allowed


def test_recycled_pid_and_dead_pid_are_taken_over(dead_pid: int) -> None:
    me = current_controller_identity()
    recycled = evaluate_controller_takeover(
        pid=me.pid, started_at=me.process_started_at - timedelta(seconds=1)
    )
    assert (recycled.allowed, recycled.reason) == (True, "controller_pid_recycled")
    dead = evaluate_controller_takeover(pid=dead_pid, started_at=me.process_started_at)
    assert (dead.allowed, dead.reason) == (True, "controller_process_dead")


def test_zombie_counts_as_dead() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = process_started_at(proc.pid) or current_controller_identity().process_started_at
        assert evaluate_controller_takeover(pid=proc.pid, started_at=started).allowed
    finally:
        proc.wait(timeout=10)


def test_missing_identity_is_not_taken_over() -> None:
    assert not evaluate_controller_takeover(pid=None, started_at=None).allowed
