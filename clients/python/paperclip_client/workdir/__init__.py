"""A run's workdir as a snapshot tree: scan and upload after the command, check out before.

State of the client, in `<workdir>/.paperclip/` (never snapshotted, never touched by checkout):

- `index.json`: a header line `{"version": 3, "id", "tree": <the tree the workdir last held, or
  null>, "server", "workspace", "count", "bytes", "newest_ns", "crc", "racy_ns"?}`, then the
  stat cache, a line a file, `<path as JSON>\t[size, mtime_ns, mode, ino, digest or [chunks],
  ctime_ns]`, sorted (`count` rows, `bytes` the sum of their sizes, `newest_ns` not older than
  their largest mtime, `crc` the CRC-32 of the lines: `rowlines`), written atomically
  (temporary file + rename) once a checkout or a snapshot is complete. Only the header is
  parsed when the file is read; a row is looked up in the lines when wanted, and a partial
  scan's changes are put into a copy of them (a run that changed nothing never parses them,
  one that changed some files only theirs). Versions 2 (the rows one object) and 1 (one
  object with the rows as "files") are still read. It is a stat
  cache, as git's index: a file whose size, mtime, mode, inode and ctime match its entry is
  not read again, unless its mtime is not older than the start of the scan that wrote the
  index (`racy_ns`, the filesystem's clock read through `stamp`; else the index file's own
  mtime): a "racily clean" entry, re-hashed; `newest_ns` says whether there is one. A missing
  or unreadable index means: hash everything, the last-held tree is empty; rows that cannot
  be parsed, only that every file is hashed again.
- `stamp`: written at each snapshot's start, to read the filesystem's clock.
- `dirs.json`: the directory blobs of the last-held tree (a header line `{"version": 2,
  "tree"}`, then `<name>\t<blob>` a line; version 1, `{"tree", "dirs": {name: text}}`, is
  still read), so that a checkout knows what the workdir last held without asking the server.
- `checkout.json`: present while a checkout writes (the head, the trees of earlier checkouts
  killed since the index was saved, the directories it writes into, and, once it starts
  removing, the paths it removes: a path missing from the workdir counts as a killed
  checkout's removal only if named there, else it is the agent's deletion); the next checkout
  first removes the temporary files it left (`.paperclip-tmp-` and 32 hex digits, none a
  tree names: a file of the agent's that only starts so is kept), and undoes what the killed
  ones wrote where the new head differs.

`.paperclipignore` at the workdir's root (gitignore syntax) keeps paths out of snapshots;
`.paperclip/` is always left out. Symlinks are recorded as symlinks, never followed; one whose
target is absolute or leaves the workdir is left out with a warning, as are names that are not
UTF-8 and special files (fifos, sockets, devices).

The package, by step: `scanning` (the workdir read into a tree), `uploading` (a snapshot: scan,
upload what the store lacks, record it), `checking_out` (a head made the workdir's) with
`writer` (what checkout does to each path), `index` (the files in `.paperclip/`), `transfer`
(the store's interface, progress, parallel jobs) and `errors`. The names below are the API.
"""

from __future__ import annotations

from paperclip_client.cas import TRANSFER_THREADS, BatchFrame
from paperclip_client.trees import EMPTY_DIR, MAX_NAME_BYTES
from paperclip_client.workdir.checking_out import CheckoutResult, checkout, iter_names, read_tree
from paperclip_client.workdir.errors import LocalChanges, WorkdirChanged, WorkdirError
from paperclip_client.workdir.index import (
    DIRS,
    INDEX,
    INDEX_VERSION,
    JOURNAL,
    STATE_DIR,
    Index,
    Rows,
    Stat,
    load_index,
    save_state,
    stored_by_index,
)
from paperclip_client.workdir.scanning import (
    IGNORE_FILE,
    MAX_DEPTH,
    PIECE,
    Scan,
    build,
    hash_fd,
    load_ignore,
    scan,
)
from paperclip_client.workdir.transfer import (
    PROGRESS_EVERY,
    SMALL_BLOB,
    ClientStore,
    Limits,
    Progress,
    Say,
    Store,
    run_parallel,
)
from paperclip_client.workdir.uploading import (
    SnapshotResult,
    commit_snapshot,
    drop_state,
    snapshot,
    upload,
)
from paperclip_client.workdir.writer import TMP_PREFIX

__all__ = [
    "DIRS",
    "EMPTY_DIR",
    "IGNORE_FILE",
    "INDEX",
    "INDEX_VERSION",
    "JOURNAL",
    "MAX_DEPTH",
    "MAX_NAME_BYTES",
    "PIECE",
    "PROGRESS_EVERY",
    "SMALL_BLOB",
    "STATE_DIR",
    "TMP_PREFIX",
    "TRANSFER_THREADS",
    "BatchFrame",
    "CheckoutResult",
    "ClientStore",
    "Index",
    "Limits",
    "LocalChanges",
    "Progress",
    "Rows",
    "Say",
    "Scan",
    "SnapshotResult",
    "Stat",
    "Store",
    "WorkdirChanged",
    "WorkdirError",
    "build",
    "checkout",
    "commit_snapshot",
    "drop_state",
    "hash_fd",
    "iter_names",
    "load_ignore",
    "load_index",
    "read_tree",
    "run_parallel",
    "save_state",
    "scan",
    "snapshot",
    "stored_by_index",
    "upload",
]
