"""Recovery-source inspection (docs/recovery.md#recovery-source-inspection): resolve only the
immutable workspace source a failed run recorded, and prove nobody else can still write to it.

Never discovers a source by recency, mutable configuration or a provider search: lease ids come
only from the run's restore record, its own sync reference (export causes) or the action's
historical-source evidence, and every lease must be bound to that exact run. Checks run in a
fixed order (docs/recovery.md#recovery-source-checks-in-order) and the first failure wins, so an
operator always sees the most fundamental problem first.

Decisions this service makes itself (docs/recovery.md#recovery-source-checks-in-order):
- Executing in this process (`adapterExecutionControls`): this service hosts no in-process
  adapters, so nothing registers and a run is never "executing here". The registry below
  (`adapter_execution_control`) exists for any future in-process executor; it is per process.
- `hasMigratedLegacyWorkspaceSource`: true only when the run's `result_json` carries a
  `legacyWorkspaceSourceMigration` record (schema `paperclip.legacy-workspace-source-migration.v1`)
  naming this company, run, lease and descriptor digest; otherwise false.
- Remote workspace authority: `execution_workspaces.metadata.remoteWorkspaceAuthority`
  (`{epoch, dirty, writerRunId, snapshotId, location: {leaseId, providerLeaseId, remoteCwd,
  environmentId}}`).
- `retired_reusable_lease_predecessors`: the hand-off rule is defined in its docstring.

The package, by step:

- `inspection.py`: `recovery_source_inspect`, the checks in their order: the run and action
  bound to the issue, the run's workspace references, the recorded lease ids, nobody driving
  the run, a completed export still owed copy-back; then each lease;
- `lease_checks.py`: one recorded lease, strictly (binding, policy, descriptor, hand-off,
  writer, environment);
- `hand_off.py`: the hand-off rule of a reusable allocation (`retired_reusable_lease_predecessors`)
  and the predecessors' runs it relies on;
- `remote_references.py`: the strict parsers of a remote run's workspace reference and of its
  workspace's authority record, and whether they agree;
- `execution.py`: whether a run may still be driven (an adapter executing in this process, a
  live controller lease);
- `owned_lease.py`: `recovery_source_owned_lease`, the preservation owner's own lease.
"""
