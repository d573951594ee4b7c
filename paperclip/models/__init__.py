"""Core models, one module per concern: `tenancy` (companies, board members, agents and their
keys), `workspaces` (execution workspaces, environments), `work` (issues, heartbeat runs),
`outcomes` (workspace operations, the native run results and coordinator), `content` (the
content-addressed store and the snapshots registered in it), `audit` (the activity log) and
`worker` (the worker's processes and job errors); `base` holds the abstract timestamped model.
The head's history (`WorkspaceHeadMove`) lives with the snapshots, in `paperclip.snapshots.models`.

Every model is importable from here (`from paperclip.models import Issue`), which is also how
Django's app registry finds them.

Column names follow upstream Paperclip (docs/data-model.md#naming-conventions) where they
correspond, so upstream's maintenance SQL reads the same. State that must change only through
services is kept read-only in the admin.
"""

from paperclip.models.audit import ActivityEvent
from paperclip.models.base import TimestampedModel
from paperclip.models.content import CasBlob, CasBlobChunk, RunSnapshot, TreeCounts
from paperclip.models.outcomes import NativeRunFinalization, NativeRunResult, WorkspaceOperation
from paperclip.models.tenancy import (
    Agent,
    AgentApiKey,
    ApiCredential,
    BoardApiToken,
    BoardMembership,
    Company,
)
from paperclip.models.work import HeartbeatRun, Issue
from paperclip.models.worker import JobError, WorkerProcess
from paperclip.models.workspaces import Environment, ExecutionWorkspace, ExecutionWorkspaceSnapshot
from paperclip.snapshots.models import WorkspaceHeadMove

__all__ = [
    "ActivityEvent",
    "Agent",
    "AgentApiKey",
    "ApiCredential",
    "BoardApiToken",
    "BoardMembership",
    "CasBlob",
    "CasBlobChunk",
    "Company",
    "Environment",
    "ExecutionWorkspace",
    "ExecutionWorkspaceSnapshot",
    "HeartbeatRun",
    "Issue",
    "JobError",
    "NativeRunFinalization",
    "NativeRunResult",
    "RunSnapshot",
    "TimestampedModel",
    "TreeCounts",
    "WorkerProcess",
    "WorkspaceHeadMove",
    "WorkspaceOperation",
]
