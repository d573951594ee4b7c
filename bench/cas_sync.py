"""The filesystem store's batch write: one sync per blob against a group's syncs together.

Run with `make bench` (or `.venv/bin/python bench/cas_sync.py`). Not part of the test suite.

A batch upload (`POST /api/cas/batch`, a first run's thousands of files, a later run's changed
files and directories) stores every blob before the transaction that names it commits, and
each must be on disk first: written to a temporary file, synced, renamed into place. Rounds
alternate, on a directory of the machine's disk (not /dev/shm, where a sync costs nothing):

- **one by one** (the baseline, how every batch was written before): `FilesystemBackend.put`
  for each blob, each synced on its own;
- **batched**: `FilesystemBackend.put_many` as shipped: a group of files written, synced
  together (several syncs in flight, which the filesystem's journal commits together), then
  renamed.

It prints the median of each over --rounds (default 5) for --blobs blobs (default 1,000) of
--size bytes (default 8,000), the ratio one by one / batched, and where the files went.
Options: --dir D (default: a temporary directory under /var/tmp), --quick (200 blobs, 2
rounds).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blobs", type=int, default=1_000)
    parser.add_argument("--size", type=int, default=8_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.blobs, args.rounds = 200, 2

    import django
    from django.conf import settings

    django.setup()
    from paperclip.snapshots.store.backends import FilesystemBackend
    from paperclip.snapshots.store.spool import Region

    scratch = Path(tempfile.mkdtemp(prefix="paperclip-cas-sync-", dir=args.dir or "/var/tmp"))  # noqa: S108
    print(f"blobs: {args.blobs:,} of {args.size:,} bytes; store in {scratch} ({_fs(scratch)})")
    backend = FilesystemBackend()
    times: dict[str, list[float]] = {"one by one": [], "batched": []}
    try:
        for round_number in range(args.rounds):
            for mode in times:
                settings.PAPERCLIP_CAS_DIR = scratch / f"{mode.replace(' ', '-')}-{round_number}"
                company = uuid.uuid4()
                blobs = []
                for _ in range(args.blobs):
                    data = os.urandom(args.size)
                    name = f"sha256:{uuid.uuid4().hex}{uuid.uuid4().hex}"  # where, not what
                    blobs.append((0, name, Region(io.BytesIO(data), 0, len(data))))
                started = time.perf_counter()
                if mode == "one by one":
                    for blob_id, name, source in blobs:
                        backend.put(blob_id=blob_id, company_id=company, digest=name, source=source)
                else:
                    backend.put_many(company_id=company, blobs=blobs)
                times[mode].append(time.perf_counter() - started)
            print(
                f"  round {round_number + 1}: one by one {times['one by one'][-1] * 1000:.0f} ms,"
                f" batched {times['batched'][-1] * 1000:.0f} ms"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    one, batched = statistics.median(times["one by one"]), statistics.median(times["batched"])
    print(
        f"one by one {one * 1000:.0f} ms ({one * 1e6 / args.blobs:.0f} us a blob), batched"
        f" {batched * 1000:.0f} ms ({batched * 1e6 / args.blobs:.0f} us a blob):"
        f" ratio {one / batched:.1f}x (medians of {args.rounds})"
    )
    return 0


def _fs(path: Path) -> str:
    """The filesystem type holding `path` (from /proc/mounts: the longest mount point)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


if __name__ == "__main__":
    sys.exit(main())
