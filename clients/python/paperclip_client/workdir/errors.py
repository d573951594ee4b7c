"""What goes wrong with a workdir: it cannot be snapshotted or checked out as asked.

The classes live in `paperclip_client.errors`, so that the CLI can catch them without loading
the workdir's modules before its first request (issue #42); this module keeps their names.
"""

from __future__ import annotations

from paperclip_client.errors import LocalChanges, WorkdirChanged, WorkdirError

__all__ = ["LocalChanges", "WorkdirChanged", "WorkdirError"]
