"""What `with_finalization_ownership` answers: the action's value, or why it may not run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WaitReason = Literal[
    "busy", "owner_active", "platform_stop_pending", "owner_unverified", "binding_changed"
]


@dataclass(frozen=True, slots=True)
class Acquired[T]:
    value: T
    acquired: Literal[True] = True


@dataclass(frozen=True, slots=True)
class NotAcquired:
    reason: WaitReason
    acquired: Literal[False] = False
