"""Python client of the Paperclip control plane (agents' side) and the `paperclip-agent` CLI.

`Client` calls the API; `RuntimeLeaseKeeper` / `ControllerLeaseKeeper` hold leases in the
background; `SessionCheckpointer` / `restore` save and restore a session directory;
`paperclip_client.workdir` snapshots a workdir and checks a workspace head out. Examples:
clients/python/README.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from paperclip_client import errors
from paperclip_client.errors import (
    ERRORS,
    ApiError,
    CheckpointError,
    OutcomeUnknown,
    PaperclipError,
    ServerUnreachable,
)

if TYPE_CHECKING:
    from paperclip_client import models
    from paperclip_client.client import Client, operations
    from paperclip_client.keepers import ControllerLeaseKeeper, LeaseLost, RuntimeLeaseKeeper
    from paperclip_client.session import SessionCheckpointer, restore

# The rest of the API is imported at its first use (PEP 562), not with the package: every
# `paperclip-agent` start imports this package first, and most of these modules are not on
# the way to its first request (issue #42). `from paperclip_client import Client` still works.
_LAZY = {
    # The submodules the package's import used to load, read as its attributes.
    **{
        sub: (f"paperclip_client.{sub}", None)
        for sub in ("models", "client", "cas", "transport", "keepers", "session")
    },
    "Client": ("paperclip_client.client", "Client"),
    "operations": ("paperclip_client.client", "operations"),
    "ControllerLeaseKeeper": ("paperclip_client.keepers", "ControllerLeaseKeeper"),
    "LeaseLost": ("paperclip_client.keepers", "LeaseLost"),
    "RuntimeLeaseKeeper": ("paperclip_client.keepers", "RuntimeLeaseKeeper"),
    "SessionCheckpointer": ("paperclip_client.session", "SessionCheckpointer"),
    "restore": ("paperclip_client.session", "restore"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
