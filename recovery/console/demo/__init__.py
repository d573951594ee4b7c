"""The demo `manage.py seed_demo` builds, by step: `plan.py` (its names, issues and
environment-lease states), `company.py` (the board user, company, agents, workspaces, issues,
keys, and the reset), `runs.py` (the runs, the stuck ones included), `environment.py` (the
sandbox environment's leases and the recovery source), `summary.py` (the printed logins)."""
