"""What goes wrong with a workdir: it cannot be snapshotted or checked out as asked."""

from __future__ import annotations

from collections.abc import Sequence

from paperclip_client.errors import PaperclipError


class WorkdirError(PaperclipError):
    """The workdir cannot be snapshotted or checked out as asked."""


class WorkdirChanged(WorkdirError):
    """A file changed while it was being snapshotted."""


class LocalChanges(WorkdirError):
    """Checkout would overwrite or delete local work: `paths` (every one; the message names
    up to 20) differ from both the head and the tree the workdir last held."""

    def __init__(self, paths: Sequence[str]) -> None:
        shown = ", ".join(paths[:20]) + (
            f" (and {len(paths) - 20} more)" if len(paths) > 20 else ""
        )
        super().__init__(
            f"{len(paths)} path(s) in the workdir hold local changes that checkout would"
            f" overwrite: {shown}; keep them elsewhere or pass --discard-local-changes"
        )
        self.paths = list(paths)
