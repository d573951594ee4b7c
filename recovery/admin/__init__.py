"""Recovery's admin, by concern: `actions` (the recovery actions' page and the board's
confirmations: owner stop, workspace conflict, export retry, resolution), with what its pages
show in `action_displays`, its forms in `action_forms`, the conflict preview in
`conflict_preview` and the source inspection in `source_panel`; `finalization` (coordinators
and "Finalize now"); `worker_stops` (the platform's stop receipts). Importing the package
registers every page (Django's admin autodiscovery)."""

from recovery.admin import actions, finalization, worker_stops

__all__ = ["actions", "finalization", "worker_stops"]
