"""Python client of the Paperclip control plane (agents' side) and the `paperclip-agent` CLI.

`Client` calls the API; `RuntimeLeaseKeeper` / `ControllerLeaseKeeper` hold leases in the
background; `SessionCheckpointer` / `restore` save and restore a session directory;
`paperclip_client.workdir` snapshots a workdir and checks a workspace head out. Examples:
clients/python/README.md.
"""

from paperclip_client import errors, models
from paperclip_client.client import Client, operations
from paperclip_client.errors import (
    ERRORS,
    ApiError,
    OutcomeUnknown,
    PaperclipError,
    ServerUnreachable,
)
from paperclip_client.keepers import ControllerLeaseKeeper, LeaseLost, RuntimeLeaseKeeper
from paperclip_client.session import CheckpointError, SessionCheckpointer, restore

__all__ = [
    "ERRORS",
    "ApiError",
    "CheckpointError",
    "Client",
    "ControllerLeaseKeeper",
    "LeaseLost",
    "OutcomeUnknown",
    "PaperclipError",
    "RuntimeLeaseKeeper",
    "ServerUnreachable",
    "SessionCheckpointer",
    "errors",
    "models",
    "operations",
    "restore",
]
