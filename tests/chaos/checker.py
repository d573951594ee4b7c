"""The chaos run's checker: a pure function of the agents' histories, the faults log and a
final read of the database. No I/O here, so the unit tests can feed it corrupted histories.

History records (tests/chaos/agent.py) carry `op` (claim, write, release, issue_get,
issue_reopen, start), `ws`, `owner_key` (`issue:<id>` of the requester), `t0`/`t1` (the
system-wide monotonic clock before the request and after the response), `status` (None: no
answer), `body`, and for writes `generation`. Fault records (tests/chaos/nemesis.py) carry
`kind` and `t` (monotonic), and `t_end` for faults that last.

Rules (each violation names its rule and quotes the records that show it):

- `generation_two_owners`: one (workspace, generation) reported held by two owner keys.
  Evidence: successful claims (the requester and the lease it got), accepted writes, the
  holders named in 409 conflict/superseded details, the audit rows of creates and reclaims,
  the recorded operations and the leases left at the end.
- `stale_write_accepted`: a fenced write answered 201 at generation g although a newer
  generation g' > g of that workspace had committed before the write was sent: some claim
  response carrying g' had ended (`t1`) before the write's request started (`t0`). Requests
  in flight across the reclaim never count, so an overlap cannot be a false positive.
- `generation_not_increasing`: two creates/reclaims of one workspace handed out the same
  generation, or one that finished before another started got a generation that is not
  smaller; also duplicate generations among the audit rows of creates and reclaims, or a
  workspace counter below a generation it handed out.
- `acknowledged_claim_lost` / `acknowledged_write_lost`: a create/reclaim answered 200 has no
  audit row with that generation and owner key; an operation answered 201 is not in the
  database.
- `unexplained_5xx`: a 5xx whose request does not overlap the window of a server-side fault
  (`pg_terminate`, `kill_worker`, `failover`, `cut_node`: from the fault until
  `fault_window` seconds after it ends).
- `server_unhealthy`: `/healthz` did not answer 200 at the end.

The checker does not rely on the rule that refuses claims and writes of an owner whose own
issue or run is no longer eligible: whether the server has it or not, every 409 is an
ordinary outcome.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVER_FAULTS = frozenset({"pg_terminate", "kill_worker", "failover", "cut_node"})
ACQUIRED = frozenset({"created", "reclaimed"})
HOLDING = frozenset({"created", "reclaimed", "renewed"})
MAX_EVIDENCE = 6


@dataclass(frozen=True)
class Violation:
    rule: str
    message: str
    evidence: tuple[dict[str, Any], ...] = ()

    def render(self) -> str:
        lines = [f"[{self.rule}] {self.message}"]
        lines += [
            f"    {json.dumps(record, sort_keys=True, default=str)}" for record in self.evidence
        ]
        return "\n".join(lines)


@dataclass
class Report:
    violations: list[Violation] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_rule(self) -> Counter[str]:
        return Counter(v.rule for v in self.violations)


# --- reading the logs ------------------------------------------------------------------------


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The records of one JSONL file and the number of unreadable lines (a process killed with
    SIGKILL mid-write may leave a torn last line)."""
    records: list[dict[str, Any]] = []
    torn = 0
    if not path.exists():
        return records, torn
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            torn += 1
    return records, torn


# --- helpers -----------------------------------------------------------------------------------


def _error(record: dict[str, Any]) -> dict[str, Any] | None:
    body = record.get("body")
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body["error"]
    return None


def _code(record: dict[str, Any]) -> str | None:
    error = _error(record)
    return None if error is None else error.get("code")


def _lease(record: dict[str, Any]) -> dict[str, Any] | None:
    """The lease of a successful claim, or None."""
    if record.get("op") != "claim" or record.get("status") != 200:
        return None
    body = record.get("body")
    if not isinstance(body, dict) or body.get("outcome") not in HOLDING:
        return None
    lease = body.get("lease")
    return lease if isinstance(lease, dict) else None


def _short(record: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "source",
        "agent",
        "pid",
        "seq",
        "op",
        "ws",
        "owner_key",
        "generation",
        "probe",
        "t0",
        "t1",
        "status",
        "fault",
        "kind",
        "t",
        "t_end",
    )
    short = {k: record[k] for k in keep if k in record}
    body = record.get("body")
    if isinstance(body, dict):
        if "outcome" in body:
            short["outcome"] = body["outcome"]
        if isinstance(body.get("lease"), dict):
            short["lease"] = {
                k: body["lease"].get(k) for k in ("owner_key", "generation", "expires_at")
            }
        if "lease_generation" in body:
            short["lease_generation"] = body["lease_generation"]
        if (error := _error(record)) is not None:
            details = error.get("details") or {}
            short["error"] = {
                "code": error.get("code"),
                **{
                    k: details[k]
                    for k in ("owner_key", "generation", "current_generation")
                    if k in details
                },
            }
    elif record.get("error"):
        short["error"] = record["error"]
    return short


def _observations(
    histories: list[dict[str, Any]], final: dict[str, Any]
) -> Iterator[tuple[str, int, str, dict[str, Any]]]:
    """Every (workspace, generation, owner key) that something reported as holding."""
    for r in histories:
        ws, status = r.get("ws"), r.get("status")
        if ws is None:
            continue
        if (lease := _lease(r)) is not None:
            yield ws, int(lease["generation"]), str(lease["owner_key"]), r
            if r.get("owner_key"):
                yield ws, int(lease["generation"]), str(r["owner_key"]), r
        elif r.get("op") == "write" and status == 201 and r.get("owner_key"):
            body = r.get("body") if isinstance(r.get("body"), dict) else {}
            generation = body.get("lease_generation", r.get("generation"))
            yield ws, int(generation), str(r["owner_key"]), r
            if r.get("generation") is not None and int(r["generation"]) != int(generation):
                yield ws, int(r["generation"]), str(r["owner_key"]), r
        elif status == 409 and (error := _error(r)) is not None:
            details = error.get("details") or {}
            code = error.get("code")
            if code == "workspace_runtime_lease_conflict" and details.get("owner_key"):
                yield ws, int(details["generation"]), str(details["owner_key"]), r
            elif (
                code == "workspace_runtime_lease_superseded"
                and details.get("owner_key")
                and details.get("current_generation") is not None
            ):
                yield ws, int(details["current_generation"]), str(details["owner_key"]), r
    for row in final.get("audit", []):
        yield row["ws"], int(row["generation"]), str(row["owner_key"]), {"source": "audit", **row}
    for row in final.get("operations", []):
        if row.get("issue_id"):
            owner = f"issue:{row['issue_id']}"
            yield row["ws"], int(row["generation"]), owner, {"source": "operations", **row}
    for row in final.get("leases", []):
        yield row["ws"], int(row["generation"]), str(row["owner_key"]), {"source": "lease", **row}


# --- the rules ---------------------------------------------------------------------------------


def _rule_two_owners(histories: list[dict[str, Any]], final: dict[str, Any]) -> list[Violation]:
    owners: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for ws, generation, owner, record in _observations(histories, final):
        owners[(ws, generation)].setdefault(owner, record)
    return [
        Violation(
            "generation_two_owners",
            f"workspace {ws} generation {generation} reported held by {len(by_owner)} owner keys:"
            f" {', '.join(sorted(by_owner))}",
            tuple(_short(r) for r in list(by_owner.values())[:MAX_EVIDENCE]),
        )
        for (ws, generation), by_owner in sorted(owners.items())
        if len(by_owner) > 1
    ]


def _commits_by_ws(histories: list[dict[str, Any]]) -> dict[str, list[tuple[float, int, int]]]:
    """Per workspace, (response end, generation, index) of every claim answered with a lease:
    proof that the generation had committed by then. Sorted by response end."""
    out: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
    for index, r in enumerate(histories):
        if (lease := _lease(r)) is not None and r.get("t1") is not None:
            out[r["ws"]].append((float(r["t1"]), int(lease["generation"]), index))
    for items in out.values():
        items.sort()
    return out


def _prefix_max(items: list[tuple[float, int, int]]) -> list[tuple[int, int]]:
    """(max generation, index of its record) over items[:k+1], for every k."""
    best: list[tuple[int, int]] = []
    for _, generation, index in items:
        if not best or generation > best[-1][0]:
            best.append((generation, index))
        else:
            best.append(best[-1])
    return best


def _rule_stale_write(histories: list[dict[str, Any]]) -> list[Violation]:
    commits = _commits_by_ws(histories)
    ends = {ws: [t for t, _, _ in items] for ws, items in commits.items()}
    best = {ws: _prefix_max(items) for ws, items in commits.items()}
    violations = []
    for r in histories:
        if r.get("op") != "write" or r.get("status") != 201 or r.get("ws") not in commits:
            continue
        ws, generation = r["ws"], int(r["generation"])
        k = bisect.bisect_left(ends[ws], float(r["t0"]))  # commits that ended before t0
        if k == 0:
            continue
        newest, index = best[ws][k - 1]
        if newest > generation:
            violations.append(
                Violation(
                    "stale_write_accepted",
                    f"write at generation {generation} on workspace {ws} accepted although"
                    f" generation {newest} had committed before it was sent",
                    (_short(histories[index]), _short(r)),
                )
            )
    return violations


def _rule_generations(histories: list[dict[str, Any]], final: dict[str, Any]) -> list[Violation]:
    violations = []
    acquired: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in histories:
        lease = _lease(r)
        if lease is not None and r["body"]["outcome"] in ACQUIRED and r.get("t0") is not None:
            acquired[r["ws"]].append(r)
    for ws, records in sorted(acquired.items()):
        seen: dict[int, dict[str, Any]] = {}
        for r in records:
            generation = int(r["body"]["lease"]["generation"])
            if generation in seen:
                violations.append(
                    Violation(
                        "generation_not_increasing",
                        f"workspace {ws}: generation {generation} handed out twice",
                        (_short(seen[generation]), _short(r)),
                    )
                )
            seen.setdefault(generation, r)
        # An acquisition that ended before another started must have the smaller generation.
        by_end = sorted(
            (float(r["t1"]), int(r["body"]["lease"]["generation"]), i)
            for i, r in enumerate(records)
        )
        ends = [t for t, _, _ in by_end]
        best = _prefix_max(by_end)
        for r in records:
            k = bisect.bisect_left(ends, float(r["t0"]))
            if k == 0:
                continue
            newest, index = best[k - 1]
            if newest >= int(r["body"]["lease"]["generation"]):
                violations.append(
                    Violation(
                        "generation_not_increasing",
                        f"workspace {ws}: generation {r['body']['lease']['generation']} handed"
                        f" out after generation {newest} had been",
                        (_short(records[index]), _short(r)),
                    )
                )
    audit_seen: dict[tuple[str, int], dict[str, Any]] = {}
    top: dict[str, int] = {}
    for row in final.get("audit", []):
        key = (row["ws"], int(row["generation"]))
        if key in audit_seen:
            violations.append(
                Violation(
                    "generation_not_increasing",
                    f"workspace {key[0]}: generation {key[1]} has two create/reclaim audit rows",
                    ({"source": "audit", **audit_seen[key]}, {"source": "audit", **row}),
                )
            )
        audit_seen.setdefault(key, row)
        top[row["ws"]] = max(top.get(row["ws"], 0), key[1])
    for ws, counter in sorted(final.get("workspaces", {}).items()):
        if counter < top.get(ws, 0):
            violations.append(
                Violation(
                    "generation_not_increasing",
                    f"workspace {ws}: counter {counter} is below generation {top[ws]} handed out",
                )
            )
    return violations


def _rule_acknowledged(histories: list[dict[str, Any]], final: dict[str, Any]) -> list[Violation]:
    if "audit" not in final:
        return []
    violations = []
    audit = {(row["ws"], int(row["generation"]), row["owner_key"]) for row in final["audit"]}
    operations = {str(row["id"]) for row in final.get("operations", [])}
    for r in histories:
        lease = _lease(r)
        if lease is not None and r["body"]["outcome"] in ACQUIRED:
            key = (r["ws"], int(lease["generation"]), lease["owner_key"])
            if key not in audit:
                violations.append(
                    Violation(
                        "acknowledged_claim_lost",
                        f"{r['body']['outcome']} claim of workspace {key[0]} generation {key[1]}"
                        " has no audit row",
                        (_short(r),),
                    )
                )
        elif r.get("op") == "write" and r.get("status") == 201 and "operations" in final:
            body = r.get("body") if isinstance(r.get("body"), dict) else {}
            if str(body.get("id")) not in operations:
                violations.append(
                    Violation(
                        "acknowledged_write_lost",
                        f"operation {body.get('id')} answered 201 is not in the database",
                        (_short(r),),
                    )
                )
    return violations


def fault_windows(faults: list[dict[str, Any]], window: float) -> list[tuple[float, float]]:
    return sorted(
        (float(f["t"]), float(f.get("t_end") or f["t"]) + window)
        for f in faults
        if f.get("kind") in SERVER_FAULTS
    )


def in_window(record: dict[str, Any], windows: list[tuple[float, float]]) -> bool:
    """The request overlaps a fault window (it was sent before the window closed and its
    answer came after the window opened)."""
    t0 = float(record.get("t0", 0.0))
    t1 = float(record.get("t1", t0))
    return any(start <= t1 and t0 <= end for start, end in windows)


def _rule_5xx(
    histories: list[dict[str, Any]], faults: list[dict[str, Any]], window: float
) -> list[Violation]:
    windows = fault_windows(faults, window)
    return [
        Violation(
            "unexplained_5xx",
            f"{r.get('op')} answered {r['status']} outside any server-fault window",
            (_short(r),),
        )
        for r in histories
        if isinstance(r.get("status"), int) and r["status"] >= 500 and not in_window(r, windows)
    ]


# --- figures -----------------------------------------------------------------------------------


def _label(r: dict[str, Any]) -> str:
    status = r.get("status")
    if status is None:
        return "no_answer"
    if _lease(r) is not None:
        return str(r["body"]["outcome"])
    if r.get("op") == "release" and status == 200 and isinstance(r.get("body"), dict):
        return "released" if r["body"].get("released") else "200 nothing held"
    if status >= 400:
        return f"{status} {_code(r) or ''}".strip()
    return str(status)


def _covered(windows: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] inside the union of the windows."""
    total, reach = 0.0, start
    for lo, hi in windows:
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def _sent_after_fault(record: dict[str, Any], faults: list[dict[str, Any]]) -> bool:
    """The request was sent after the last server-side fault before its answer had completed
    (a 5xx of a request that was not in flight when the fault struck)."""
    before = [
        float(f.get("t_end") or f["t"])
        for f in faults
        if f.get("kind") in SERVER_FAULTS and float(f["t"]) <= float(record["t1"])
    ]
    return not before or float(record["t0"]) > max(before)


def figures(
    histories: list[dict[str, Any]],
    faults: list[dict[str, Any]],
    final: dict[str, Any],
    window: float,
) -> dict[str, Any]:
    windows = fault_windows(faults, window)
    requests = [r for r in histories if r.get("op") not in (None, "start")]
    outcomes = Counter(f"{r['op']}: {_label(r)}" for r in requests)
    no_answer = [r for r in requests if r.get("status") is None]
    server_errors = [r for r in requests if (r.get("status") or 0) >= 500]
    span = (
        (min(float(r["t0"]) for r in requests), max(float(r["t1"]) for r in requests))
        if requests
        else (0.0, 0.0)
    )
    reasons = Counter(
        str(row.get("reason"))
        for row in final.get("audit", [])
        if row.get("action") == "runtime_lease.reclaimed"
    )
    return {
        "requests": len(requests),
        "agent_starts": sum(1 for r in histories if r.get("op") == "start"),
        "outcomes": dict(sorted(outcomes.items())),
        "probes": sum(1 for r in requests if r.get("probe")),
        "probes_accepted": sum(1 for r in requests if r.get("probe") and r.get("status") == 201),
        "after_sigcont": dict(
            sorted(
                Counter(
                    f"{r['op']}: {_label(r)}" for r in requests if r.get("fault") == "sigcont"
                ).items()
            )
        ),
        "no_answer": len(no_answer),
        "no_answer_outside_windows": sum(1 for r in no_answer if not in_window(r, windows)),
        "server_errors": len(server_errors),
        "server_errors_in_windows": sum(1 for r in server_errors if in_window(r, windows)),
        "server_errors_sent_after_fault": sum(
            1 for r in server_errors if _sent_after_fault(r, faults)
        ),
        "window_share": round(_covered(windows, *span) / (span[1] - span[0]), 3)
        if span[1] > span[0]
        else 0.0,
        "faults": dict(sorted(Counter(str(f.get("kind")) for f in faults).items())),
        "reclaim_reasons": dict(sorted(reasons.items())),
        "generations_handed_out": len(final.get("audit", [])),
        "operations_recorded": len(final.get("operations", [])),
    }


def check(
    histories: Iterable[dict[str, Any]],
    faults: Iterable[dict[str, Any]],
    final: dict[str, Any],
    *,
    fault_window: float = 5.0,
) -> Report:
    """Judge one run. `final`: {"healthz": status or None, "audit": [{ws, generation,
    owner_key, action, reason}], "operations": [{id, ws, generation, issue_id}], "leases":
    [{ws, generation, owner_key}], "workspaces": {ws: counter}}; missing parts are skipped."""
    histories = sorted(histories, key=lambda r: (float(r.get("t0", 0.0)), str(r.get("agent"))))
    faults = list(faults)
    violations = [
        *_rule_two_owners(histories, final),
        *_rule_stale_write(histories),
        *_rule_generations(histories, final),
        *_rule_acknowledged(histories, final),
        *_rule_5xx(histories, faults, fault_window),
    ]
    if "healthz" in final and final["healthz"] != 200:
        violations.append(
            Violation("server_unhealthy", f"/healthz answered {final['healthz']} at the end")
        )
    return Report(violations=violations, figures=figures(histories, faults, final, fault_window))
