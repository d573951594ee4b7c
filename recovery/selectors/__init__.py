"""Reads of the recovery app: `actions` (recovery actions, waiting finalizations, a run's
issue) and `source` (recovery-source inspection). Import from the submodule."""
