"""`make mutate`: mutmut over the safety-critical modules, one module group at a time.

    scripts/mutate.py [GROUP ...] [--tests-at REV] [--work DIR] [--resume] [--rerun-survivors]
                      [--only PATTERN ...] [--report-only]

For each group (default: all of them, in the order below) it copies the work tree (tracked and
untracked-but-not-ignored files) into DIR/GROUP, appends that group's [tool.mutmut] section to
the copy's pyproject.toml (only its modules are mutated, only its test files are run, and
mutmut's own coverage map then runs each mutant against just the tests that reach the mutated
function), runs `mutmut run --max-children 1` there (one test process at a time: the tests
share one PostgreSQL test database), and prints the figures and every surviving mutant's
diff. `--tests-at REV` takes tests/ from that commit instead: the "before" figures.

A long run can be taken in parts. `--resume` keeps DIR/GROUP and the verdicts mutmut stored in
its mutants/ (it saves each one as it is reached), copies the work tree over it again and runs
mutmut there: only the mutants without a verdict are tested, plus those of functions whose code
changed, and tests new since the last run are mapped first. `--only PATTERN ...` (implies
--resume) tests only the mutants without a verdict whose names match (globs, e.g.
`'checkpoints.services.writer.*'`): two copies of one group, each with its own test database,
can then share a run that waits more than it computes. On a copy with no verdicts yet, `--only`
starts a fresh run of just the matching mutants. `--rerun-survivors` (implies --resume)
tests the last run's survivors again against the current tests, with `--only` just the
matching ones: the "after" figures.
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = Path(sys.executable).with_name("mutmut")


@dataclass(frozen=True)
class Group:
    modules: tuple[str, ...]
    tests: tuple[str, ...]


GROUPS: dict[str, Group] = {
    # The lease fence (row locks, share lock) and the stale verdict.
    "leases": Group(
        modules=("leases/locks.py", "leases/selectors.py", "leases/services/operations.py"),
        tests=(
            "tests/leases/test_claim.py",
            "tests/leases/test_fence.py",
            "tests/leases/test_concurrency.py",
            "tests/leases/test_owner_eligibility.py",
            "tests/leases/test_sweep.py",
            "tests/leases/api/",
        ),
    ),
    # Finalization ownership (advisory lock, receipt compare-and-swap) and owner-stop admission.
    "recovery": Group(
        modules=(
            "recovery/services/ownership/acquire.py",
            "recovery/services/ownership/lock_connection.py",
            "recovery/services/ownership/memory.py",
            "recovery/services/ownership/owner_hold.py",
            "recovery/services/ownership/prior_owner.py",
            "recovery/services/ownership/receipt_claim.py",
            "recovery/services/ownership/receipt_release.py",
            "recovery/services/ownership/task_current.py",
            "recovery/services/owner_stop.py",
            "recovery/takeover.py",
        ),
        # Not tests/recovery/api, processes, adapters: on this 2-core machine they would
        # triple the run; the services and the source selector reach every function here.
        tests=(
            "tests/recovery/services/",
            "tests/recovery/selectors/",
            "tests/recovery/test_takeover.py",
        ),
    ),
    # The checkpoint fence (coordinator lock, writer owner check) and the crypto binding.
    "checkpoints": Group(
        modules=("checkpoints/locks.py", "checkpoints/services/writer.py", "checkpoints/crypto.py"),
        tests=("tests/checkpoints/",),
    ),
    # The environment-lease cleanup protocol.
    "cleanup": Group(
        modules=("leases/environment/services.py",),
        tests=("tests/leases/environment/",),
    ),
}

PYTEST_ARGS = ("-p", "no:randomly", "-m", "not slow", "-q")

# Functions that run only while their module is imported (they build SQL text into module
# constants): mutmut switches mutants per call, after the import, so their mutants can never be
# exercised and always "survive". They are mutated by hand instead (docs/testing.md).
IMPORT_TIME = (
    "checkpoints.locks.x__owner_lock_sql",
    "checkpoints.locks.x__coordinator_lock_sql",
    "checkpoints.locks.x__where",
    "checkpoints.locks.x__column",
    "leases.selectors.x_owner_stale_reason_sql",
    "leases.selectors.x__sql_literals",
)


def category(mutant: str, before: str, after: str) -> str:
    """A first sorting of a survivor by the shape of its change (docs/testing.md says what each
    means); `review` is everything this cannot sort."""
    if mutant.startswith(IMPORT_TIME):
        return "import-time"
    if "cast(" in before:
        return "typing.cast"
    if before.lower() == after.lower() or ("XX" in after and after.replace("XX", "") == before):
        return "string text"
    if "output_field" in before:
        return "output_field"
    if "raise " in before or "Error(" in before or "logger." in before:
        return "message"
    return "review"


def _toml_list(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def _copy_tree(dest: Path, tests_at: str | None, *, keep: bool = False) -> None:
    if dest.exists() and not keep:
        shutil.rmtree(dest)
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            target = dest / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if tests_at is not None:
        shutil.rmtree(dest / "tests", ignore_errors=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", tests_at, "tests"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        ).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")


def _configure(dest: Path, group: Group) -> None:
    section = (
        "\n[tool.mutmut]\n"
        'source_paths = ["leases/", "recovery/", "checkpoints/", "paperclip/"]\n'
        'also_copy = ["manage.py", "templates/", "docs/"]\n'
        f"only_mutate = {_toml_list(group.modules)}\n"
        f"pytest_add_cli_args = {_toml_list(PYTEST_ARGS)}\n"
        f"pytest_add_cli_args_test_selection = {_toml_list(group.tests)}\n"
    )
    with (dest / "pyproject.toml").open("a") as fh:
        fh.write(section)


def _mutmut(dest: Path, *args: str, capture: bool = False) -> str:
    done = subprocess.run(
        [str(MUTMUT), *args], cwd=dest, check=True, text=True, capture_output=capture
    )
    return done.stdout if capture else ""


def _statuses(dest: Path) -> list[tuple[str, str]]:
    """Every mutant of the copy and its status (`killed`, `survived`, `not checked`, ...)."""
    rows = []
    for line in _mutmut(dest, "results", "--all", "true", capture=True).splitlines():
        mutant, _, status = line.strip().rpartition(": ")
        rows.append((mutant, status))
    return rows


def _survivors(dest: Path) -> list[str]:
    return [mutant for mutant, status in _statuses(dest) if status == "survived"]


def run_group(
    name: str,
    group: Group,
    work: Path,
    tests_at: str | None,
    *,
    resume: bool = False,
    rerun_survivors: bool = False,
    only: tuple[str, ...] = (),
) -> dict[str, int]:
    dest = work / name
    # --only on a copy with no verdicts yet starts a fresh run of just the matching mutants.
    fresh_only = bool(only) and not rerun_survivors and not (dest / "mutants").is_dir()
    resume = (resume or rerun_survivors or bool(only)) and not fresh_only
    if resume and not (dest / "mutants").is_dir():
        raise SystemExit(f"mutate: nothing to resume in {dest}")
    _copy_tree(dest, tests_at, keep=resume)
    _configure(dest, group)
    print(f"== {name}: mutating {', '.join(group.modules)}", flush=True)

    def matching(wanted: str) -> tuple[str, ...]:
        return tuple(
            m
            for m, status in _statuses(dest)
            if status == wanted and any(fnmatch.fnmatchcase(m, p) for p in only or ("*",))
        )

    # mutmut re-tests every mutant it is given by name, and only those: name just the ones
    # wanted (with --only and --rerun-survivors, only the matching survivors).
    passes: list[tuple[str, ...]]
    if rerun_survivors:
        passes = [matching("survived")]
    elif fresh_only:
        passes = [only]  # mutmut matches the globs itself
    elif only:
        passes = [matching("not checked")]
    else:
        passes = [()]
    passes = [names for names in passes if names or not (only or rerun_survivors)]
    # mutmut redraws a progress line many times a second: keep it out of the log.
    with (dest / "mutmut-run.log").open("a" if resume else "w") as log:
        for names in passes:
            subprocess.run(
                [str(MUTMUT), "run", "--max-children", "1", *names],
                cwd=dest,
                check=True,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    stats = report_figures(dest)
    for mutant in _survivors(dest):
        report_survivor(dest, mutant)
    return stats


def report_figures(dest: Path) -> dict[str, int]:
    """Print the group's figures, then one line per module (a partial run differs by module);
    return the group's."""
    by_module: dict[str, Counter[str]] = {}
    for mutant, status in _statuses(dest):
        module = mutant.rsplit(".", 1)[0]
        by_module.setdefault(module, Counter())[status] += 1
    total: Counter[str] = sum(by_module.values(), Counter())
    for label, counts in [("", total), *sorted(by_module.items())]:
        print(
            f"   {label + ': ' if label else ''}{counts.total()} mutants: "
            f"{counts['killed']} killed, {counts['survived']} survived, "
            f"{counts['no tests']} reached by no selected test, {counts['timeout']} timed out, "
            f"{counts['suspicious']} suspicious, {counts['not checked']} not run",
            flush=True,
        )
    return {
        "total": total.total(),
        "killed": total["killed"],
        "survived": total["survived"],
        "no_tests": total["no tests"],
        "timeout": total["timeout"],
        "suspicious": total["suspicious"],
        "not_run": total["not checked"],
    }


def report_survivor(dest: Path, mutant: str) -> None:
    try:
        diff = _mutmut(dest, "show", mutant, capture=True)
    except subprocess.CalledProcessError:  # a run still writing that module's files
        print(f"   survived [?] {mutant} (diff not readable now; run --report-only again)")
        return
    before = " ".join(d[2:].strip() for d in diff.splitlines() if d.startswith("- "))
    after = " ".join(d[2:].strip() for d in diff.splitlines() if d.startswith("+ "))
    print(f"   survived [{category(mutant, before, after)}] {mutant}", flush=True)
    print(f"      - {before}", flush=True)
    print(f"      + {after}", flush=True)


def report_only(name: str, dest: Path) -> dict[str, int]:
    print(f"== {name}", flush=True)
    stats = report_figures(dest)
    for mutant in _survivors(dest):
        report_survivor(dest, mutant)
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", help=f"some of: {', '.join(GROUPS)} (default all)")
    parser.add_argument("--tests-at", help="take tests/ from this commit (before figures)")
    parser.add_argument("--work", type=Path, default=ROOT / ".mutate")
    parser.add_argument(
        "--report-only", action="store_true", help="only report the last run in --work"
    )
    parser.add_argument(
        "--resume", action="store_true", help="go on with the last run in --work (its verdicts)"
    )
    parser.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="resume, then test the last run's survivors again against the current tests",
    )
    parser.add_argument(
        "--only", nargs="+", default=(), metavar="PATTERN", help="only these mutants (globs)"
    )
    options = parser.parse_args()
    if not os.environ.get("DATABASE_URL"):
        print("mutate: set DATABASE_URL to a PostgreSQL server, as for the tests", file=sys.stderr)
        return 2
    os.environ.setdefault("PAPERCLIP_TEST_DATABASE_NAME", "test_paperclip_mutate")
    unknown = [g for g in options.groups if g not in GROUPS]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {list(GROUPS)}")
    totals: dict[str, int] = {}
    for name in options.groups or GROUPS:
        work = options.work.resolve()
        if options.report_only:
            stats = report_only(name, work / name)
        else:
            stats = run_group(
                name,
                GROUPS[name],
                work,
                options.tests_at,
                resume=options.resume,
                rerun_survivors=options.rerun_survivors,
                only=tuple(options.only),
            )
        for key in ("total", "killed", "survived", "no_tests", "timeout", "suspicious", "not_run"):
            totals[key] = totals.get(key, 0) + stats[key]
    print(f"== all: {json.dumps(totals)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
