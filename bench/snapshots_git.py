"""The git peer of bench/snapshots.py: the same tree and the same change through git.

bench/snapshots.py calls it in each round, alternating with our own runs (ours first in even
rounds, git first in odd ones). Not part of the test suite.

For each variant, in a directory of its own under the round's scratch directory:

- **First run**: a `cp -a` of the tree (untimed, as our workdir's) becomes the worktree of a
  new repository; a bare repository is created beside it (untimed); then timed, each as its
  own process as a user would run it: `git add -A`, `git commit`, `git push` to the bare
  repository, and `git clone file://<bare>` on the other side. `file://` makes the clone go
  through git's pack transport, as from another host; a plain path would hard-link the
  objects, which no remote clone can.
- **Later run**: the same files as our later run get the same 8 bytes appended in the
  worktree, then timed: `git add -A`, `git commit`, `git push`, and `git pull --ff-only` in the
  clone.

The variants:

- `git`: git's defaults (no user or system configuration is read: GIT_CONFIG_GLOBAL=/dev/null,
  GIT_CONFIG_NOSYSTEM=1). Its automatic `gc --auto` (after the commit of 50,000 loose objects,
  and on the receiving side after the push) detaches into the background: the bench waits,
  untimed, until no git process runs in the variant's directory before it times anything else,
  so it never slows the next measurement.
- `git-tuned`: the settings a user would pick for a large tree of incompressible files, passed
  to every git process of the variant (both sides) through GIT_CONFIG_COUNT: TUNED below.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import psutil

# Passed to every git process of the tuned variant (add, commit, push's receive-pack, clone's
# upload-pack, pull): both sides of the transfer.
TUNED: Final = (
    ("feature.manyFiles", "true"),  # index version 4 and the untracked cache
    ("core.untrackedCache", "true"),
    ("gc.auto", "0"),  # no automatic gc after the commit or the push
    ("pack.threads", "0"),  # one delta/pack thread per core (the default's own value, stated)
    ("checkout.workers", "0"),  # parallel checkout in clone and pull, one worker per core
    ("core.compression", "0"),  # the tree's files are random bytes: zlib only costs time
    ("pack.window", "0"),  # no delta search between unrelated random files
)
VARIANTS: Final = ("git", "git-tuned")
IDENTITY: Final = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.invalid",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.invalid",
}


def git_env(variant: str) -> dict[str, str]:
    env = {
        **os.environ,
        **IDENTITY,
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
    }
    if variant == "git-tuned":
        env["GIT_CONFIG_COUNT"] = str(len(TUNED))
        for i, (key, value) in enumerate(TUNED):
            env[f"GIT_CONFIG_KEY_{i}"] = key
            env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env


def tuned_description() -> str:
    return ", ".join(f"{key}={value}" for key, value in TUNED)


@dataclass
class GitFigures:
    """Per variant: each round's total, and each step's times (for the breakdown)."""

    first: list[float] = field(default_factory=list)
    later: list[float] = field(default_factory=list)
    steps: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class GitPeer:
    """One variant's repositories in one round: the worktree, the bare repository, the clone."""

    variant: str
    root: Path
    figures: GitFigures

    @property
    def work(self) -> Path:
        return self.root / "work"

    @property
    def bare(self) -> Path:
        return self.root / "bare.git"

    @property
    def clone(self) -> Path:
        return self.root / "clone"

    def git(self, *args: str, cwd: Path) -> None:
        subprocess.run(
            ["git", *args], cwd=cwd, env=git_env(self.variant), check=True, capture_output=True
        )

    def timed_steps(self, steps: list[tuple[str, Callable[[], None]]]) -> list[float]:
        times = []
        for name, action in steps:
            started = time.perf_counter()
            action()
            took = time.perf_counter() - started
            self.figures.steps.setdefault(name, []).append(took)
            times.append(took)
        self.wait_idle()
        return times

    def wait_idle(self, timeout: float = 600.0) -> None:
        """Until no git process runs in this variant's directories (a detached `gc --auto`)."""
        root = str(self.root)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = False
            for proc in psutil.process_iter(["name", "cwd"]):
                cwd = proc.info.get("cwd") or ""
                if (proc.info.get("name") or "").startswith("git") and cwd.startswith(root):
                    busy = True
                    break
            if not busy:
                return
            time.sleep(0.05)  # a background gc of another process
        raise RuntimeError(f"git still busy in {root} after {timeout:.0f}s")

    def first_run(self, source: Path) -> tuple[float, list[float]]:
        self.root.mkdir()
        subprocess.run(["cp", "-a", source, self.work], check=True)
        self.git("init", "-q", "-b", "main", cwd=self.work)
        self.git("init", "-q", "--bare", "-b", "main", str(self.bare), cwd=self.root)
        self.git("remote", "add", "origin", self.bare.as_uri(), cwd=self.work)
        subprocess.run(["sync"], check=False)
        times = self.timed_steps(
            [
                ("first add", lambda: self.git("add", "-A", cwd=self.work)),
                ("first commit", lambda: self.git("commit", "-q", "-m", "first", cwd=self.work)),
                ("first push", lambda: self.git("push", "-q", "origin", "main", cwd=self.work)),
                (
                    "clone",
                    lambda: self.git(
                        "clone", "-q", self.bare.as_uri(), str(self.clone), cwd=self.root
                    ),
                ),
            ]
        )
        self.figures.first.append(sum(times))
        self.check_same()
        return sum(times), times

    def later_run(self, changed: list[Path]) -> tuple[float, list[float]]:
        for rel in changed:
            with (self.work / rel).open("ab") as handle:
                handle.write(b"changed\n")
        subprocess.run(["sync"], check=False)
        times = self.timed_steps(
            [
                ("later add", lambda: self.git("add", "-A", cwd=self.work)),
                ("later commit", lambda: self.git("commit", "-q", "-m", "later", cwd=self.work)),
                ("later push", lambda: self.git("push", "-q", "origin", "main", cwd=self.work)),
                ("pull", lambda: self.git("pull", "-q", "--ff-only", cwd=self.clone)),
            ]
        )
        self.figures.later.append(sum(times))
        self.check_same()
        return sum(times), times

    def check_same(self) -> None:
        done = subprocess.run(
            ["diff", "-r", "--no-dereference", "--exclude=.git", str(self.work), str(self.clone)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.variant}: the clone differs from the worktree")

    def remove(self) -> None:
        self.wait_idle()
        shutil.rmtree(self.root)


def peers(scratch: Path, n: int, figures: dict[str, GitFigures]) -> list[GitPeer]:
    return [GitPeer(v, scratch / f"{v}-{n}", figures.setdefault(v, GitFigures())) for v in VARIANTS]


def step_line(label: str, total: float, names: list[str], times: list[float]) -> str:
    parts = ", ".join(f"{name.split()[-1]} {t:.2f}" for name, t in zip(names, times, strict=True))
    return f"{label} {total:.2f} s ({parts})"


FIRST_STEPS: Final = ["first add", "first commit", "first push", "clone"]
LATER_STEPS: Final = ["later add", "later commit", "later push", "pull"]


def first_runs(
    peers_: list[GitPeer], source: Path, ours: Callable[[], None], *, ours_first: bool
) -> list[str]:
    """Our first run and each git variant's, in turn (ours first or last): their log lines."""
    lines = []
    if ours_first:
        ours()
    for peer in peers_ if ours_first else reversed(peers_):
        total, times = peer.first_run(source)
        lines.append(step_line(f"{peer.variant} first run:", total, FIRST_STEPS, times))
    if not ours_first:
        ours()
    return lines


def later_runs(
    peers_: list[GitPeer], changed: list[Path], ours: Callable[[], None], *, ours_first: bool
) -> list[str]:
    lines = []
    if ours_first:
        ours()
    for peer in peers_ if ours_first else reversed(peers_):
        total, times = peer.later_run(changed)
        lines.append(step_line(f"{peer.variant} later run:", total, LATER_STEPS, times))
    if not ours_first:
        ours()
    return lines


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


TARGET_VS_GIT: Final = 2.0


def report_lines(
    figures: dict[str, GitFigures], first: list[float], later: list[float]
) -> tuple[list[str], list[tuple[bool, str]]]:
    """The summary's lines for the git peer, and its checks (git's time over ours)."""
    lines = [f"git-tuned settings: {tuned_description()}"]
    checks = []
    for variant in VARIANTS:
        f = figures[variant]
        steps = {name: median(times) for name, times in f.steps.items()}
        lines.append(
            f"{variant}: first run {median(f.first):.2f} s ("
            + ", ".join(f"{name.split()[-1]} {steps[name]:.2f}" for name in FIRST_STEPS)
            + f"); later run {median(f.later):.2f} s ("
            + ", ".join(f"{name.split()[-1]} {steps[name]:.2f}" for name in LATER_STEPS)
            + ")"
        )
        for run, ours, theirs in (("first", first, f.first), ("later", later, f.later)):
            ratio = median(theirs) / median(ours)
            checks.append(
                (
                    ratio >= TARGET_VS_GIT,
                    f"{run} run vs {variant}: {median(ours):.2f} s against"
                    f" {median(theirs):.2f} s, ratio {ratio:.2f} (>= {TARGET_VS_GIT:.1f})",
                )
            )
    return lines, checks
