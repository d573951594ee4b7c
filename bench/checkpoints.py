"""Checkpoint write cost vs stored size, and 64 KiB parts written and read against raw AES-GCM.

Run with `make bench` (or `.venv/bin/python bench/checkpoints.py`). Not part of the test suite.

It creates a throwaway database (`paperclip_bench_ckpt`, or $PAPERCLIP_BENCH_CKPT_DB) on the
server of $DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres), migrates it,
measures, and drops it at the end, also on failure. In one run:

- the time of one fenced `checkpoint_write` that changes one 1 KiB part, for a run that stores
  1 part and for a run that stores 1,000 parts, interleaved so drift hits both alike; the
  ratio (target <= 1.2) shows a write costs what it changes, not what the run stores;
- 64 KiB parts written (`checkpoint_write`, 64 parts a write: encryption, the fence, the
  upsert, the audit row, commit) and read (`checkpoint_load`: one query, decryption, the
  binding checks) against raw AES-256-GCM (`cryptography`'s AESGCM, a 32-byte key, a fresh
  nonce and associated data per part) of the same contents' bytes, in rounds that alternate
  them so drift hits all alike; the throughput ratio (target >= 0.3 for both); beside them
  PostgreSQL alone storing and reading the same bytes (psycopg, binary), the ceiling;
- the sealing layer alone (`encrypt_part`/`decrypt_part`, no database) for 1 KiB, 64 KiB and
  1 MiB parts, beside raw AES-GCM of the same bytes.

Options: --iterations N (default 300 writes per path; the 64 KiB rounds are N/10, at least 3),
--keep-db.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/postgres"


def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def admin_exec(server_url: str, sql: str) -> None:
    with psycopg.connect(with_database(server_url, "postgres"), autocommit=True) as conn:
        conn.execute(sql)


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--keep-db", action="store_true")
    parser.add_argument("--quick", action="store_true", help="10 iterations: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.iterations = 10

    server = os.environ.get("DATABASE_URL") or DEFAULT_SERVER
    db_name = os.environ.get("PAPERCLIP_BENCH_CKPT_DB", "paperclip_bench_ckpt")
    print(f"bench database {db_name} on {urlsplit(server).hostname}:{urlsplit(server).port}")
    admin_exec(server, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    admin_exec(server, f'CREATE DATABASE "{db_name}"')
    try:
        os.environ["DATABASE_URL"] = with_database(server, db_name)
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "paperclip.settings")
        # A bench is neither manage.py nor pytest: give it a throwaway key.
        os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only")
        # A throwaway key: the bench never touches the data directory's key file.
        from checkpoints.crypto import generate_key_text

        os.environ["PAPERCLIP_CHECKPOINT_KEYS"] = generate_key_text()
        import django

        django.setup()
        from django.core.management import call_command

        print("migrating ...", flush=True)
        call_command("migrate", verbosity=0)
        run_bench(args.iterations)
    finally:
        from django.db import connections

        connections.close_all()
        if args.keep_db:
            print(f"kept database {db_name}")
        else:
            admin_exec(server, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    return 0


def run_bench(iterations: int) -> None:
    from checkpoints.services import (
        CheckpointOwner,
        checkpoint_write,
        controller_lease_acquire,
    )
    from paperclip.models import Agent, Company, HeartbeatRun, Issue, NativeRunFinalization

    company = Company.objects.create(name="bench")
    agent = Agent.objects.create(company=company, name="bench-agent")

    def native_run() -> tuple[HeartbeatRun, CheckpointOwner]:
        issue = Issue.objects.create(company=company, title="bench", status="in_progress")
        run = HeartbeatRun.objects.create(
            company=company,
            agent=agent,
            issue=issue,
            native_issue=issue,
            status="running",
            runtime_mode="native",
        )
        NativeRunFinalization.objects.create(run=run, company=company, issue=issue)
        grant = controller_lease_acquire(
            run_id=run.pk, agent_id=agent.pk, boot_id="bench-boot", ttl_seconds=3600
        )
        owner = CheckpointOwner(
            boot_id="bench-boot", lease_owner=grant.lease_owner, generation=grant.generation
        )
        return run, owner

    def write(run: HeartbeatRun, owner: CheckpointOwner, changed: dict[str, str]) -> None:
        checkpoint_write(
            run_id=run.pk,
            agent_id=agent.pk,
            owner=owner,
            reset=False,
            changed=changed,
            removed=[],
            work_command_ids=["cmd-1"],
            predecessor=None,
        )

    body = "x" * 1024
    small, small_owner = native_run()
    large, large_owner = native_run()
    write(small, small_owner, {"p0": body})
    print("seeding 1,000 parts ...", flush=True)
    for start in range(0, 1000, 250):
        write(large, large_owner, {f"p{i}": body for i in range(start, start + 250)})
    # Warm up both paths (connections, plans, caches) before measuring.
    for _ in range(20):
        write(small, small_owner, {"p0": body})
        write(large, large_owner, {"p0": body})

    small_t: list[float] = []
    large_t: list[float] = []
    for i in range(iterations):
        changed = {"p0": f"{i:08d}" + body[8:]}
        # Alternate the order so neither path always runs first.
        if i % 2:
            small_t.append(timed(lambda c=changed: write(small, small_owner, c)))
            large_t.append(timed(lambda c=changed: write(large, large_owner, c)))
        else:
            large_t.append(timed(lambda c=changed: write(large, large_owner, c)))
            small_t.append(timed(lambda c=changed: write(small, small_owner, c)))

    def ms(values: list[float], q: float) -> float:
        return (
            statistics.quantiles(values, n=100)[int(q) - 1] * 1000
            if q < 100
            else max(values) * 1000
        )

    small_med, large_med = statistics.median(small_t), statistics.median(large_t)
    ratio = large_med / small_med
    print()
    print(f"one changed 1 KiB part per write, {iterations} writes per path")
    print(f"{'stored parts':>12} | {'median ms':>9} | {'p90 ms':>7} | {'writes/s':>8}")
    print(f"{'-' * 12}-+-{'-' * 9}-+-{'-' * 7}-+-{'-' * 8}")
    for label, values, med in (("1", small_t, small_med), ("1,000", large_t, large_med)):
        print(f"{label:>12} | {med * 1000:9.3f} | {ms(values, 90):7.3f} | {1 / med:8.0f}")
    verdict = "OK" if ratio <= 1.2 else "MISSED"
    print(f"ratio 1,000 / 1 (median): {ratio:.3f}  (target <= 1.2: {verdict})")

    fresh, fresh_owner = native_run()  # holds only the 64 KiB parts
    parts_bench(fresh, fresh_owner, write, rounds=max(3, iterations // 10))


def session_text(size: int) -> str:
    """`size` bytes of ASCII shaped like a session log (JSON lines: quotes to escape)."""
    line = '{"type":"assistant","text":"step %06d: ran \\"make test\\", 3 passed"}\n'
    text = "".join(line % i for i in range(size // len(line % 0) + 1))
    return text[:size]


def raw_seal(aead: Any, plaintexts: list[bytes], aad: bytes) -> list[tuple[bytes, bytes]]:
    return [(nonce, aead.encrypt(nonce, p, aad)) for p in plaintexts for nonce in [os.urandom(12)]]


def parts_bench(run: Any, owner: Any, write: Callable[..., None], rounds: int) -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from checkpoints.crypto import Binding
    from checkpoints.selectors import checkpoint_load

    per_write, size = 64, 64 * 1024
    names = [f"part-{i:02d}" for i in range(per_write)]
    contents = {name: session_text(size - 2) + f"{i:02d}" for i, name in enumerate(names)}
    plaintexts = [text.encode() for text in contents.values()]
    aead = AESGCM(os.urandom(32))  # same key size as the checkpoint keys
    aad = b'["paperclip_aes256gcm_v1","company","issue","run","part","keyid"]'
    binding = Binding(run.company_id, run.native_issue_id, run.pk)
    write(run, owner, contents)  # warm-up, and the parts the reads read
    assert checkpoint_load(binding=binding) == contents

    pg = PgBytes(per_write)
    times: dict[str, list[float]] = {
        k: [] for k in ("raw_enc", "raw_dec", "svc_write", "svc_read", "db_write", "db_read")
    }
    try:
        for _ in range(rounds):
            times["raw_enc"].append(timed(lambda: raw_seal(aead, plaintexts, aad)))
            sealed = raw_seal(aead, plaintexts, aad)
            times["db_write"].append(timed(lambda s=sealed: pg.write(s)))
            times["svc_write"].append(timed(lambda: write(run, owner, contents)))
            times["raw_dec"].append(timed(lambda s=sealed: [aead.decrypt(n, c, aad) for n, c in s]))
            times["db_read"].append(timed(pg.read))
            times["svc_read"].append(timed(lambda: checkpoint_load(binding=binding)))
    finally:
        pg.close()
    print_parts_table(times, per_write=per_write, size=size, rounds=rounds)
    sealing_bench(binding, aead, aad, size)


class PgBytes:
    """PostgreSQL alone: the same bytes upserted (bound server-side, in binary) and committed,
    then read back in binary, on a connection of its own: the ceiling for the service."""

    def __init__(self, per_write: int) -> None:
        self.pg = psycopg.connect(os.environ["DATABASE_URL"])
        self.pg.execute("CREATE TEMP TABLE bench_bytes (id int PRIMARY KEY, b bytea NOT NULL)")
        self.upsert = (
            "INSERT INTO bench_bytes (id, b) VALUES "
            + ", ".join(["(%s, %b)"] * per_write)
            + " ON CONFLICT (id) DO UPDATE SET b = EXCLUDED.b"
        )

    def write(self, sealed: list[tuple[bytes, bytes]]) -> None:
        self.pg.execute(self.upsert, [v for i, (_, box) in enumerate(sealed) for v in (i, box)])
        self.pg.commit()

    def read(self) -> None:
        self.pg.cursor(binary=True).execute("SELECT id, b FROM bench_bytes ORDER BY id").fetchall()
        self.pg.commit()

    def close(self) -> None:
        self.pg.close()


def print_parts_table(
    times: dict[str, list[float]], *, per_write: int, size: int, rounds: int
) -> None:
    mib = per_write * size / (1024 * 1024)

    def rate(values: list[float]) -> float:
        return mib / statistics.median(values)

    print()
    print(f"64 KiB parts, {per_write} a write or read, {rounds} rounds (median MiB/s of contents)")
    header = (
        "operation",
        "service",
        "raw AES-GCM",
        "ratio",
        "target >= 0.3",
        "PostgreSQL",
        "ratio",
    )
    widths = (9, 8, 11, 6, 13, 10, 6)
    print(" | ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for label, service, raw, db in (
        ("write", times["svc_write"], times["raw_enc"], times["db_write"]),
        ("read", times["svc_read"], times["raw_dec"], times["db_read"]),
    ):
        ratio = rate(service) / rate(raw)
        verdict = "OK" if ratio >= 0.3 else "MISSED"
        print(
            f"{label:>9} | {rate(service):8.1f} | {rate(raw):11.1f} | {ratio:6.3f} | "
            f"{verdict:>13} | {rate(db):10.1f} | {rate(service) / rate(db):6.3f}"
        )
    print(
        "(PostgreSQL: the same bytes upserted and committed, or selected, by psycopg alone; "
        "its ratio is service / PostgreSQL)"
    )


def sealing_bench(binding: Any, aead: Any, aad: bytes, size: int) -> None:
    """The sealing layer alone (no database) for 1 KiB, `size` and 1 MiB parts, beside raw
    AES-GCM of the same bytes."""
    from checkpoints.crypto import decrypt_part, encrypt_part, keyring

    print()
    print("sealing alone (encrypt_part / decrypt_part: envelope and binding, no database)")
    ring = keyring()
    key = ring.primary
    header = ("part size", "seal MiB/s", "raw enc MiB/s", "open MiB/s", "raw dec MiB/s")
    print(" | ".join(f"{h:>{w}}" for h, w in zip(header, (9, 10, 13, 10, 13), strict=True)))
    print(f"{'-' * 9}-+-{'-' * 10}-+-{'-' * 13}-+-{'-' * 10}-+-{'-' * 13}")
    for label, nbytes in (("1 KiB", 1024), ("64 KiB", size), ("1 MiB", 1024 * 1024)):
        text = session_text(nbytes)
        data = [text.encode()]
        n = max(20, min(5000, (64 * 1024 * 1024) // nbytes))
        part = encrypt_part(binding, "p", text, key)
        nonce, box = raw_seal(aead, data, aad)[0]
        enc = timed(lambda t=text, n=n: [encrypt_part(binding, "p", t, key) for _ in range(n)])
        raw_e = timed(lambda d=data, n=n: [raw_seal(aead, d, aad) for _ in range(n)])
        dec = timed(lambda m=part, n=n: [decrypt_part(binding, "p", m, ring) for _ in range(n)])
        raw_d = timed(lambda x=nonce, b=box, n=n: [aead.decrypt(x, b, aad) for _ in range(n)])
        total = n * nbytes / (1024 * 1024)
        print(
            f"{label:>9} | {total / enc:10.1f} | {total / raw_e:13.1f} | "
            f"{total / dec:10.1f} | {total / raw_d:13.1f}"
        )


if __name__ == "__main__":
    sys.exit(main())
