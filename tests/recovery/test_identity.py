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
    process_started_at,
)


def test_identity_is_this_process_with_its_os_start_time() -> None:
    me = current_controller_identity()
    assert me.pid == os.getpid()
    assert me is current_controller_identity()  # stable within a process
    observed = psutil.Process().create_time()
    assert abs(me.process_started_at.timestamp() - observed) < 0.01
    assert me.kernel_boot_id == kernel_boot_id()  # the machine's boot, beside the process's


def test_live_process_with_its_start_time_is_not_taken_over() -> None:
    me = current_controller_identity()
    decision = evaluate_controller_takeover(pid=me.pid, started_at=me.process_started_at)
    assert (decision.allowed, decision.reason) == (False, "controller_still_alive")
    close = me.process_started_at + timedelta(milliseconds=500)
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
