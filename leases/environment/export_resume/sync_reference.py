"""The native workspace sync reference (`runner_profile_json.nativeWorkspaceSync`), parsed
strictly (docs/environment.md#native-workspace-sync-reference)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from leases.environment.export_resume.keys import SYNC_REFERENCE_SCHEMA

_HEX64 = re.compile(r"[0-9a-f]{64}")
_RESOURCE_DISPOSITIONS = frozenset({"keep_running", "stop_and_retain", "destroy"})


@dataclass(frozen=True, slots=True)
class NativeWorkspaceSyncReference:
    """`runner_profile_json.nativeWorkspaceSync`, validated
    (docs/environment.md#native-workspace-sync-reference)."""

    state: Literal["prepared", "finalized"]
    descriptor_sha256: str
    baseline_sha256: str
    final_host_sha256: str | None
    workspace_id: str
    lease_id: str
    provider_lease_id: str
    remote_cwd: str
    resource_disposition: str | None

    def as_json(self) -> dict[str, Any]:
        """The normalized reference in its stored (camelCase) form."""
        return {
            "schema": SYNC_REFERENCE_SCHEMA,
            "state": self.state,
            "descriptorSha256": self.descriptor_sha256,
            "baselineSha256": self.baseline_sha256,
            "finalHostSha256": self.final_host_sha256,
            "workspaceId": self.workspace_id,
            "leaseId": self.lease_id,
            "providerLeaseId": self.provider_lease_id,
            "remoteCwd": self.remote_cwd,
            "resourceDisposition": self.resource_disposition,
        }


def _is_hex64(value: object) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def read_native_workspace_sync_reference(value: object) -> NativeWorkspaceSyncReference | None:
    """Strictly parse a native workspace sync reference; None on any deviation.

    `finalHostSha256` and `resourceDisposition` may be null; an absent key counts as null.
    """
    if not isinstance(value, Mapping) or value.get("schema") != SYNC_REFERENCE_SCHEMA:
        return None
    state = value.get("state")
    final_host = value.get("finalHostSha256")
    disposition = value.get("resourceDisposition")
    strings = [value.get(k) for k in ("workspaceId", "leaseId", "providerLeaseId", "remoteCwd")]
    if (
        state not in ("prepared", "finalized")
        or not _is_hex64(value.get("descriptorSha256"))
        or not _is_hex64(value.get("baselineSha256"))
        or (final_host is not None and not _is_hex64(final_host))
        or any(not isinstance(s, str) for s in strings)
        or (disposition is not None and disposition not in _RESOURCE_DISPOSITIONS)
    ):
        return None
    workspace_id, lease_id, provider_lease_id, remote_cwd = (str(s) for s in strings)
    return NativeWorkspaceSyncReference(
        state=state,
        descriptor_sha256=str(value["descriptorSha256"]),
        baseline_sha256=str(value["baselineSha256"]),
        final_host_sha256=final_host,
        workspace_id=workspace_id,
        lease_id=lease_id,
        provider_lease_id=provider_lease_id,
        remote_cwd=remote_cwd,
        resource_disposition=disposition,
    )
