"""Finalization ownership (docs/recovery.md#finalization-ownership): one controller at a time
finalizes a run's workspace, and a slow or crashed finalization is never copied over by a second
controller.

Two fences work together:

- a transaction-scoped advisory lock on `native-workspace-finalization:<company>:<run>`, held
  on a dedicated connection (outside Django's) for the whole action. It serializes live
  controllers without holding row locks across copy-back I/O. A keepalive pings that
  connection so `idle_in_transaction_session_timeout` can't end the lock transaction;
- the durable owner receipt in `heartbeat_runs.runner_profile_json ->
  'nativeWorkspaceFinalizationOwner'`, claimed by compare-and-swap. Losing the lock
  connection does not prove that copy-back stopped, so a receipt is only taken over when its
  controller is provably gone: a platform stop proof, same-boot join evidence, or a dead
  same-host process *and* a durable succeeded `workspace_finalize` barrier (a dead parent may
  leave copy children running). Everything else becomes a board-owned recovery action.

There is deliberately no wall-clock timeout that lets anyone take over a slow finalization.
All reads and progress writes go through the ordinary Django connection and commit on their
own; the lock transaction only answers liveness checks.

The package, by step:

- `acquire.py`: `with_finalization_ownership`, the entry point: the advisory lock on a dedicated
  connection, then judging the recorded owner, claiming the receipt, running the action,
  releasing the receipt;
- `outcomes.py`: what it answers (`Acquired` / `NotAcquired` and the wait reasons);
- `lock_connection.py`: the dedicated lock connection and its keepalive, and the
  `FinalizationOwnership` handle whose `assert_held()` rechecks lock, receipt and task;
- `memory.py`: the process-local owner memory (docs/recovery.md#process-local-owner-memory);
- `prior_owner.py`: the takeover rule (`recovery/takeover.py`) applied to the recorded owner;
- `task_current.py`: after a platform-proof takeover, is the resumed task still current;
- `receipt_claim.py` / `receipt_release.py`: the receipt's compare-and-swap claim and its
  removal (retried in the background when the database is away);
- `owner_hold.py`: the board-owned owner-unverified hold (recorded, restored, resuming).
"""
