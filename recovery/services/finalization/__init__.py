"""Accepting a native run's result and finalizing its workspace under ownership, by step:

- `acceptance.py`: `result_accept` (the runner's result stored, the coordinator moved to
  `result_accepted`, the finalization job deferred);
- `finalize.py`: `run_finalize`, one attempt under finalization ownership (copy back or
  publish, then commit), and its outcome `FinalizeOutcome`;
- `publish.py`: publishing a snapshot tree into the workspace head, and holding a conflict
  for the board;
- `operations.py`: the durable `workspace_finalize` operation, and the retry schedule of a
  failed attempt;
- `commit.py`: committing a finalized run (coordinator, run, issue slots, holds resolved);
- `binding.py`: the locked run binding (issue, coordinator, run) and the run's phase mirror;
- `reconcile.py`: `finalizations_reconcile`, the periodic pass over waiting finalizations.
"""
