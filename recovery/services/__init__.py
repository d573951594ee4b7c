"""Services of the recovery app (writes). Entry points named by the contract live here:

- recovery actions: `recovery_action_get_live`, `recovery_action_upsert_source_scoped`,
  `recovery_action_resolve`;
- finalization ownership: `with_finalization_ownership` → `Acquired` / `NotAcquired`;
- finalization: `result_accept`, `run_finalize`, `finalizations_reconcile`;
- owner-stop recovery: `recovery_owner_stop_confirm`;
- recovery-source inspection (`recovery_source_inspect`, `recovery_source_owned_lease`),
  re-exported lazily from `recovery.selectors.source`, which imports from this package.
"""

from __future__ import annotations

from typing import Any

from recovery.selectors.actions import recovery_action_get_live
from recovery.services.actions import (
    RecoveryActionInput,
    RecoveryUpsert,
    recovery_action_resolve,
    recovery_action_upsert_source_scoped,
)
from recovery.services.finalization import (
    FinalizeOutcome,
    ReconcileSummary,
    ResultAcceptance,
    finalizations_reconcile,
    result_accept,
    run_finalize,
)
from recovery.services.owner_stop import OwnerStopConfirmation, recovery_owner_stop_confirm
from recovery.services.ownership import (
    Acquired,
    FinalizationOwnership,
    NotAcquired,
    with_finalization_ownership,
)

_SOURCE_EXPORTS = ("recovery_source_inspect", "recovery_source_owned_lease")


def __getattr__(name: str) -> Any:
    if name in _SOURCE_EXPORTS:
        from recovery.selectors import source

        return getattr(source, name)
    raise AttributeError(name)


__all__ = [
    "Acquired",
    "FinalizationOwnership",
    "FinalizeOutcome",
    "NotAcquired",
    "OwnerStopConfirmation",
    "ReconcileSummary",
    "RecoveryActionInput",
    "RecoveryUpsert",
    "ResultAcceptance",
    "finalizations_reconcile",
    "recovery_action_get_live",
    "recovery_action_resolve",
    "recovery_action_upsert_source_scoped",
    "recovery_owner_stop_confirm",
    "result_accept",
    "run_finalize",
    "with_finalization_ownership",
]
