"""What the demo holds: its names, the issues and the environment leases it seeds (one per
state), and where its files live."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from paperclip.models import Issue

COMPANY_NAME = "Demo Company"
USERNAME = "demo-board"
KEY_NAME = "seed_demo"
AGENTS = ("demo-agent-alpha", "demo-agent-beta")
PROVIDER = "demo-provider"
ENVIRONMENT = "demo-sandboxes"
SANDBOX_PROVIDER = "demo-sandbox"
SANDBOX_PLUGIN = "plugin-demo-sandbox"
# The demo's files live under the data directory, so two checkouts on one machine keep theirs
# apart (docs/setup.md#the-demo); the printed logins are saved there too.
WORKSPACES = (
    ("demo-workspace-main", "main"),
    ("demo-workspace-review", "review"),
    ("demo-workspace-export", "export"),
    ("demo-workspace-archive", "archive/repo"),
)
LOGINS_FILE = "logins.txt"
HELD_TITLE = "Publish the nightly export"
# The README's agent quickstart: paperclip-agent runs a command for this issue in this workspace.
CLI_ISSUE = "Fix the flaky lease test"
CLI_WORKDIR = "agent-run"
# The provider worker's guide (docs/environment.md#provider-workers-guide) leases a sandbox to
# this issue's running run.
PROVIDER_RUN_ISSUE = "Encrypt runner checkpoints"
STALE_TITLE = "Retire the staging sandbox"
# A failed native run whose retained sandbox lease is a recovery source the console can inspect.
SOURCE_TITLE = "Rebuild the sandbox image"
SOURCE_ALLOCATION = "sbx-demo-source"
HELD_WORKDIR = "export-run"  # the runner's directory
# A run whose export into its workspace failed on every attempt: the archive workspace's cwd
# sits under a regular file (a stand-in for a full or read-only disk) until the board "repairs"
# it by removing that file, then retries the export.
EXPORT_HELD_TITLE = "Archive the build logs"
EXPORT_HELD_WORKDIR = "archive-run"
EXPORT_BLOCKER = "archive"
# (title, status, assignee index or None)
ISSUES = (
    ("Set up the CI pipeline", Issue.Status.BACKLOG, None),
    ("Fix the flaky lease test", Issue.Status.TODO, 0),
    ("Encrypt runner checkpoints", Issue.Status.IN_PROGRESS, 0),
    ("Review the finalization runbook", Issue.Status.IN_REVIEW, 1),
    ("Upgrade the PostgreSQL driver", Issue.Status.BLOCKED, 1),
    ("Ship runtime leases", Issue.Status.DONE, 0),
    ("Drop the legacy runner", Issue.Status.CANCELLED, None),
    (HELD_TITLE, Issue.Status.IN_PROGRESS, 1),
    (STALE_TITLE, Issue.Status.IN_PROGRESS, 0),
    (SOURCE_TITLE, Issue.Status.BLOCKED, 1),
    (EXPORT_HELD_TITLE, Issue.Status.IN_PROGRESS, 0),
)
# One environment lease per interesting state, keyed by its allocation id (what makes the step
# idempotent): (provider_lease_id, the run's issue title, policy, workspace index or None,
# release outcome or None, the steps after the release, marker to write before it).
LeaseSpec = tuple[str, str, str, int | None, str | None, tuple[str, ...], str]
ENVIRONMENT_LEASES: tuple[LeaseSpec, ...] = (
    ("sbx-demo-active", "Encrypt runner checkpoints", "ephemeral", 0, None, (), ""),
    ("sbx-demo-pending", "Ship runtime leases", "ephemeral", None, "succeeded", (), ""),
    (
        "sbx-demo-claimed",
        "Upgrade the PostgreSQL driver",
        "ephemeral",
        None,
        "failed",
        ("claim",),
        "",
    ),
    (
        "sbx-demo-failed",
        "Upgrade the PostgreSQL driver",
        "ephemeral",
        None,
        "failed",
        ("claim", "failed", "for_the_board"),
        "",
    ),
    (
        "sbx-demo-overdue",
        "Review the finalization runbook",
        "ephemeral",
        1,
        "succeeded",
        ("claim", "overdue"),
        "",
    ),
    ("sbx-demo-retained", HELD_TITLE, "retain_on_failure", 2, "failed", (), "valid"),
    (
        "sbx-demo-bad-marker",
        "Review the finalization runbook",
        "ephemeral",
        None,
        "succeeded",
        (),
        "invalid",
    ),
    ("sbx-demo-reused", "Ship runtime leases", "reuse_by_environment", None, "succeeded", (), ""),
    (
        "sbx-demo-cleaned",
        "Ship runtime leases",
        "ephemeral",
        None,
        "succeeded",
        ("claim", "destroyed"),
        "",
    ),
)


def demo_dir() -> Path:
    """Where the demo keeps its files: `demo/` in the data directory (PAPERCLIP_DATA_DIR)."""
    return Path(settings.DATA_DIR) / "demo"
