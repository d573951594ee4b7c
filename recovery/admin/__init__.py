"""Recovery's admin, by concern: `actions` (recovery actions, owner-stop confirmation and the
source inspection) and `finalization` (coordinators and "Finalize now"). Importing the package
registers both (Django's admin autodiscovery)."""

from recovery.admin import actions, finalization

__all__ = ["actions", "finalization"]
