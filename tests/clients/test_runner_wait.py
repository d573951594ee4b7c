"""The runner's wait for its command (paperclip_client/runner.py): woken by the command's exit,
not by a poll's tick. No server: the wait alone, with a real child process."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from paperclip_client.runner import Runner


def started(command: list[str], where: Path) -> tuple[Runner, list[None]]:
    """A runner whose command is running, and a list that grows at each poll of it."""
    args = argparse.Namespace(checkpoint_every=30.0)
    made = Runner(client=None, args=args, command=command)  # type: ignore[arg-type]
    child = made._spawn(where)
    polls: list[None] = []
    real = child.poll

    def counted() -> int | None:
        polls.append(None)
        return real()

    child.poll = counted  # type: ignore[method-assign]
    return made, polls


def test_the_wait_ends_when_the_command_exits_not_at_a_tick(tmp_path: Path) -> None:
    """A command that runs half a second is polled at most three times (its exit wakes the
    wait), where polling every 0.1 s polled it five times or more."""
    waiting, polls = started(["sleep", "0.5"], tmp_path)
    none: Any = None
    assert waiting._wait_child(none, none, None) == 0
    assert len(polls) <= 3


def test_a_lost_lease_wakes_the_wait(tmp_path: Path) -> None:
    waiting, polls = started(["sleep", "30"], tmp_path)
    threading.Timer(0.2, waiting.on_lost, args=("lost in the test",)).start()
    none: Any = None
    try:
        assert waiting._wait_child(none, none, None) is None
        assert waiting.lost_reason == "lost in the test"
        assert len(polls) <= 3
    finally:
        assert waiting.child is not None
        waiting.child.kill()
        waiting.child.wait()
