"""The demo's dashboard in a real browser once the worker has done its normal work (its jobs
and a pass of every periodic task): each kind of stuck work the README's screenshot shows that
only the board ends is still there (docs/setup.md#the-demo). The screenshot it saves,
`.screenshots/demo-dashboard.png`, is the README's `docs/console-dashboard.png`."""

from __future__ import annotations

import io
from typing import Any

import pytest
from django.core.management import call_command

from recovery.console.demo.plan import USERNAME
from tests.console.test_browser import PASSWORD, fresh_worker_heartbeat, log_in, page, shot
from tests.helpers import run_jobs
from tests.paperclip.test_seed_demo_stays_put import _every_periodic_task

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

__all__ = ["page"]  # the browser fixture


@pytest.fixture
def demo(settings: Any, tmp_path: Any) -> None:
    """Seeded, and worked on by the worker: before the browser starts (its event loop would
    keep the in-process worker's from running)."""
    settings.DATA_DIR = tmp_path
    settings.PAPERCLIP_COPYBACK_ROOTS = [str(tmp_path / "demo")]  # as make run sets it
    call_command("seed_demo", "--password", PASSWORD, stdout=io.StringIO())
    _every_periodic_task()
    run_jobs()  # the held run's finalization meets its dead owner's receipt: held
    _every_periodic_task()
    fresh_worker_heartbeat()


def test_the_demos_dashboard_keeps_what_only_the_board_ends(demo: None, page: Any) -> None:
    log_in(page, USERNAME)
    # The demo holds two runs for the board, each on its reason's own tile.
    for reason in ("owner_unverified", "workspace_export_retry_exhausted"):
        tile = page.locator(
            f'a.console-tile[data-kind="finalization_held"][data-detail="{reason}"]'
        )
        assert tile.count() == 1, reason
        assert int(tile.locator(".count").inner_text()) >= 1, reason
    for kind in (
        "cleanup_marker_invalid",
        "cleanup_failed",
        "cleanup_claim_overdue",
    ):
        tile = page.locator(f'a.console-tile[data-kind="{kind}"]')
        assert tile.count() == 1, kind
        assert int(tile.locator(".count").inner_text()) >= 1, kind
    assert page.locator('a.console-tile[data-kind="runtime_lease_stale"]').count() == 0
    shot(page, "demo-dashboard")
