"""`Client`: one method per agent-facing operation of the Paperclip API.

Transport rules (why each call may or may not be repeated):

- every call has a timeout (`timeout`, and `wait + timeout` for `finalize(wait=...)`);
- a request that never reached the server (connection refused, connect timeout) is retried
  with back-off, whatever it is: nothing can have happened;
- `503 database_unavailable`, `409 resource_busy` and `409 workspace_runtime_lease_contended`
  are retried too: the API guarantees a failed request changes nothing;
- a request sent without an answer (read timeout, dropped connection) is retried only when
  repeating it is harmless: reads, a runtime-lease claim or controller-lease renew by the same
  owner, a release, an environment-lease acquire, heartbeat or release (same outcome), a
  result posted with a `caller_result_id`, a finalize wake-up. A fenced write, a cleanup claim
  or a checkpoint write raises `OutcomeUnknown` instead: the caller must re-read.
"""

from __future__ import annotations

import hashlib
import io
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, NamedTuple, TypeVar, cast

import httpx

from paperclip_client import models
from paperclip_client.errors import (
    ApiError,
    BlobCorrupt,
    DatabaseUnavailable,
    OutcomeUnknown,
    ResourceBusy,
    ServerUnreachable,
    WorkspaceRuntimeLeaseContended,
)

F = TypeVar("F", bound=Callable[..., Any])
RETRYABLE_ERRORS = (DatabaseUnavailable, ResourceBusy, WorkspaceRuntimeLeaseContended)
USER_AGENT = "paperclip-client/0.1"
FIND_MISSING_MAX = 10_000
PIECE_BYTES = 1024 * 1024


def operation(operation_id: str) -> Callable[[F], F]:
    """Tag a method with the OpenAPI operation it calls (the schema-coverage test reads it)."""

    def mark(func: F) -> F:
        func.operation_id = operation_id  # type: ignore[attr-defined]
        return func

    return mark


def operations() -> dict[str, str]:
    """operationId -> method name, for every method of `Client`."""
    found: dict[str, str] = {}
    for name in dir(Client):
        op = getattr(getattr(Client, name), "operation_id", None)
        if isinstance(op, str):
            found[op] = name
    return found


def _drop_none(body: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class Client:
    """An agent's connection to the API: `Client("http://127.0.0.1:8000", "pcak_...")`.

    `retries` is how many times a retry-safe failure is repeated (back-off from `backoff`
    seconds, doubling, with jitter, capped at `backoff_cap`; a `Retry-After` is honoured up to
    that cap). `transport` is for tests (e.g. `httpx.WSGITransport`).
    """

    def __init__(
        self,
        base_url: str,
        key: str,
        *,
        timeout: float = 30.0,
        connect_timeout: float = 5.0,
        retries: int = 4,
        backoff: float = 0.25,
        backoff_cap: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {key}", "User-Agent": USER_AGENT},
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport ---------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        idempotent: bool,
        timeout: float | None = None,
        content: Callable[[], bytes | Iterator[bytes]] | None = None,
        headers: Mapping[str, str] | None = None,
        receive: Callable[[httpx.Response], Any] | None = None,
    ) -> Any:
        """Send one API call and return its decoded JSON body; raise the error class of its
        code. `idempotent`: whether a request sent without an answer may be repeated.
        `content()` gives a raw body for each attempt (bytes or an iterator of chunks, sent
        with the `Content-Length` of `headers`); `receive(response)` reads a successful
        answer as a stream (it must start over when called again) and gives the result."""
        attempt = 0
        while True:
            delay: float | None = None
            try:
                response = self._send(method, path, json, params, timeout, content, headers)
                try:
                    if receive is not None and response.status_code < 400:
                        return receive(response)
                    response.read()
                finally:
                    response.close()
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                if attempt >= self.retries:
                    raise ServerUnreachable(self.base_url, _reason(exc)) from exc
            except httpx.TransportError as exc:  # sent, no (complete) answer
                if not idempotent:
                    raise OutcomeUnknown(method, path, _reason(exc)) from exc
                if attempt >= self.retries:
                    raise ServerUnreachable(self.base_url, _reason(exc)) from exc
            else:
                body = _decode(response)
                if response.status_code < 400:
                    return body
                error = ApiError.from_body(
                    response.status_code, body, request_id=response.headers.get("X-Request-ID")
                )
                if not isinstance(error, RETRYABLE_ERRORS) or attempt >= self.retries:
                    raise error
                delay = _retry_after(response)
            attempt += 1
            pause = min(self.backoff_cap, self.backoff * 2 ** (attempt - 1))
            pause = pause * (0.5 + random.random() / 2)  # noqa: S311 - jitter, not security
            time.sleep(min(self.backoff_cap, max(pause, delay or 0.0)))

    def _send(
        self,
        method: str,
        path: str,
        json: Any,
        params: Mapping[str, Any] | None,
        timeout: float | None,
        content: Callable[[], bytes | Iterator[bytes]] | None,
        headers: Mapping[str, str] | None,
    ) -> httpx.Response:
        request = self._http.build_request(
            method,
            path,
            json=json,
            params=params,
            content=None if content is None else content(),
            headers=headers,
            # None would mean "no timeout" to httpx: the client's default applies instead.
            timeout=httpx.USE_CLIENT_DEFAULT
            if timeout is None
            else httpx.Timeout(timeout, connect=self.connect_timeout),
        )
        return self._http.send(request, stream=True)

    def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        return self.request("GET", path, params=params, idempotent=True)

    # --- identity ----------------------------------------------------------------------------

    @operation("me")
    def me(self) -> models.Me:
        """Who the key belongs to (`actor_type`, `agent_id`, `company_ids`)."""
        return models.build(models.Me, self._get("/api/me"))

    @operation("issue_get")
    def issue_get(self, issue_id: str) -> models.Issue:
        return models.build(models.Issue, self._get(f"/api/issues/{issue_id}"))

    @operation("execution_workspace_get")
    def execution_workspace_get(self, workspace_id: str) -> models.ExecutionWorkspace:
        return models.build(
            models.ExecutionWorkspace, self._get(f"/api/execution-workspaces/{workspace_id}")
        )

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

    def _pages(self, path: str) -> list[Any]:
        """Every item of a `{"results", "next"}` list, following `next` (same server)."""
        items: list[Any] = []
        url: str | None = path
        while url is not None:
            page = self._get(url)
            items.extend(page["results"])
            following = page.get("next")
            url = None
            if isinstance(following, str):
                parts = httpx.URL(following)
                url = parts.raw_path.decode("ascii")
        return items

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
        body = _drop_none(
            {
                "runtime_mode": runtime_mode,
                "issue_id": issue_id,
                "execution_workspace_id": execution_workspace_id,
                "workspace_dir": workspace_dir,
            }
        )
        return models.build(
            models.Run, self.request("POST", "/api/heartbeat-runs", json=body, idempotent=False)
        )

    @operation("heartbeat_run_get")
    def run_get(self, run_id: str) -> models.Run:
        return models.build(models.Run, self._get(f"/api/heartbeat-runs/{run_id}"))

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
        body = _drop_none(
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
            json=_drop_none({"issue_id": issue_id, "run_id": run_id}),
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
        body = _drop_none(
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
        body = {"leases": [_drop_none(item) for item in items]}
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
        body = _drop_none(
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
        params = _drop_none({"normalized_session_id": normalized_session_id})
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
        body = _drop_none(
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

    # --- content-addressed store and workspace snapshots -------------------------------------

    @operation("cas_limits")
    def cas_config(self) -> models.CasConfig:
        """The store's limits: what a client needs to plan uploads."""
        return models.build(models.CasConfig, self._get("/api/cas"))

    @operation("cas_find_missing")
    def cas_find_missing(
        self, digests: Sequence[str], *, batch: int = FIND_MISSING_MAX
    ) -> list[str]:
        """The names among `digests` the store lacks (for this company), in order; asked in
        requests of at most `batch` names."""
        missing: list[str] = []
        for start in range(0, len(digests), batch):
            data = self.request(
                "POST",
                "/api/cas/find-missing",
                json={"digests": list(digests[start : start + batch])},
                idempotent=True,
            )
            missing.extend(str(d) for d in data["missing"])
        return missing

    @operation("cas_blob_put")
    def cas_put(
        self, name: str, content: IO[bytes] | Iterator[bytes] | bytes, size: int
    ) -> models.CasPut:
        """Store one blob, streamed: `content` is a binary file (read from its current
        position, `size` bytes, in pieces; re-read from there on a retry), an iterator of
        chunks (not repeated once started) or bytes. Repeatable: a blob is named by its
        content. `BlobDigestMismatch` when the bytes are not `name`'s; `BlobTooLarge`."""
        body: Callable[[], bytes | Iterator[bytes]]
        if isinstance(content, bytes):
            data = content
            body = lambda: data  # noqa: E731
        elif hasattr(content, "seek") and hasattr(content, "read"):
            stream = cast(IO[bytes], content)
            start = stream.tell()

            def body() -> Iterator[bytes]:
                stream.seek(start)
                return _read_pieces(stream, size)
        else:
            pieces = content
            used: list[bool] = []

            def body() -> Iterator[bytes]:
                if used:
                    raise httpx.ConnectError("an iterator body cannot be sent twice")
                used.append(True)
                return pieces

        data_ = self.request(
            "PUT",
            f"/api/cas/blobs/{name}",
            content=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            idempotent=True,
        )
        return models.build(models.CasPut, data_)

    @operation("cas_batch_upload")
    def cas_put_batch(self, frames: Sequence[tuple[str, bytes] | BatchFrame]) -> models.CasBatch:
        """Store many small blobs in one request, all or nothing: the body is, for each blob,
        the ASCII line `<name> <size>\n` then exactly `size` bytes. Keep it under the store's
        `max_batch_bytes` and `max_batch_blobs` (`cas_config()`). A frame is `(name, bytes)`
        or a `BatchFrame` whose bytes are read while the body is sent: the body is streamed
        with its `Content-Length`, never joined in memory (read again on a retry)."""
        parts = [
            f if isinstance(f, BatchFrame) else BatchFrame(f[0], len(f[1]), _constant(f[1]))
            for f in frames
        ]
        heads = [f"{f.name} {f.size}\n".encode("ascii") for f in parts]
        length = sum(len(h) for h in heads) + sum(f.size for f in parts)

        def body() -> Iterator[bytes]:
            # Small blobs' frames are gathered into pieces of about PIECE_BYTES: one socket
            # write per frame part cost more than the bytes (tens of thousands of sends for a
            # first snapshot). Memory stays bounded by one piece.
            pending: list[bytes] = []
            held = 0
            for head, frame in zip(heads, parts, strict=True):
                pending.append(head)
                held += len(head)
                for piece in frame.read():
                    pending.append(piece)
                    held += len(piece)
                    if held >= PIECE_BYTES:
                        yield b"".join(pending)
                        pending, held = [], 0
            if pending:
                yield b"".join(pending)

        data_ = self.request(
            "POST",
            "/api/cas/batch",
            content=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(length)},
            idempotent=True,
        )
        return models.build(models.CasBatch, data_)

    @operation("cas_blob_get")
    def cas_get(self, name: str, dest: IO[bytes]) -> int:
        """Stream the blob `name` into the binary file `dest` (from its current position,
        which a retry goes back to, truncating what follows) and check its digest; the number
        of bytes written. `NotFound` for a name the store lacks; `BlobCorrupt` when the bytes
        received are not `name`'s."""
        start = dest.tell()

        def receive(response: httpx.Response) -> int:
            dest.seek(start)
            dest.truncate()
            digest = hashlib.sha256()
            written = 0
            for piece in response.iter_bytes(PIECE_BYTES):
                digest.update(piece)
                dest.write(piece)
                written += len(piece)
            if "sha256:" + digest.hexdigest() != name:
                raise BlobCorrupt(name, written)
            return written

        return int(self.request("GET", f"/api/cas/blobs/{name}", idempotent=True, receive=receive))

    def cas_get_bytes(self, name: str) -> bytes:
        """A small blob (a directory) in memory, checked."""
        buffer = io.BytesIO()
        self.cas_get(name, buffer)
        return buffer.getvalue()

    @operation("run_snapshot_register")
    def snapshot_register(
        self,
        run_id: str,
        *,
        tree: str,
        base: str | None,
        generation: int,
        fence: int | None = None,
    ) -> models.Snapshot:
        """Register the tree `tree` (every blob it reaches already stored) as the run's
        snapshot, started from the workspace head `base`; fenced by the runtime lease's
        `generation` (`WorkspaceRuntimeLeaseSuperseded`). `SnapshotBlobsMissing` (with
        `details["missing"]`), `SnapshotTreeInvalid` (`details["path"]`, `["reason"]`).
        Repeatable: the same registration again is answered 200."""
        body: dict[str, Any] = {"tree": tree, "base": base, "generation": generation}
        if fence is not None:
            body["fence"] = fence
        data = self.request(
            "POST", f"/api/heartbeat-runs/{run_id}/snapshots", json=body, idempotent=True
        )
        return models.build(models.Snapshot, data)

    @operation("execution_workspace_head")
    def workspace_head(self, workspace_id: str) -> models.WorkspaceHead:
        """The workspace's published tree (`tree` None: empty), the run that published it."""
        data = self._get(f"/api/execution-workspaces/{workspace_id}/head")
        return models.build(models.WorkspaceHead, data)

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
        body = _drop_none(
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
        return models.build(
            models.EnvironmentLease, self._get(f"/api/environment-leases/{lease_id}")
        )

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


class BatchFrame(NamedTuple):
    """One blob of a batch upload: its name, its size and `read()`, which gives its bytes
    from the start each time it is called (exactly `size` of them, in pieces)."""

    name: str
    size: int
    read: Callable[[], Iterable[bytes]]


def _constant(data: bytes) -> Callable[[], Iterable[bytes]]:
    return lambda: (data,)


def _read_pieces(stream: IO[bytes], size: int) -> Iterator[bytes]:
    left = size
    while left > 0:
        piece = stream.read(min(PIECE_BYTES, left))
        if not piece:
            break  # the file shrank: the server answers blob_digest_mismatch
        left -= len(piece)
        yield piece


def _decode(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return None


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _reason(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
