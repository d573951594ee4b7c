"""`Client`: one method per agent-facing operation of the Paperclip API.

How a call is sent and when it may be repeated: `paperclip_client.transport`; the store's
and the snapshots' calls: `paperclip_client.cas`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from paperclip_client._lazy import LazyModule
from paperclip_client.cas import StoreCalls
from paperclip_client.errors import ApiError
from paperclip_client.transport import drop_none, operation

if TYPE_CHECKING:
    from paperclip_client import models
else:  # imported at the first answer read, not at the CLI's start (_lazy.py says why)
    models = LazyModule("paperclip_client.models")


def operations() -> dict[str, str]:
    """operationId -> method name, for every method of `Client`."""
    found: dict[str, str] = {}
    for name in dir(Client):
        op = getattr(getattr(Client, name), "operation_id", None)
        if isinstance(op, str):
            found[op] = name
    return found


class Client(StoreCalls):
    """An agent's connection to the API: `Client("http://127.0.0.1:8000", "pcak_...")`.


    Transport options (`timeout`, `retries`, `backoff`, `transport`): `Transport`.
    """

    # --- identity ----------------------------------------------------------------------------

    @operation("me")
    def me(self) -> models.Me:
        """Who the key belongs to (`actor_type`, `agent_id`, `company_ids`)."""
        # The answer first: `models.Me` named in the same call would import the models (about
        # 25 ms) before the CLI's first request goes out (_lazy.py).
        data = self._get("/api/me")
        return models.build(models.Me, data)

    @operation("issue_get")
    def issue_get(self, issue_id: str) -> models.Issue:
        data = self._get(f"/api/issues/{issue_id}")
        return models.build(models.Issue, data)

    @operation("execution_workspace_get")
    def execution_workspace_get(self, workspace_id: str) -> models.ExecutionWorkspace:
        data = self._get(f"/api/execution-workspaces/{workspace_id}")
        return models.build(models.ExecutionWorkspace, data)

    @operation("my_issues")
    def my_issues(self) -> list[models.Issue]:
        """The issues assigned to this agent (not hidden), newest first, every page."""
        return [models.build(models.Issue, item) for item in self._pages("/api/me/issues")]

    @operation("my_execution_workspaces")
    def my_execution_workspaces(self) -> list[models.ExecutionWorkspace]:
        """The execution workspaces of this agent's company, newest first, every page."""
        return [
            models.build(models.ExecutionWorkspace, item)
            for item in self._pages("/api/me/execution-workspaces")
        ]

    # --- runs --------------------------------------------------------------------------------

    @operation("heartbeat_run_create")
    def run_create(
        self,
        *,
        runtime_mode: str = "native",
        issue_id: str | None = None,
        execution_workspace_id: str | None = None,
        workspace_dir: str | None = None,
    ) -> models.Run:
        """Queue a run for the calling agent. Not repeated without an answer (a repeat would
        create a second run)."""
        body = drop_none(
            {
                "runtime_mode": runtime_mode,
                "issue_id": issue_id,
                "execution_workspace_id": execution_workspace_id,
                "workspace_dir": workspace_dir,
            }
        )
        data = self.request("POST", "/api/heartbeat-runs", json=body, idempotent=False)
        return models.build(models.Run, data)

    @operation("heartbeat_run_get")
    def run_get(self, run_id: str) -> models.Run:
        data = self._get(f"/api/heartbeat-runs/{run_id}")
        return models.build(models.Run, data)

    @operation("heartbeat_run_update")
    def run_update(self, run_id: str, *, status: str) -> models.Run:
        """Move the run to `status` (the same status again is an idempotent 200)."""
        data = self.request(
            "PATCH", f"/api/heartbeat-runs/{run_id}", json={"status": status}, idempotent=True
        )
        return models.build(models.Run, data)

    # --- runtime leases ----------------------------------------------------------------------

    @operation("runtime_lease_claim")
    def runtime_lease_claim(
        self,
        workspace_id: str,
        *,
        action: str = "start",
        issue_id: str | None = None,
        run_id: str | None = None,
        ttl_seconds: int | None = None,
    ) -> models.LeaseClaim:
        """Claim, renew (same owner: generation unchanged) or reclaim the workspace's lease.
        Repeatable: a repeat by the same owner is a renew."""
        body = drop_none(
            {"action": action, "issue_id": issue_id, "run_id": run_id, "ttl_seconds": ttl_seconds}
        )
        data = self.request(
            "POST",
            f"/api/execution-workspaces/{workspace_id}/runtime-lease/claim",
            json=body,
            idempotent=True,
        )
        return models.build(models.LeaseClaim, data)

    @operation("runtime_lease_get")
    def runtime_lease_get(self, workspace_id: str) -> models.LeaseState:
        data = self._get(f"/api/execution-workspaces/{workspace_id}/runtime-lease")
        return models.build(models.LeaseState, data)

    @operation("runtime_lease_release")
    def runtime_lease_release(
        self, workspace_id: str, *, issue_id: str | None = None, run_id: str | None = None
    ) -> models.LeaseRelease:
        """Release the lease only if its owner key is the one these ids name."""
        data = self.request(
            "POST",
            f"/api/execution-workspaces/{workspace_id}/runtime-lease/release",
            json=drop_none({"issue_id": issue_id, "run_id": run_id}),
            idempotent=True,
        )
        return models.build(models.LeaseRelease, data)

    @operation("workspace_operation_create")
    def workspace_operation_create(
        self,
        workspace_id: str,
        *,
        generation: int,
        phase: str,
        status: str,
        issue_id: str | None = None,
        run_id: str | None = None,
        command: str | None = None,
        exit_code: int | None = None,
    ) -> models.WorkspaceOperation:
        """A fenced write: accepted only while the caller holds the lease at `generation`
        (else `WorkspaceRuntimeLeaseSuperseded`). Never repeated without an answer."""
        body = drop_none(
            {
                "generation": generation,
                "phase": phase,
                "status": status,
                "issue_id": issue_id,
                "run_id": run_id,
                "command": command,
                "exit_code": exit_code,
            }
        )
        data = self.request(
            "POST",
            f"/api/execution-workspaces/{workspace_id}/operations",
            json=body,
            idempotent=False,
        )
        return models.build(models.WorkspaceOperation, data)

    @operation("leases_renew")
    def leases_renew(self, items: Sequence[Mapping[str, Any]]) -> list[models.LeaseRenewal]:
        """Renew many runtime and controller leases in one request (1..500 items, each
        `{"kind": "runtime", "execution_workspace_id", "generation", "issue_id"?, "run_id"?,
        "fence"?, "ttl_seconds"?}` or `{"kind": "controller", "run_id", "boot_id",
        "lease_owner", "ttl_seconds"?}`). One answer per item, in order: the lease, or the
        error its single endpoint would raise (never raised here: a refused item fails alone).
        Repeatable: a renew repeated is a renew."""
        body = {"leases": [drop_none(item) for item in items]}
        data = self.request("POST", "/api/leases/renew", json=body, idempotent=True)
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list) or len(results) != len(items):
            raise TypeError("leases_renew: the answer does not hold one result per item")
        renewals = []
        for item, result in zip(items, results, strict=True):
            kind = str(item.get("kind"))
            if result.get("ok"):
                raw = result.get("lease")
                lease: models.RuntimeLease | models.ControllerLease = (
                    models.build(models.RuntimeLease, raw)
                    if kind == "runtime"
                    else models.build(models.ControllerLease, raw)
                )
                renewals.append(models.LeaseRenewal(kind=kind, lease=lease))
            else:
                error = ApiError.from_body(200, {"error": result.get("error")})
                renewals.append(models.LeaseRenewal(kind=kind, lease=None, error=error))
        return renewals

    # --- controller lease and checkpoints ----------------------------------------------------

    @operation("controller_lease_acquire")
    def controller_lease_acquire(
        self,
        run_id: str,
        *,
        boot_id: str,
        lease_owner: str | None = None,
        ttl_seconds: int | None = None,
    ) -> models.ControllerLease:
        """Acquire (no `lease_owner`) or renew (the current one) the run's controller lease.
        Only a renew is repeated without an answer: a lost first answer would leave a minted
        owner nobody knows, so the caller must see the failure."""
        body = drop_none(
            {"boot_id": boot_id, "lease_owner": lease_owner, "ttl_seconds": ttl_seconds}
        )
        data = self.request(
            "POST",
            f"/api/heartbeat-runs/{run_id}/controller-lease",
            json=body,
            idempotent=lease_owner is not None,
        )
        return models.build(models.ControllerLease, data)

    @operation("controller_lease_expire_on_failure")
    def controller_lease_expire(self, run_id: str, *, boot_id: str, lease_owner: str) -> bool:
        """End the controller lease now (writer-failure hook); whether it did."""
        data = self.request(
            "POST",
            f"/api/heartbeat-runs/{run_id}/controller-lease/expire",
            json={"boot_id": boot_id, "lease_owner": lease_owner},
            idempotent=True,
        )
        return bool(data["expired"])

    @operation("checkpoint_write")
    def checkpoint_write(
        self,
        run_id: str,
        *,
        owner: Mapping[str, Any],
        changed: Mapping[str, str] | None = None,
        removed: list[str] | None = None,
        reset: bool = False,
        work_command_ids: list[str] | None = None,
        predecessor: Mapping[str, str] | None = None,
    ) -> int:
        """Write checkpoint parts, fenced by the controller lease `owner` (`boot_id`,
        `lease_owner`, `generation`); the number of parts stored after the write. Never
        repeated without an answer."""
        body: dict[str, Any] = {
            "owner": dict(owner),
            "reset": reset,
            "changed": dict(changed or {}),
            "removed": list(removed or []),
            "work_command_ids": list(work_command_ids or []),
            "predecessor": dict(predecessor) if predecessor is not None else None,
        }
        data = self.request(
            "PUT", f"/api/heartbeat-runs/{run_id}/checkpoint", json=body, idempotent=False
        )
        return int(data["parts"])

    @operation("checkpoint_read")
    def checkpoint_read(
        self, run_id: str, *, normalized_session_id: str | None = None
    ) -> dict[str, str]:
        """Every part, decrypted (`{}` when the run has none)."""
        params = drop_none({"normalized_session_id": normalized_session_id})
        data = self._get(f"/api/heartbeat-runs/{run_id}/checkpoint", params or None)
        return dict(data["parts"])

    @operation("checkpoint_header_read")
    def checkpoint_header(self, run_id: str) -> str | None:
        data = self._get(f"/api/heartbeat-runs/{run_id}/checkpoint/header")
        header = data["header"]
        return None if header is None else str(header)

    @operation("checkpoint_parts_list")
    def checkpoint_parts(self, run_id: str) -> list[models.CheckpointPart]:
        data = self._get(f"/api/heartbeat-runs/{run_id}/checkpoint/parts")
        return [models.build(models.CheckpointPart, p) for p in data["results"]]

    # --- results and finalization ------------------------------------------------------------

    @operation("heartbeat_runs_results_create")
    def result_post(
        self,
        run_id: str,
        *,
        result: Mapping[str, Any],
        run_terminal_state: str,
        caller_result_id: str | None = None,
        workspace_tree: str | None = None,
    ) -> models.NativeResult:
        """Report the run's result. Repeated without an answer only with a
        `caller_result_id` (the server then answers a repeat with the same result).
        `workspace_tree`: a snapshot this run registered, which finalization publishes to the
        workspace head (without it, the workdir is copied back as before)."""
        body = drop_none(
            {
                "result": dict(result),
                "terminal": {"run_terminal_state": run_terminal_state},
                "caller_result_id": caller_result_id,
                "workspace_tree": workspace_tree,
            }
        )
        data = self.request(
            "POST",
            f"/api/heartbeat-runs/{run_id}/results",
            json=body,
            idempotent=caller_result_id is not None,
        )
        return models.build(models.NativeResult, data)

    @operation("heartbeat_runs_finalize_create")
    def finalize(self, run_id: str, *, wait: int = 0) -> models.Finalize:
        """Wake the run's finalization; with `wait` (0..30 s), answer when the attempt ends.
        `FinalizationNotAcquired` / `FinalizationFailed` when it cannot commit."""
        data = self.request(
            "POST",
            f"/api/heartbeat-runs/{run_id}/finalize",
            params={"wait": wait} if wait else None,
            idempotent=True,
            timeout=self.timeout + wait,
        )
        return models.build(models.Finalize, data)

    def wait_committed(
        self,
        run_id: str,
        *,
        timeout: float = 300.0,
        progress: Callable[[models.Finalize], None] | None = None,
    ) -> models.Finalize:
        """Finalize and wait until the run is committed (TimeoutError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            answer = self.finalize(run_id, wait=max(0, min(30, int(left))))
            if answer.committed:
                return answer
            if progress is not None:
                progress(answer)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} not committed after {timeout:.0f} s")

    # --- recovery and environment cleanup ----------------------------------------------------

    @operation("issues_recovery_actions_retrieve")
    def recovery_actions(self, issue_id: str) -> list[models.RecoveryAction]:
        data = self._get(f"/api/issues/{issue_id}/recovery-actions")
        return [models.build(models.RecoveryAction, a) for a in data["results"]]

    @operation("environment_lease_acquire")
    def environment_lease_acquire(
        self,
        *,
        environment_id: str,
        heartbeat_run_id: str,
        lease_policy: str,
        provider: str,
        provider_lease_id: str,
        execution_workspace_id: str | None = None,
        remote_cwd: str | None = None,
        plugin_id: str | None = None,
    ) -> models.EnvironmentLease:
        """Lease a provider allocation to a run (provider agents). Repeated without an answer:
        the same acquire returns the lease it made (200), so it is safe to retry.
        `EnvironmentLeaseSingleFlight` while an active ephemeral lease holds the slot."""
        body = drop_none(
            {
                "environment_id": environment_id,
                "heartbeat_run_id": heartbeat_run_id,
                "execution_workspace_id": execution_workspace_id,
                "lease_policy": lease_policy,
                "provider": provider,
                "provider_lease_id": provider_lease_id,
                "remote_cwd": remote_cwd,
                "plugin_id": plugin_id,
            }
        )
        data = self.request("POST", "/api/environment-leases", json=body, idempotent=True)
        return models.build(models.EnvironmentLease, data)

    @operation("environment_lease_get")
    def environment_lease_get(self, lease_id: str) -> models.EnvironmentLease:
        data = self._get(f"/api/environment-leases/{lease_id}")
        return models.build(models.EnvironmentLease, data)

    @operation("environment_lease_heartbeat")
    def environment_lease_heartbeat(self, lease_id: str) -> models.EnvironmentLease:
        """Mark the lease as in use (`last_used_at`); `EnvironmentLeaseNotActive` once released."""
        data = self.request(
            "POST", f"/api/environment-leases/{lease_id}/heartbeat", idempotent=True
        )
        return models.build(models.EnvironmentLease, data)

    @operation("environment_lease_release")
    def environment_lease_release(self, lease_id: str, *, outcome: str) -> models.EnvironmentLease:
        """Release with the run's outcome (`succeeded` / `failed`); repeating the same outcome
        is harmless, another one is `EnvironmentLeaseNotActive`."""
        data = self.request(
            "POST",
            f"/api/environment-leases/{lease_id}/release",
            json={"outcome": outcome},
            idempotent=True,
        )
        return models.build(models.EnvironmentLease, data)

    @operation("environment_lease_cleanup_claim")
    def cleanup_claim(self, lease_id: str) -> models.CleanupClaim:
        """Claim a pending cleanup attempt (provider agents). Never repeated without an
        answer (the first may have claimed the attempt)."""
        data = self.request(
            "POST", f"/api/environment-leases/{lease_id}/cleanup-claims", idempotent=False
        )
        return models.build(models.CleanupClaim, data)

    @operation("environment_lease_cleanup_receipt")
    def cleanup_receipt(
        self, lease_id: str, *, attempt_id: str, provider_lease_id: str, state: str
    ) -> models.EnvironmentLease:
        """Report a claimed cleanup's outcome (`stopped` / `destroyed` / `failed`)."""
        body = {
            "attempt_id": attempt_id,
            "receipt": {"provider_lease_id": provider_lease_id, "state": state},
        }
        data = self.request(
            "POST",
            f"/api/environment-leases/{lease_id}/cleanup-receipts",
            json=body,
            idempotent=False,
        )
        return models.build(models.EnvironmentLease, data)
