"""Environment leases: provider allocations bound to a run, the provider cleanup protocol and
export-resume retention markers.

A Django app of its own (label `leases_environment`) so that its admin, API and services sit
together; it owns no tables: `EnvironmentLease` is a model of the `leases` app
(`leases/models.py`), which keeps the one migration history of both lease tables.
"""
