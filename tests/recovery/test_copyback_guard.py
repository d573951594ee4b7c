"""The copy-back guard's decision on plain paths (recovery.services.copyback_guard): no
database, real directories where symbolic links matter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from recovery.services.copyback_guard import copyback_refusal

ROOTS = ["/srv/runs"]
CWDS = ["/srv/workspaces/a", "/srv/runs/shared/ws"]


def _refusal(source: str, **overrides: Any) -> str | None:
    kwargs: dict[str, Any] = {
        "roots": ROOTS,
        "cwds": CWDS,
        "data_dir": "/var/lib/paperclip",
        "store_dir": "/var/lib/paperclip/cas",
        **overrides,
    }
    return copyback_refusal(source, **kwargs)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("/srv/runs/run-1", None),
        ("/srv/runs/run-1/deep/er", None),
        ("relative/dir", "not_absolute"),
        ("/", "outside_copyback_roots"),
        ("/srv", "outside_copyback_roots"),
        ("/srv/runsx/run-1", "outside_copyback_roots"),
        ("/srv/workspaces/a", "outside_copyback_roots"),
        ("/srv/runs", "copyback_root"),
        ("/srv/runs/run-1/../../workspaces/a", "outside_copyback_roots"),
        ("/srv/runs/shared/ws", "execution_workspace"),
        ("/srv/runs/shared/ws/sub", "inside_execution_workspace"),
        ("/srv/runs/shared", "contains_execution_workspace"),
    ],
)
def test_a_directory_is_judged_by_the_roots_then_the_workspaces(
    source: str, reason: str | None
) -> None:
    assert _refusal(source) == reason


def test_no_roots_means_the_copy_back_is_off() -> None:
    assert _refusal("/srv/runs/run-1", roots=[]) == "copyback_disabled"


def test_the_data_directory_and_the_store_are_refused_under_any_root() -> None:
    roots = ["/"]
    assert _refusal("/var/lib/paperclip", roots=roots) == "data_directory"
    assert _refusal("/var/lib/paperclip/pgdata", roots=roots) == "data_directory"
    assert _refusal("/var/lib", roots=roots) == "data_directory"
    assert _refusal("/var/lib/paperclip/cas/ab", roots=roots) == "data_directory"
    assert _refusal("/srv/workspaces", roots=roots) == "contains_execution_workspace"
    # The store may live outside the data directory.
    assert _refusal("/blobs/x", roots=roots, store_dir="/blobs") == "store_directory"
    assert _refusal("/blobs/x", roots=roots, store_dir=None) is None


def test_a_root_inside_the_data_directory_grants_only_itself() -> None:
    # The demo: PAPERCLIP_COPYBACK_ROOTS=<data dir>/demo.
    data = {"data_dir": "/d", "store_dir": "/d/cas", "cwds": ["/d/demo/main"]}
    roots = ["/d/demo", "/"]
    assert _refusal("/d/demo/export-run", roots=roots, **data) is None
    assert _refusal("/d/demo", roots=roots, **data) == "copyback_root"
    assert _refusal("/d/pgdata", roots=roots, **data) == "data_directory"
    assert _refusal("/d", roots=roots, **data) == "data_directory"
    assert _refusal("/d/demo/x", roots=roots, **{**data, "store_dir": "/d/demo/x"}) == (
        "store_directory"
    )
    assert _refusal("/d/demo/main/x", roots=roots, **data) == "inside_execution_workspace"
    # A root that is the data directory grants nothing in it.
    assert _refusal("/d/x", roots=["/d"], data_dir="/d", store_dir=None, cwds=[]) == (
        "data_directory"
    )


def test_symbolic_links_are_resolved_before_judging(tmp_path: Path) -> None:
    roots = [str(tmp_path / "runs")]
    (tmp_path / "runs").mkdir()
    other = tmp_path / "workspaces" / "b"
    other.mkdir(parents=True)
    cwds = [str(other)]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    kwargs: dict[str, Any] = {"roots": roots, "cwds": cwds, "data_dir": "/nonexistent"}
    (tmp_path / "runs" / "to-b").symlink_to(other)
    (tmp_path / "runs" / "to-elsewhere").symlink_to(outside)
    (tmp_path / "runs" / "via").symlink_to(tmp_path / "workspaces")
    assert copyback_refusal(str(tmp_path / "runs" / "to-b"), store_dir=None, **kwargs) == (
        "outside_copyback_roots"
    )
    assert copyback_refusal(str(tmp_path / "runs" / "via" / "b"), store_dir=None, **kwargs) == (
        "outside_copyback_roots"
    )
    assert copyback_refusal(str(tmp_path / "runs" / "to-elsewhere"), store_dir=None, **kwargs) == (
        "outside_copyback_roots"
    )
    # A root given through a link, and a workspace cwd recorded through one, are resolved too.
    (tmp_path / "runs-link").symlink_to(tmp_path / "runs")
    (tmp_path / "runs" / "ws").mkdir()
    (tmp_path / "ws-link").symlink_to(tmp_path / "runs" / "ws")
    linked: dict[str, Any] = {
        "roots": [str(tmp_path / "runs-link")],
        "cwds": [str(tmp_path / "ws-link")],
        "data_dir": "/nonexistent",
        "store_dir": None,
    }
    assert copyback_refusal(str(tmp_path / "runs" / "ws" / "a"), **linked) == (
        "inside_execution_workspace"
    )
    assert copyback_refusal(str(tmp_path / "runs" / "run-1"), **linked) is None


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("/srv/runs/run-b", "another_company_run"),
        ("/srv/runs/run-b/sub", "another_company_run"),
        ("/srv/runs/host", "another_company_run"),
        ("/srv/runs/run-bb", None),
        ("/srv/runs/run-a", None),
        ("/elsewhere/run-b", "outside_copyback_roots"),
    ],
)
def test_another_companys_run_directory_is_refused_after_the_roots(
    source: str, reason: str | None
) -> None:
    other_runs = ["/srv/runs/run-b", "/srv/runs/host/run-c", "relative/run"]
    assert _refusal(source, other_runs=other_runs) == reason


def test_another_companys_directory_outside_the_roots_counts_for_nothing() -> None:
    """Never copied back, so no run directory of theirs: `/` or the root itself named by
    another company's run refuses nothing."""
    assert _refusal("/srv/runs/run-a", other_runs=["/", "/srv/runs", "/srv/runs/"]) is None


def test_another_companys_run_directory_is_compared_resolved(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    (runs / "real-b").mkdir(parents=True)
    (runs / "b-link").symlink_to(runs / "real-b")
    (runs / "a-link").symlink_to(runs / "real-b")
    kwargs: dict[str, Any] = {"roots": [str(runs)], "cwds": [], "data_dir": "/nonexistent"}
    other_runs = [str(runs / "b-link")]
    for source in (runs / "real-b", runs / "a-link", runs / "real-b" / "x"):
        assert copyback_refusal(str(source), store_dir=None, other_runs=other_runs, **kwargs) == (
            "another_company_run"
        )


def _roots_setting(value: str) -> subprocess.CompletedProcess[str]:
    """PAPERCLIP_COPYBACK_ROOTS as a fresh process's settings read it (nothing connects)."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "paperclip.settings",
        "PYTHONPATH": str(settings.BASE_DIR),
        "DATABASE_URL": "postgres://nobody@127.0.0.1:1/none",
        "DJANGO_SECRET_KEY": "s" * 50,
        "PAPERCLIP_COPYBACK_ROOTS": value,
    }
    code = (
        "import json; from django.conf import settings as s; "
        "print(json.dumps(s.PAPERCLIP_COPYBACK_ROOTS))"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("value", "roots"), [("", []), ("/srv/runs", ["/srv/runs"]), (" /a , /b/,", ["/a", "/b/"])]
)
def test_the_roots_setting_is_a_list_of_absolute_directories(value: str, roots: list[str]) -> None:
    done = _roots_setting(value)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == roots


def test_a_relative_root_stops_startup() -> None:
    done = _roots_setting("/srv/runs,runs")
    assert done.returncode != 0
    assert "PAPERCLIP_COPYBACK_ROOTS takes absolute directories" in done.stderr
