"""The metadata keys and schemas of the stop-only intents, the termination receipt and the
native workspace sync reference, and the system actor the services write as."""

from __future__ import annotations

from typing import Final

EXPORT_RESUME_KEY: Final = "nativeWorkspaceExportResume"
EXPORT_RESUME_V1: Final = "paperclip.workspace-export-resume.v1"
EXPORT_RESUME_V2: Final = "paperclip.workspace-export-resume.v2"
EXPORT_RESUME_SCHEMAS: Final = frozenset({EXPORT_RESUME_V1, EXPORT_RESUME_V2})
STOP_AND_RETAIN_KEY: Final = "sandboxStopAndRetain"
# The metadata keys that carry a stop-only intent, and the columns `stop_only_cleanup_problem`
# reads: a query that judges many leases loads only these.
STOP_ONLY_KEYS: Final = (EXPORT_RESUME_KEY, STOP_AND_RETAIN_KEY)
STOP_ONLY_READ_FIELDS: Final = (
    "id",
    "company_id",
    "heartbeat_run_id",
    "provider",
    "provider_lease_id",
    "metadata",
)
STOP_AND_RETAIN_SCHEMA: Final = "paperclip.sandbox-stop-and-retain.v1"
REMOTE_TERMINATION_KEY: Final = "remoteExecutionTermination"
REMOTE_TERMINATION_SCHEMA: Final = "paperclip.remote-termination.v1"
SYNC_REFERENCE_SCHEMA: Final = "paperclip.native-workspace-sync/v1"
EXPORT_STOP_PENDING: Final = "workspace_export_stop_pending"


SYSTEM_ACTOR_TYPE: Final = "system"
SYSTEM_ACTOR_ID: Final = "paperclip"
