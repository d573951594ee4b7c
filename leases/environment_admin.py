"""Admin for environment leases (registered from leases/admin.py)."""
