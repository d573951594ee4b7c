"""Worker-platform stop proofs (docs/recovery.md#worker-platform-stop-proofs).

A receipt may name the deployment worker that ran the controller (`worker`). Before taking
over such a receipt without an operator, the configured platform (setting
`PAPERCLIP_WORKER_PLATFORM`) is asked whether that exact worker, orphaned children included,
has stopped: `verified` (with a proof that is stored with the new receipt), `pending` (the
worker is known but no stop has been reported yet) or `unverified` (anything else: unsigned,
mismatched, or no platform configured). Only `verified` authorises an automatic takeover.

The shipped `SignedReceiptPlatform`: a deployment platform reports a stopped worker with an
HMAC-SHA256 signature (key: `PAPERCLIP_PLATFORM_STOP_SECRET`) over the canonical JSON
`{"ownerToken","runId","stoppedAt","workerId"}`; receipts are stored in `worker_stop_receipts`
and re-verified every time they are used.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any, Literal, Protocol
from uuid import UUID

from django.conf import settings
from django.utils.module_loading import import_string

from recovery.canonical import canonical_json
from recovery.models import WorkerStopReceipt

PROOF_SCHEMA = "paperclip.worker-stop-receipt.v1"
StopStatus = Literal["verified", "pending", "unverified"]


@dataclass(frozen=True, slots=True)
class StopProofCheck:
    status: StopStatus
    proof: dict[str, Any] | None = None


class WorkerPlatform(Protocol):
    def current_worker(self) -> dict[str, Any] | None:
        """A descriptor of the deployment worker this process runs in, or None."""

    def request_stop_proof(
        self, *, run_id: UUID, owner_token: str, worker: dict[str, Any]
    ) -> StopProofCheck:
        """Has `worker`, which held `owner_token` for `run_id`, stopped?"""


def worker_stop_signature(
    *, secret: str, run_id: UUID | str, owner_token: str, worker_id: str, stopped_at: str
) -> str:
    """The hex HMAC-SHA256 a platform sends with a stop receipt."""
    message = canonical_json(
        {
            "ownerToken": owner_token,
            "runId": str(run_id),
            "stoppedAt": stopped_at,
            "workerId": worker_id,
        }
    )
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def stop_secret() -> str:
    return str(getattr(settings, "PAPERCLIP_PLATFORM_STOP_SECRET", "") or "")


class SignedReceiptPlatform:
    """Stop proofs are HMAC-signed receipts recorded by the deployment platform."""

    def current_worker(self) -> dict[str, Any] | None:
        worker_id = os.environ.get("PAPERCLIP_WORKER_ID", "").strip()
        if not worker_id:
            return None
        return {"id": worker_id, "platform": "signed-receipt"}

    def request_stop_proof(
        self, *, run_id: UUID, owner_token: str, worker: dict[str, Any]
    ) -> StopProofCheck:
        secret = stop_secret()
        worker_id = worker.get("id")
        if not secret or not isinstance(worker_id, str):
            return StopProofCheck("unverified")
        receipt = WorkerStopReceipt.objects.filter(run_id=run_id, owner_token=owner_token).first()
        if receipt is None:
            return StopProofCheck("pending")
        expected = worker_stop_signature(
            secret=secret,
            run_id=run_id,
            owner_token=owner_token,
            worker_id=receipt.worker_id,
            stopped_at=receipt.stopped_at,
        )
        if receipt.worker_id != worker_id or not hmac.compare_digest(expected, receipt.signature):
            return StopProofCheck("unverified")
        return StopProofCheck(
            "verified",
            {
                "schema": PROOF_SCHEMA,
                "receiptId": str(receipt.id),
                "runId": str(run_id),
                "ownerToken": owner_token,
                "workerId": receipt.worker_id,
                "stoppedAt": receipt.stopped_at,
                "signature": receipt.signature,
            },
        )


@functools.cache
def _platform(path: str) -> WorkerPlatform:
    platform: WorkerPlatform = import_string(path)()
    return platform


def worker_platform() -> WorkerPlatform:
    return _platform(str(settings.PAPERCLIP_WORKER_PLATFORM))


def current_workspace_worker() -> dict[str, Any] | None:
    return worker_platform().current_worker()


def request_worker_stop_proof(
    *, run_id: UUID, owner_token: str, worker: dict[str, Any]
) -> StopProofCheck:
    return worker_platform().request_stop_proof(
        run_id=run_id, owner_token=owner_token, worker=worker
    )
