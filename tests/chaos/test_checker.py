"""The chaos checker on hand-made histories: a clean one passes, and each rule fails on a
history corrupted to break it (tests/chaos/checker.py)."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.checker import check, read_jsonl

WS = "11111111-1111-4111-8111-111111111111"
WS2 = "22222222-2222-4222-8222-222222222222"
A = "issue:aaaaaaaa-aaaa-4aaa-8aaa-aaaaaaaaaaaa"
B = "issue:bbbbbbbb-bbbb-4bbb-8bbb-bbbbbbbbbbbb"
_ids = itertools.count(1)


def claim(
    t0: float, t1: float, owner: str, generation: int, outcome: str = "created", ws: str = WS
) -> dict[str, Any]:
    return {
        "agent": owner[6:7],
        "op": "claim",
        "ws": ws,
        "owner_key": owner,
        "t0": t0,
        "t1": t1,
        "status": 200,
        "body": {
            "outcome": outcome,
            "owner_key": owner,
            "lease": {"execution_workspace_id": ws, "owner_key": owner, "generation": generation},
            "reclaimed_from": None,
        },
    }


def conflict(
    t0: float, t1: float, owner: str, holder: str, generation: int, ws: str = WS
) -> dict[str, Any]:
    return error(
        t0,
        t1,
        owner,
        "claim",
        "workspace_runtime_lease_conflict",
        {"owner_key": holder, "generation": generation},
        ws,
    )


def error(
    t0: float,
    t1: float,
    owner: str,
    op: str,
    code: str,
    details: dict[str, Any] | None = None,
    ws: str = WS,
    status: int = 409,
) -> dict[str, Any]:
    return {
        "agent": owner[6:7],
        "op": op,
        "ws": ws,
        "owner_key": owner,
        "t0": t0,
        "t1": t1,
        "status": status,
        "body": {"error": {"code": code, "message": "-", "details": details or {}}},
    }


def write(
    t0: float, t1: float, owner: str, generation: int, *, accepted: bool = True, ws: str = WS
) -> dict[str, Any]:
    if not accepted:
        record = error(t0, t1, owner, "write", "workspace_runtime_lease_superseded", ws=ws)
        record["generation"] = generation
        return record
    return {
        "agent": owner[6:7],
        "op": "write",
        "ws": ws,
        "owner_key": owner,
        "generation": generation,
        "t0": t0,
        "t1": t1,
        "status": 201,
        "body": {"id": f"op-{next(_ids)}", "lease_generation": generation},
    }


def final_for(histories: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    """The database read that a correct server would leave behind for these histories."""
    audit, operations, counters = [], [], {}
    for r in histories:
        body = r.get("body") or {}
        if r["op"] == "claim" and body.get("outcome") in ("created", "reclaimed"):
            lease = body["lease"]
            audit.append(
                {
                    "ws": r["ws"],
                    "action": f"runtime_lease.{body['outcome']}",
                    "generation": lease["generation"],
                    "owner_key": lease["owner_key"],
                    "reason": "lease_expired" if body["outcome"] == "reclaimed" else None,
                }
            )
            counters[r["ws"]] = max(counters.get(r["ws"], 0), lease["generation"])
        if r["op"] == "write" and r["status"] == 201:
            operations.append(
                {
                    "id": body["id"],
                    "ws": r["ws"],
                    "generation": r["generation"],
                    "issue_id": r["owner_key"].removeprefix("issue:"),
                }
            )
    return {
        "healthz": 200,
        "audit": audit,
        "operations": operations,
        "leases": [],
        "workspaces": counters,
        **overrides,
    }


def clean_history() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A holds generation 1; B is refused, then reclaims (generation 2) after A's lease
    expired, while a write of A that was already in flight is accepted; A's next write is
    refused; a 5xx falls inside a pg_terminate window; B releases and A creates generation 3
    on another pass. Records of other 409s (contended, busy, owner ineligible) are ordinary."""
    histories = [
        claim(1.0, 1.1, A, 1),
        write(1.2, 1.3, A, 1),
        claim(1.4, 1.5, A, 1, "renewed"),
        conflict(1.6, 1.7, B, A, 1),
        write(2.0, 3.05, A, 1),  # in flight across B's reclaim: may be accepted
        claim(2.9, 3.0, B, 2, "reclaimed"),
        write(3.2, 3.3, A, 1, accepted=False),
        error(3.4, 3.5, A, "claim", "workspace_runtime_lease_owner_ineligible"),
        error(3.4, 3.5, A, "claim", "workspace_runtime_lease_contended"),
        error(3.6, 3.7, A, "write", "resource_busy"),
        write(3.8, 3.9, B, 2),
        error(10.5, 10.6, B, "claim", "internal_error", status=500),
        {"agent": "b", "op": "release", "ws": WS, "owner_key": B, "t0": 12.0, "t1": 12.1,
         "status": 200, "body": {"released": True, "owner_key": B}},
        claim(13.0, 13.1, A, 3),
        write(13.2, 13.3, A, 3),
        claim(13.0, 13.1, B, 1, ws=WS2),
        {"agent": "a", "op": "issue_get", "t0": 14.0, "t1": 14.1, "status": None,
         "body": None, "error": "ConnectionResetError"},
    ]  # fmt: skip
    faults = [
        {"kind": "pg_terminate", "t": 10.0, "t_end": 10.01},
        {"kind": "sigstop_holder", "t": 2.0, "t_end": 6.0},
        {"kind": "kill_agent", "t": 20.0, "t_end": 21.0},
    ]
    return histories, faults


def rules(histories: list[dict[str, Any]], faults: list[dict[str, Any]], final: Any) -> set[str]:
    return set(check(histories, faults, final, fault_window=3.0).by_rule())


def test_a_clean_history_passes() -> None:
    histories, faults = clean_history()
    report = check(histories, faults, final_for(histories), fault_window=3.0)
    assert report.ok, [v.render() for v in report.violations]
    assert report.figures["requests"] == len(histories)
    assert report.figures["server_errors_in_windows"] == 1
    assert report.figures["server_errors_sent_after_fault"] == 1
    assert report.figures["faults"] == {"kill_agent": 1, "pg_terminate": 1, "sigstop_holder": 1}
    assert report.figures["reclaim_reasons"] == {"lease_expired": 1}


def test_the_clean_history_passes_without_a_database_read_too() -> None:
    histories, faults = clean_history()
    assert check(histories, faults, {}).ok


def test_two_owners_of_one_generation_fail() -> None:
    histories, faults = clean_history()
    corrupted = [*histories, claim(20.0, 20.1, B, 3)]  # generation 3 is A's
    assert "generation_two_owners" in rules(corrupted, faults, final_for(histories))


def test_two_owners_seen_only_in_a_conflict_fail() -> None:
    histories, faults = clean_history()
    corrupted = [*histories, conflict(13.5, 13.6, B, B, 3)]  # the holder of 3 is A
    assert rules(corrupted, faults, final_for(histories)) == {"generation_two_owners"}


def test_two_owners_seen_only_in_the_database_fail() -> None:
    histories, faults = clean_history()
    final = final_for(histories)
    final["operations"].append(
        {"id": "op-x", "ws": WS, "generation": 2, "issue_id": A.removeprefix("issue:")}
    )
    assert rules(histories, faults, final) == {"generation_two_owners"}


def test_a_write_accepted_after_a_newer_generation_committed_fails() -> None:
    histories, faults = clean_history()
    corrupted = [*histories, write(3.1, 3.2, A, 1)]  # sent after B's reclaim answered
    report = check(corrupted, faults, final_for(corrupted), fault_window=3.0)
    assert set(report.by_rule()) == {"stale_write_accepted"}
    (violation,) = report.violations
    assert [e["op"] for e in violation.evidence] == ["claim", "write"]


def test_a_write_in_flight_across_the_reclaim_is_not_a_violation() -> None:
    histories, faults = clean_history()
    overlapping = [*histories, write(2.95, 3.5, A, 1)]  # sent before the reclaim answered
    assert check(overlapping, faults, final_for(overlapping)).ok


def test_a_generation_handed_out_twice_fails() -> None:
    histories, faults = clean_history()
    corrupted = [*histories, claim(20.0, 20.1, A, 3)]  # A "creates" 3 again
    assert rules(corrupted, faults, final_for(corrupted)) == {"generation_not_increasing"}


def test_a_smaller_generation_after_a_larger_one_fails() -> None:
    histories, faults = clean_history()
    corrupted = copy.deepcopy(histories)
    corrupted.append(claim(30.0, 30.1, B, 2, ws=WS2))
    corrupted.append(claim(31.0, 31.1, A, 4, ws=WS2, outcome="reclaimed"))
    corrupted.append(claim(32.0, 32.1, B, 3, ws=WS2, outcome="reclaimed"))  # 3 after 4
    assert rules(corrupted, faults, final_for(corrupted)) == {"generation_not_increasing"}


def test_overlapping_acquisitions_may_finish_in_either_order() -> None:
    histories, faults = clean_history()
    ok = [
        *histories,
        claim(30.0, 30.5, B, 3, ws=WS2, outcome="reclaimed"),
        claim(30.1, 30.2, A, 2, ws=WS2, outcome="reclaimed"),  # overlapped: either order
    ]
    assert check(ok, faults, final_for(ok)).ok


def test_duplicate_audit_generations_and_a_lagging_counter_fail() -> None:
    histories, faults = clean_history()
    final = final_for(histories)
    final["audit"].append(dict(final["audit"][0]))
    assert rules(histories, faults, final) == {"generation_not_increasing"}
    final = final_for(histories)
    final["workspaces"][WS] = 2
    assert rules(histories, faults, final) == {"generation_not_increasing"}


def test_acknowledged_claims_and_writes_missing_from_the_database_fail() -> None:
    histories, faults = clean_history()
    final = final_for(histories)
    final["audit"] = [row for row in final["audit"] if row["generation"] != 3]
    assert rules(histories, faults, final) == {"acknowledged_claim_lost"}
    final = final_for(histories)
    final["operations"].pop()
    assert rules(histories, faults, final) == {"acknowledged_write_lost"}


def test_a_5xx_outside_every_server_fault_window_fails() -> None:
    histories, faults = clean_history()
    late = [*histories, error(40.0, 40.1, A, "write", "internal_error", status=500)]
    assert rules(late, faults, final_for(late)) == {"unexplained_5xx"}
    # Client-side faults (a killed or paused agent) excuse nothing.
    during_kill = [*histories, error(20.5, 20.6, A, "claim", "internal_error", status=502)]
    assert rules(during_kill, faults, final_for(during_kill)) == {"unexplained_5xx"}
    # Inside the window of a worker kill: excused.
    worker_faults = [*faults, {"kind": "kill_worker", "t": 39.0}]
    assert rules(late, worker_faults, final_for(late)) == set()


def test_a_server_that_does_not_answer_healthz_at_the_end_fails() -> None:
    histories, faults = clean_history()
    assert rules(histories, faults, final_for(histories, healthz=503)) == {"server_unhealthy"}
    assert rules(histories, faults, final_for(histories, healthz=None)) == {"server_unhealthy"}


@pytest.mark.parametrize("torn", ['{"op": "claim", "t0"', ""])
def test_history_files_tolerate_a_torn_last_line(tmp_path: Path, torn: str) -> None:
    path = tmp_path / "h.jsonl"
    path.write_text('{"op": "start"}\n{"op": "claim"}\n' + torn)
    records, bad = read_jsonl(path)
    assert [r["op"] for r in records] == ["start", "claim"]
    assert bad == (1 if torn else 0)
    assert read_jsonl(tmp_path / "missing.jsonl") == ([], 0)
