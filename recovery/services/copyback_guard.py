"""Which run directories the legacy copy-back may read (docs/security.md#the-legacy-copy-back).

A run's `workspace_dir` is whatever its agent wrote when it created the run, and the worker
that copies it back often runs as root: left unchecked, an agent could name another company's
workspace `cwd`, the data directory or `/` and have the worker copy it into its own workspace.
The copy-back therefore reads a directory only when, symbolic links resolved, it lies inside
one of the operator's `PAPERCLIP_COPYBACK_ROOTS`, and never when it is, contains or lies inside
an execution workspace's `cwd` (of any company), the data directory or the store's directory.
The roots hold every company's run directories, so neither does it read one that is, contains
or lies inside a directory another company's run named as its own.

The decision (`copyback_refusal`) is a plain function of paths; `copyback_source_refusal`
gathers its inputs (the settings, every workspace `cwd` and the other companies' run
directories) and is what the result endpoint and the worker call.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Final, Literal
from uuid import UUID

from django.conf import settings

from paperclip.selectors import other_company_run_dirs
from paperclip.services.shared import path_inside, paths_related, run_dirs_under
from recovery.selectors.exports import execution_workspace_cwds, execution_workspace_has_head

type CopybackRefusal = Literal[
    "copyback_disabled",
    "not_absolute",
    "outside_copyback_roots",
    "copyback_root",
    "store_directory",
    "data_directory",
    "execution_workspace",
    "inside_execution_workspace",
    "contains_execution_workspace",
    "workspace_has_head",
    "another_company_run",
]

REFUSAL_TEXT: Final[dict[str, str]] = {
    "copyback_disabled": "The legacy copy-back is off (PAPERCLIP_COPYBACK_ROOTS is empty).",
    "not_absolute": "The run's workspace directory is not an absolute path.",
    "outside_copyback_roots": "The run's workspace directory lies outside every copy-back root.",
    "copyback_root": "The run's workspace directory is a copy-back root itself.",
    "store_directory": "The run's workspace directory is, holds or lies in the blob store.",
    "data_directory": "The run's workspace directory is, holds or lies in the data directory.",
    "execution_workspace": "The run's workspace directory is an execution workspace's cwd.",
    "inside_execution_workspace": (
        "The run's workspace directory lies inside an execution workspace's cwd."
    ),
    "contains_execution_workspace": (
        "The run's workspace directory holds an execution workspace's cwd."
    ),
    "workspace_has_head": (
        "The run's execution workspace keeps its files as snapshots (it has a head): a copy"
        " into its cwd would be undone by the head's next materialization. Send the result"
        " with workspace_tree (paperclip-agent run does)."
    ),
    # Says nothing of which company or run: the agent learns only that the directory is not
    # its company's to copy.
    "another_company_run": "The run's workspace directory is not one of this company's runs.",
}


def copyback_refusal(
    source: str,
    *,
    roots: Sequence[str],
    cwds: Iterable[str],
    data_dir: str,
    store_dir: str | None,
    other_runs: Iterable[str] = (),
    resolved: bool = False,
) -> CopybackRefusal | None:
    """Why the copy-back must not read `source`, or None when it may (`resolved`: `source`
    is already its own `realpath`, judged as it is).

    Every path is resolved with `os.path.realpath` (symbolic links followed, as the copy's
    opening of the directory would) before it is compared, so a link named inside a root that
    points elsewhere is judged by where it points. `source` must lie strictly inside a root
    (a root is where run directories are made, not one of them). The data directory and
    everything in it is refused, except below a root that itself lies inside the data
    directory: naming such a root (the demo's `<data dir>/demo`) is the operator granting that
    part of it. The store's directory and every workspace `cwd` are refused whatever the roots.
    `other_runs` are the directories other companies' runs named: one that, resolved, lies
    strictly inside a root is theirs, and a source that is, holds or lies inside it is
    refused. One outside every root (or a root itself) is ignored: the copy-back never reads
    it, and counting it would let an agent that names `/` stop every other company's copy-back.
    Touches the filesystem only through `realpath`.
    """
    if not roots:
        return "copyback_disabled"
    if not source.startswith("/") or "\x00" in source:
        return "not_absolute"
    path = source if resolved else os.path.realpath(source)
    real_roots = [os.path.realpath(root) for root in roots]
    # Checked first, so that a path outside the roots tells its agent nothing about which
    # directories are other companies' workspaces.
    if not any(path == root or path_inside(path, root) for root in real_roots):
        return "outside_copyback_roots"
    if path in real_roots:
        return "copyback_root"
    data = os.path.realpath(data_dir)
    if paths_related(path, data) and not any(
        path_inside(root, data) and path_inside(path, root) for root in real_roots
    ):
        return "data_directory"
    if store_dir is not None and paths_related(path, os.path.realpath(store_dir)):
        return "store_directory"
    if refusal := _workspace_refusal(path, cwds):
        return refusal
    if any(paths_related(path, theirs) for theirs in run_dirs_under(other_runs, real_roots)):
        return "another_company_run"
    return None


def _workspace_refusal(path: str, cwds: Iterable[str]) -> CopybackRefusal | None:
    """How `path` relates to the first workspace `cwd` it is, lies inside or holds (each
    resolved), or None."""
    for cwd in cwds:
        if not cwd.startswith("/"):
            continue  # not a path the copy-back could write either
        real_cwd = os.path.realpath(cwd)
        if path == real_cwd:
            return "execution_workspace"
        if path_inside(path, real_cwd):
            return "inside_execution_workspace"
        if path_inside(real_cwd, path):
            return "contains_execution_workspace"
    return None


def copyback_roots() -> list[str]:
    """The configured roots (PAPERCLIP_COPYBACK_ROOTS; empty: the legacy copy-back is off)."""
    return [str(root) for root in settings.PAPERCLIP_COPYBACK_ROOTS]


def copyback_workspace_refusal(workspace_id: UUID | None) -> CopybackRefusal | None:
    """`workspace_has_head` when the run's execution workspace has a head: its cwd is made
    from the head, and what a copy-back wrote there (in no tree) would be removed again."""
    if workspace_id is None or not execution_workspace_has_head(workspace_id):
        return None
    return "workspace_has_head"


def copyback_source_refusal(source: str, *, company_id: UUID | None) -> CopybackRefusal | None:
    """`copyback_refusal` against this deployment: its settings, every execution workspace's
    `cwd` of every company and the run directories of every company but `company_id` (the
    run's; None compares no run's directory, for a check of the settings alone). Two queries,
    skipped when the copy-back is off."""
    return copyback_checked_source(source, company_id=company_id)[1]


def copyback_checked_source(
    source: str, *, company_id: UUID | None
) -> tuple[str, CopybackRefusal | None]:
    """`source` resolved once (`realpath`) and the refusal of that very path, as
    `copyback_source_refusal` judges it. The worker copies from the path returned, and from
    nothing that does not lie inside it: resolving the agent's path again later (it may have
    swapped a directory along it for a link since) would judge one directory and copy
    another.

    The other companies' run directories are read in one query (distinct values) and each is
    resolved here: a prefix filter on the stored text would miss a directory recorded through
    a link, and the guard compares where paths point."""
    if not source.startswith("/") or "\x00" in source:
        return source, "not_absolute"
    path = os.path.realpath(source)
    roots = copyback_roots()
    if not roots:
        return path, "copyback_disabled"
    return path, copyback_refusal(
        path,
        roots=roots,
        cwds=execution_workspace_cwds(),
        data_dir=str(settings.DATA_DIR),
        store_dir=str(settings.PAPERCLIP_CAS_DIR),
        other_runs=other_company_run_dirs(company_id) if company_id is not None else (),
        resolved=True,
    )
