"""The recovery app's public entry points, in one place (the writes are in this package's
modules, the reads in `recovery.selectors`):

- recovery actions: `recovery_action_get_live`, `recovery_action_upsert_source_scoped`,
  `recovery_action_resolve`;
- finalization ownership: `with_finalization_ownership` → `Acquired` / `NotAcquired`;
- finalization: `result_accept`, `run_finalize`, `finalizations_reconcile`; its jobs:
  `finalization_request` (wake it now), `finalization_defer_in_tx`;
- owner-stop recovery: `recovery_owner_stop_confirm`;
- recovery-source inspection: `recovery_source_inspect`, `recovery_source_owned_lease`
  (`recovery.selectors.source`).

Code inside the app imports from the defining module; this facade is for other apps, the
commands and operators' shells.
"""

from __future__ import annotations

from recovery.selectors.actions import recovery_action_get_live
from recovery.selectors.source.inspection import recovery_source_inspect
from recovery.selectors.source.owned_lease import recovery_source_owned_lease
from recovery.services.actions import (
    RecoveryActionInput,
    RecoveryUpsert,
    recovery_action_resolve,
    recovery_action_upsert_source_scoped,
)
from recovery.services.finalization.acceptance import ResultAcceptance, result_accept
from recovery.services.finalization.finalize import run_finalize
from recovery.services.finalization.outcomes import FinalizeOutcome
from recovery.services.finalization.reconcile import ReconcileSummary, finalizations_reconcile
from recovery.services.finalization_jobs import (
    FinalizationRequest,
    finalization_defer_in_tx,
    finalization_request,
)
from recovery.services.owner_stop import OwnerStopConfirmation, recovery_owner_stop_confirm
from recovery.services.ownership.acquire import with_finalization_ownership
from recovery.services.ownership.lock_connection import FinalizationOwnership
from recovery.services.ownership.outcomes import Acquired, NotAcquired

__all__ = [
    "Acquired",
    "FinalizationOwnership",
    "FinalizationRequest",
    "FinalizeOutcome",
    "NotAcquired",
    "OwnerStopConfirmation",
    "ReconcileSummary",
    "RecoveryActionInput",
    "RecoveryUpsert",
    "ResultAcceptance",
    "finalization_defer_in_tx",
    "finalization_request",
    "finalizations_reconcile",
    "recovery_action_get_live",
    "recovery_action_resolve",
    "recovery_action_upsert_source_scoped",
    "recovery_owner_stop_confirm",
    "recovery_source_inspect",
    "recovery_source_owned_lease",
    "result_accept",
    "run_finalize",
    "with_finalization_ownership",
]
