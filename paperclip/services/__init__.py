"""Writes of the core models: companies, agents and keys, issues, execution workspaces, runs.

Every public service takes keyword-only arguments (the acting `Actor` and plain values), checks
what it can before opening a transaction, owns one `transaction.atomic(durable=True)`, writes one
audit row per state change inside it, and returns a frozen dataclass. Access is enforced here,
not only in the views: another company's objects answer NotFoundError (404), exactly like
missing ones.

What lives where:

- `companies`: `company_create`, `agent_create`, `agent_key_issue`, `agent_key_revoke`;
- `issues`: `issue_create`, `issue_update`, `execution_workspace_create`;
- `runs`: `run_create`, `run_transition` (the run lifecycle is in its docstring) and the
  helpers other apps compose inside their own transaction, `run_finish_in_tx` and
  `issue_slots_release_in_tx`;
- `shared`: `absolute_path_error` (also used by the API serializers and the admin),
  `workspace_cwd_check_in_tx` (also used by the admin) and the board check and audit helper
  the modules above use.

Code inside this package imports from the defining module; this facade is for the rest of
the project (API, admin, commands, other apps, tests).
"""

from __future__ import annotations

from paperclip.services.companies import (
    AgentCreated,
    CompanyCreated,
    agent_create,
    agent_key_issue,
    agent_key_revoke,
    company_create,
)
from paperclip.services.issues import (
    ExecutionWorkspaceCreated,
    IssueCreated,
    IssueUpdate,
    execution_workspace_create,
    issue_create,
    issue_update,
)
from paperclip.services.runs import (
    RunCreated,
    RunTransition,
    issue_slots_release_in_tx,
    run_create,
    run_finish_in_tx,
    run_interrupt,
    run_transition,
)
from paperclip.services.shared import absolute_path_error, workspace_cwd_check_in_tx

__all__ = [
    "AgentCreated",
    "CompanyCreated",
    "ExecutionWorkspaceCreated",
    "IssueCreated",
    "IssueUpdate",
    "RunCreated",
    "RunTransition",
    "absolute_path_error",
    "agent_create",
    "agent_key_issue",
    "agent_key_revoke",
    "company_create",
    "execution_workspace_create",
    "issue_create",
    "issue_slots_release_in_tx",
    "issue_update",
    "run_create",
    "run_finish_in_tx",
    "run_interrupt",
    "run_transition",
    "workspace_cwd_check_in_tx",
]
