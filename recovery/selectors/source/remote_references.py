"""A remote run's workspace reference (`runner_profile_json.remoteWorkspace`) and its
workspace's authority record (`execution_workspaces.metadata.remoteWorkspaceAuthority`):
strict parsers, and whether the two agree."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, cast
from uuid import UUID

from paperclip.ids import is_uuid

REMOTE_AUTHORITY_KEY: Final = "remoteWorkspaceAuthority"


def as_dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True)
class RemoteWorkspaceReference:
    """`runner_profile_json.remoteWorkspace`: a remote run's workspace reference."""

    workspace_id: str
    lease_id: str
    provider_lease_id: str
    remote_cwd: str
    epoch: int
    state: Literal["prepared", "saved"]
    snapshot_id: str | None

    def as_json(self) -> dict[str, Any]:
        return {
            "workspaceId": self.workspace_id,
            "leaseId": self.lease_id,
            "providerLeaseId": self.provider_lease_id,
            "remoteCwd": self.remote_cwd,
            "epoch": self.epoch,
            "state": self.state,
            "snapshotId": self.snapshot_id,
        }


def read_remote_workspace_reference(value: object) -> RemoteWorkspaceReference | None:
    """Strict parser: uuid `workspaceId`; string `leaseId`, `providerLeaseId`, `remoteCwd`;
    integer `epoch` >= 0; `state` prepared|saved; `snapshotId` a uuid (required when saved)
    or null/absent. None on any deviation."""
    if not isinstance(value, Mapping):
        return None
    strings = [value.get(k) for k in ("leaseId", "providerLeaseId", "remoteCwd")]
    state, snapshot = value.get("state"), value.get("snapshotId")
    if (
        not is_uuid(value.get("workspaceId"))
        or any(not isinstance(s, str) for s in strings)
        or not is_count(value.get("epoch"))
        or state not in ("prepared", "saved")
        or (snapshot is not None and not is_uuid(snapshot))
        or (state == "saved" and snapshot is None)
    ):
        return None
    lease_id, provider_lease_id, remote_cwd = (str(s) for s in strings)
    return RemoteWorkspaceReference(
        workspace_id=str(value["workspaceId"]),
        lease_id=lease_id,
        provider_lease_id=provider_lease_id,
        remote_cwd=remote_cwd,
        epoch=int(value["epoch"]),
        state=state,
        snapshot_id=snapshot,
    )


@dataclass(frozen=True, slots=True)
class RemoteWorkspaceLocation:
    lease_id: str
    provider_lease_id: str
    remote_cwd: str
    environment_id: str | None


@dataclass(frozen=True, slots=True)
class RemoteWorkspaceAuthority:
    epoch: int
    dirty: bool
    writer_run_id: str | None
    snapshot_id: str | None
    location: RemoteWorkspaceLocation | None


def read_remote_workspace_authority(metadata: object) -> RemoteWorkspaceAuthority | None:
    """The execution workspace's remote authority record, or None when absent or malformed.
    A record without a valid `location` parses with `location=None` (it cannot vouch)."""
    record = as_dict(metadata).get(REMOTE_AUTHORITY_KEY)
    if not isinstance(record, dict):
        return None
    epoch, dirty = record.get("epoch"), record.get("dirty")
    writer, snapshot = record.get("writerRunId"), record.get("snapshotId")
    if (
        not is_count(epoch)
        or not isinstance(dirty, bool)
        or not (writer is None or isinstance(writer, str))
        or not (snapshot is None or isinstance(snapshot, str))
    ):
        return None
    raw = record.get("location")
    location = None
    if isinstance(raw, dict):
        fields = [raw.get(k) for k in ("leaseId", "providerLeaseId", "remoteCwd")]
        env = raw.get("environmentId")
        if all(isinstance(f, str) for f in fields) and (env is None or isinstance(env, str)):
            location = RemoteWorkspaceLocation(str(fields[0]), str(fields[1]), str(fields[2]), env)
    return RemoteWorkspaceAuthority(cast(int, epoch), dirty, writer, snapshot, location)


def remote_reference_agrees(
    reference: RemoteWorkspaceReference,
    authority: RemoteWorkspaceAuthority | None,
    run_id: UUID,
) -> bool:
    if authority is None or authority.location is None:
        return False
    location = authority.location
    if (
        authority.epoch != reference.epoch
        or location.lease_id != reference.lease_id
        or location.provider_lease_id != reference.provider_lease_id
        or location.remote_cwd != reference.remote_cwd
    ):
        return False
    if reference.state == "prepared":
        return authority.dirty and authority.writer_run_id == str(run_id)
    return (
        not authority.dirty
        and authority.writer_run_id is None
        and authority.snapshot_id == reference.snapshot_id
    )
