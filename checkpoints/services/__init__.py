"""Writes of the checkpoints app: the controller lease, the fenced checkpoint writer, the
writer-failure hook, the expired-authority sweep and key rotation.

Clock: every expiry decision uses the database's `clock_timestamp()` sampled after the row lock
it depends on (see `checkpoints.locks`), never the application server's clock. Raw SQL is kept
only where it buys such a guarantee (the coordinator locks in `checkpoints.locks`) and for
NOTIFY, which has no ORM spelling.

What lives where:

- `controller_lease`: `controller_lease_acquire` (acquire, renew, take over), the writer-failure
  hook `controller_lease_expire_on_failure`, `ControllerLease` and the lease bounds
  (`CONTROLLER_LEASE_TTL_MIN`, `CONTROLLER_LEASE_TTL_MAX`, `CONTROLLER_LEASE_TTL_DEFAULT`,
  `GENERATION_MAX`);
- `writer`: `checkpoint_write` with its owner fence and predecessor check,
  `checkpoint_write_validate`, the value types (`CheckpointOwner`, `Predecessor`,
  `CheckpointWrite`) and the write limits (`max_part_bytes`, `max_write_bytes`,
  `max_parts_per_write`, `MAX_PART_NAME_CHARS`, `MAX_WORK_COMMAND_ID_CHARS`,
  `MAX_WORK_COMMAND_IDS`);
- `sweep`: `controller_leases_expire` (expired controller authorities, one batch),
  `expired_authorities_sweep` (all of them, batch by batch), `AuthorityExpiry`, `AuthoritySweep`;
- `rotation`: `checkpoint_key_rotate_batch`, `checkpoint_parts_remaining_under_old_keys`,
  `RotationBatch`, `ROTATION_BATCH_MAX_BYTES`;
- `shared`: what the writer and the sweep both use, the live-run-recovery NOTIFY
  (`live_run_recovery_notify` on `LIVE_RUN_RECOVERY_CHANNEL`).

Code inside this package imports from the defining module; this facade is for the rest of
the project (API, commands, bench, tests).
"""

from __future__ import annotations

from checkpoints.services.controller_lease import (
    CONTROLLER_LEASE_TTL_DEFAULT,
    CONTROLLER_LEASE_TTL_MAX,
    CONTROLLER_LEASE_TTL_MIN,
    GENERATION_MAX,
    ControllerLease,
    controller_lease_acquire,
    controller_lease_expire_on_failure,
)
from checkpoints.services.rotation import (
    ROTATION_BATCH_MAX_BYTES,
    RotationBatch,
    checkpoint_key_rotate_batch,
    checkpoint_parts_remaining_under_old_keys,
)
from checkpoints.services.shared import LIVE_RUN_RECOVERY_CHANNEL
from checkpoints.services.sweep import (
    AuthorityExpiry,
    AuthoritySweep,
    controller_leases_expire,
    expired_authorities_sweep,
)
from checkpoints.services.writer import (
    MAX_PART_NAME_CHARS,
    MAX_WORK_COMMAND_ID_CHARS,
    MAX_WORK_COMMAND_IDS,
    CheckpointOwner,
    CheckpointWrite,
    Predecessor,
    checkpoint_write,
    checkpoint_write_validate,
    max_part_bytes,
    max_parts_per_write,
    max_write_bytes,
)

__all__ = [
    "CONTROLLER_LEASE_TTL_DEFAULT",
    "CONTROLLER_LEASE_TTL_MAX",
    "CONTROLLER_LEASE_TTL_MIN",
    "GENERATION_MAX",
    "LIVE_RUN_RECOVERY_CHANNEL",
    "MAX_PART_NAME_CHARS",
    "MAX_WORK_COMMAND_IDS",
    "MAX_WORK_COMMAND_ID_CHARS",
    "ROTATION_BATCH_MAX_BYTES",
    "AuthorityExpiry",
    "AuthoritySweep",
    "CheckpointOwner",
    "CheckpointWrite",
    "ControllerLease",
    "Predecessor",
    "RotationBatch",
    "checkpoint_key_rotate_batch",
    "checkpoint_parts_remaining_under_old_keys",
    "checkpoint_write",
    "checkpoint_write_validate",
    "controller_lease_acquire",
    "controller_lease_expire_on_failure",
    "controller_leases_expire",
    "expired_authorities_sweep",
    "max_part_bytes",
    "max_parts_per_write",
    "max_write_bytes",
]
