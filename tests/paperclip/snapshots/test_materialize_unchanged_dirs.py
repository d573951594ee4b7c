"""A head move whose diff did not descend into a directory (the same blob in both trees) while
that directory in the cwd was changed by hand: its mode put back, or the whole head compared
with the disk when it is gone. Both emptied the directory before and recorded the cwd as
holding the head (docs/snapshots.md#materialization)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from django.db.models.functions import Now

from paperclip.models import Company, ExecutionWorkspace
from paperclip.snapshots.head import workspace_materialize
from tests.paperclip.factories import ExecutionWorkspaceFactory
from tests.recovery.snapshots import store_tree

pytestmark = pytest.mark.django_db(transaction=True)

LIB = {"src/lib/a.py": b"A\n", "src/lib/b.py": b"B\n"}


def disturb(cwd: Path, how: str) -> None:
    lib = cwd / "src" / "lib"
    if how == "chmod":
        os.chmod(lib, 0o700)
    elif how == "removed":
        for name in os.listdir(lib):
            os.unlink(lib / name)
        os.rmdir(lib)
    else:  # a file where the directory was
        for name in os.listdir(lib):
            os.unlink(lib / name)
        os.rmdir(lib)
        lib.write_bytes(b"not a directory\n")


@pytest.mark.parametrize("how", ["chmod", "removed", "replaced"])
def test_an_unchanged_directory_disturbed_in_the_cwd_keeps_its_files(
    company: Company, tmp_path: Path, how: str
) -> None:
    cwd = tmp_path / "cwd"
    workspace = ExecutionWorkspaceFactory(company=company, cwd=str(cwd))
    first = store_tree(company.pk, {"src/main.py": b"v1\n", **LIB})
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(head_tree=first)
    assert workspace_materialize(workspace_id=workspace.pk).status == "materialized"
    mode = stat.S_IMODE(os.stat(cwd / "src" / "lib").st_mode)
    disturb(cwd, how)
    second = store_tree(company.pk, {"src/main.py": b"v2\n", **LIB})
    ExecutionWorkspace.objects.filter(pk=workspace.pk).update(
        head_tree=second, head_committed_at=Now()
    )

    assert workspace_materialize(workspace_id=workspace.pk).status == "materialized"

    assert sorted(os.listdir(cwd / "src" / "lib")) == ["a.py", "b.py"]
    assert (cwd / "src" / "lib" / "a.py").read_bytes() == b"A\n"
    assert stat.S_IMODE(os.stat(cwd / "src" / "lib").st_mode) == mode
    assert (cwd / "src" / "main.py").read_bytes() == b"v2\n"
    workspace.refresh_from_db()
    assert workspace.cwd_tree == second
