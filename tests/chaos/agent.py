"""One chaos agent: an OS process that uses the runtime-lease API the way a runner does.

Standard library only (no Django): `python -m tests.chaos.agent CONFIG.json --seed N`.
The config names the server, the agent's key, a board token (to reopen the agent's own
issues when the nemesis ended them), the agent's issues, the workspaces and the history file.

Loop: make sure the chosen issue is open (GET, and PATCH it back to `in_progress` as the
board when it is done, cancelled or hidden), claim a random workspace for that issue with a
short TTL, then hold it for a few steps (fenced writes at the generation the claim returned,
a renew every other step), and release it (or, now and then, walk away and let it expire or
be reclaimed). Now and then it also probes the fence with a generation it held before on
that workspace: the server must refuse such a write once a newer generation exists.

Every 409 (conflict, superseded, contended, busy, owner ineligible) is a normal outcome. Every
request and response is appended to the history as one JSON line: monotonic and wall times
before and after, the request, the status, the parsed body or the transport error, and a
fault marker (`restart` on the start record of a restarted process, `sigcont` on the first
request sent after the process was resumed from SIGSTOP, `sigcont_in_flight` on a request
that was in flight while it was stopped).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import sys
import time
from typing import Any
from urllib.parse import urlsplit

from tests.support.servers import NoDelayHTTPConnection

OPEN_ISSUE_STATUSES = frozenset({"backlog", "todo", "in_progress", "in_review", "blocked"})
PHASES = ("runtime_start", "runtime_probe", "runtime_restart", "runtime_repair", "runtime_stop")
ACTIONS = ("start", "restart", "repair", "stop")
RETRYABLE_409 = frozenset({"workspace_runtime_lease_contended", "resource_busy"})
REQUEST_TIMEOUT = 20.0


class History:
    """Append-only JSONL: one os.write per record on an O_APPEND descriptor, so records of a
    process killed with SIGKILL are complete lines (the reader skips a torn last line anyway)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


class Agent:
    def __init__(self, config: dict[str, Any], seed: int, *, restarted: bool) -> None:
        self.name: str = config["name"]
        self.agent_key: str = config["agent_key"]
        self.board_token: str = config["board_token"]
        self.issues: list[str] = config["issues"]
        self.workspaces: list[str] = config["workspaces"]
        self.ttl: int = int(config["ttl_seconds"])
        self.rng = random.Random(seed)
        url = urlsplit(config["base_url"])
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.conn: NoDelayHTTPConnection | None = None
        self.history = History(config["history"])
        self.seq = 0
        self.pid = os.getpid()
        self.stopping = False
        self.reconnect = False
        self.fault: str | None = "restart" if restarted else None
        self.held_before: dict[str, int] = {}  # workspace -> a generation this agent held there

    # --- signals ---------------------------------------------------------------------------
    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def on_sigcont(self, signum: int, frame: Any) -> None:
        # The kept-alive connection may have been closed by the server while we were stopped:
        # the next request opens a new one. (Only flags here: the handler may run between a
        # request and its response.)
        self.fault = "sigcont"
        self.reconnect = True

    # --- HTTP ------------------------------------------------------------------------------
    def drop_connection(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def request(
        self,
        op: str,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        board: bool = False,
        **fields: Any,
    ) -> tuple[int | None, Any]:
        headers = {
            "Authorization": f"Bearer {self.board_token if board else self.agent_key}",
            "Content-Type": "application/json",
        }
        payload = None if body is None else json.dumps(body).encode()
        record: dict[str, Any] = {
            "agent": self.name,
            "pid": self.pid,
            "seq": self.seq,
            "op": op,
            "method": method,
            "path": path,
            "request": body,
            **fields,
        }
        self.seq += 1
        # The marker goes to the first request sent after the event; a request that was in
        # flight while the process was stopped is marked `sigcont_in_flight`.
        record["fault"], self.fault = self.fault, None
        status: int | None = None
        parsed: Any = None
        error: str | None = None
        record["t0"], record["w0"] = time.monotonic(), time.time()
        try:
            if self.reconnect:
                self.reconnect = False
                self.drop_connection()
            if self.conn is None:
                self.conn = NoDelayHTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT)
            self.conn.request(method, path, body=payload, headers=headers)
            response = self.conn.getresponse()
            raw = response.read()
            status = response.status
            if response.getheader("Connection", "").lower() == "close":
                self.drop_connection()
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = {"raw": raw[:500].decode("utf-8", "replace")}
        except (OSError, http.client.HTTPException) as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.drop_connection()
        record["t1"], record["w1"] = time.monotonic(), time.time()
        record["status"], record["body"], record["error"] = status, parsed, error
        if self.fault == "sigcont" and record["fault"] is None:
            record["fault"] = "sigcont_in_flight"
        self.history.write(record)
        return status, parsed

    # --- the protocol ----------------------------------------------------------------------
    def claim(self, workspace: str, issue: str, action: str) -> tuple[int | None, Any]:
        return self.request(
            "claim",
            "POST",
            f"/api/execution-workspaces/{workspace}/runtime-lease/claim",
            {"action": action, "issue_id": issue, "ttl_seconds": self.ttl},
            ws=workspace,
            issue=issue,
            owner_key=f"issue:{issue}",
        )

    def write(
        self, workspace: str, issue: str, generation: int, *, probe: bool = False
    ) -> tuple[int | None, Any]:
        status = self.rng.choice(("running", "running", "succeeded", "failed"))
        return self.request(
            "write",
            "POST",
            f"/api/execution-workspaces/{workspace}/operations",
            {
                "generation": generation,
                "issue_id": issue,
                "phase": self.rng.choice(PHASES),
                "status": status,
                "command": f"{self.name} step",
                **({} if status == "running" else {"exit_code": 0 if status == "succeeded" else 1}),
            },
            ws=workspace,
            issue=issue,
            owner_key=f"issue:{issue}",
            generation=generation,
            probe=probe,
        )

    def release(self, workspace: str, issue: str) -> tuple[int | None, Any]:
        return self.request(
            "release",
            "POST",
            f"/api/execution-workspaces/{workspace}/runtime-lease/release",
            {"issue_id": issue},
            ws=workspace,
            issue=issue,
            owner_key=f"issue:{issue}",
        )

    def ensure_issue_open(self, issue: str) -> None:
        status, body = self.request("issue_get", "GET", f"/api/issues/{issue}", issue=issue)
        if status != 200 or not isinstance(body, dict):
            return
        if body.get("status") in OPEN_ISSUE_STATUSES and not body.get("hidden_at"):
            return
        self.request(
            "issue_reopen",
            "PATCH",
            f"/api/issues/{issue}",
            {"status": "in_progress", "hidden": False},
            board=True,
            issue=issue,
        )

    def pause(self, low: float, high: float) -> None:
        time.sleep(self.rng.uniform(low, high))

    def hold(self, workspace: str, issue: str, generation: int) -> None:
        """Work under the lease: fenced writes, a renew every other step, then release."""
        lost = False
        older = self.held_before.get(workspace)
        if older is not None and older < generation and self.rng.random() < 0.15:
            self.write(workspace, issue, older, probe=True)  # must be refused now
        self.held_before[workspace] = generation
        for step in range(self.rng.randint(3, 10)):
            if self.stopping:
                break
            status, body = self.write(workspace, issue, generation)
            if status == 409 and error_code(body) not in RETRYABLE_409:
                lost = True  # superseded (or our owner is ineligible): stop acting
                break
            self.pause(0.02, 0.15)
            if step % 2 == 1:
                status, body = self.claim(workspace, issue, self.rng.choice(ACTIONS))
                if status == 200 and isinstance(body, dict) and body.get("lease"):
                    generation = int(body["lease"]["generation"])  # a new one if we re-took it
                    self.held_before[workspace] = generation
                elif status == 409 and error_code(body) in (
                    "workspace_runtime_lease_conflict",
                    "workspace_runtime_lease_owner_ineligible",
                ):
                    lost = True
                    break
        if lost and self.rng.random() < 0.5:
            return
        if self.rng.random() < 0.03:
            return  # walk away: the lease stays until it expires or is reclaimed
        self.release(workspace, issue)

    def run(self) -> None:
        self.history.write(
            {
                "agent": self.name,
                "pid": self.pid,
                "seq": -1,
                "op": "start",
                "t0": time.monotonic(),
                "t1": time.monotonic(),
                "w0": time.time(),
                "w1": time.time(),
                "fault": self.fault,
            }
        )
        self.fault = None
        while not self.stopping:
            issue = self.rng.choice(self.issues)
            self.ensure_issue_open(issue)
            workspace = self.rng.choice(self.workspaces)
            status, body = self.claim(workspace, issue, self.rng.choice(ACTIONS))
            if status == 200 and isinstance(body, dict) and body.get("lease"):
                self.hold(workspace, issue, int(body["lease"]["generation"]))
                self.pause(0.0, 0.1)
            elif status == 409:
                self.pause(0.05, 0.3)  # conflict: do not spin; contended/busy: retry soon
            else:
                self.pause(0.2, 0.5)  # server trouble (5xx, no answer)


def error_code(body: Any) -> str | None:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return code if isinstance(code, str) else None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One chaos agent process.")
    parser.add_argument("config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restarted", action="store_true", help="marks the first record")
    args = parser.parse_args(argv)
    with open(args.config) as fh:
        config = json.load(fh)
    agent = Agent(config, args.seed, restarted=args.restarted)
    signal.signal(signal.SIGTERM, agent.on_sigterm)
    signal.signal(signal.SIGINT, agent.on_sigterm)
    signal.signal(signal.SIGCONT, agent.on_sigcont)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
