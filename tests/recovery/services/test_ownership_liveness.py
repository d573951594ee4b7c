"""Ownership on real connections: the keepalive against idle_in_transaction_session_timeout,
progress writes with an application connection budget of one, the follow-up job an owner
defers as it lets go, same-boot join
evidence after a real cleanup failure, and what assert_held rechecks after a platform-proof
takeover (ordinary and retained-repair)."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import psycopg.errors
import pytest
from django.db import OperationalError, connection
from django.db.backends.postgresql.base import DatabaseWrapper
from django.test import override_settings

from paperclip.db.clock import db_now
from paperclip.models import (
    ActivityEvent,
    HeartbeatRun,
    Issue,
    NativeRunFinalization,
    NativeRunResult,
    WorkspaceOperation,
)
from paperclip.receipts import OWNER_KEY, STOP_PROOF_KEY
from paperclip.worker.jobs import pending_jobs
from recovery.adapters.identity import current_controller_identity
from recovery.adapters.platform import StopProofCheck, StopStatus, worker_stop_signature
from recovery.errors import FinalizationBindingMissing, FinalizationOwnershipLost
from recovery.locks import finalization_queueing_lock
from recovery.models import IssueRecoveryAction
from recovery.selectors.actions import OWNER_UNVERIFIED_CAUSE, owner_fingerprint
from recovery.services import (
    Acquired,
    FinalizationOwnership,
    NotAcquired,
    run_finalize,
    with_finalization_ownership,
)
from recovery.services.finalization_jobs import FOLLOW_UP_DELAY
from recovery.services.ownership import acquire, memory, receipt_release
from recovery.services.worker_stops import worker_stop_record
from tests.helpers import raw_connection, wait_for_lock_waiters
from tests.paperclip.factories import (
    CompanyFactory,
    HeartbeatRunFactory,
    IssueFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
)
from tests.recovery.factories import RecoveryActionFactory, make_binding, receipt_for

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "stop-secret-for-tests"


def _advisory_locks_of(pid: int) -> int:
    with raw_connection() as other:
        row = other.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s AND granted",
            [pid],
        ).fetchone()
    return int(row[0]) if row else 0


@contextlib.contextmanager
def _database_setting(name: str, value: str) -> Iterator[None]:
    """ALTER DATABASE for the test database: every *new* session gets the setting."""
    db = connection.settings_dict["NAME"]
    with raw_connection() as admin:
        admin.execute(f'ALTER DATABASE "{db}" SET {name} = {value}')
    try:
        yield
    finally:
        with raw_connection() as admin:
            admin.execute(f'ALTER DATABASE "{db}" RESET {name}')


# --- keepalive --------------------------------------------------------------------------------


def test_keepalive_holds_the_lock_through_a_2s_action_with_a_500ms_idle_timeout() -> None:
    b = make_binding()
    connection.ensure_connection()  # the application's own session predates the setting
    with _database_setting("idle_in_transaction_session_timeout", "500"):
        # Control: the server really ends an idle transaction of a new session after 500 ms.
        with raw_connection(autocommit=False) as control:
            control.execute("SELECT 1")
            time.sleep(1.0)  # idle in transaction on purpose: the thing under test
            with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
                control.execute("SELECT 1")
        seen: dict[str, Any] = {}

        def slow(own: FinalizationOwnership) -> str:
            with raw_connection() as other:
                seen["timeout"] = other.execute(
                    "SELECT setting FROM pg_settings "
                    "WHERE name = 'idle_in_transaction_session_timeout'"
                ).fetchone()
            threading.Event().wait(2.0)  # the copy-back's duration, not a synchronisation
            seen["locks_after_2s"] = _advisory_locks_of(own.lock_backend_pid)
            own.assert_held()
            return "survived"

        outcome = with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=slow)
    assert seen["timeout"] == ("500",)
    assert seen["locks_after_2s"] == 1
    assert outcome == Acquired("survived")


def _terminate(pid: int) -> None:
    with raw_connection() as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])


def _replace_receipt(own: FinalizationOwnership) -> None:
    with raw_connection() as other:
        other.execute(
            "UPDATE heartbeat_runs SET runner_profile_json = jsonb_set(runner_profile_json,"
            " ARRAY[%s, 'token'], to_jsonb('someone-else'::text)) WHERE id = %s",
            [OWNER_KEY, own.run_id],
        )


def _lose_the_ordinary_connection(own: FinalizationOwnership) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    _terminate(pid)


def _lose_the_lock_connection_to_the_keepalive(own: FinalizationOwnership) -> None:
    _terminate(own.lock_backend_pid)
    deadline = time.monotonic() + 10
    while own._session.failure is None:  # the keepalive thread's next ping records it
        assert time.monotonic() < deadline, "the keepalive never noticed the lost connection"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("lose", "reason"),
    [
        pytest.param(_replace_receipt, "owner_replaced", id="receipt-replaced"),
        pytest.param(_lose_the_ordinary_connection, "database_unavailable", id="database-lost"),
        pytest.param(
            _lose_the_lock_connection_to_the_keepalive, "lock_connection_lost", id="keepalive"
        ),
    ],
)
def test_assert_held_names_how_the_ownership_was_lost(lose: Any, reason: str) -> None:
    """The reason travels in the exception (and the worker's log of the failed job): each way
    of losing the ownership is named, including a lock connection the keepalive found dead."""
    b = make_binding()
    errors: list[FinalizationOwnershipLost] = []

    def action(own: FinalizationOwnership) -> None:
        lose(own)
        try:
            own.assert_held()
        except FinalizationOwnershipLost as exc:
            errors.append(exc)
            raise

    def controller() -> None:
        try:
            with contextlib.suppress(FinalizationOwnershipLost, OperationalError):
                with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=action)
        finally:
            connection.close()

    connection.ensure_connection()  # the application's own session predates the setting
    # A 300 ms idle timeout makes the keepalive ping every 0.1 s.
    with (
        _database_setting("idle_in_transaction_session_timeout", "300"),
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        pool.submit(controller).result(timeout=30)
    assert [e.reason for e in errors] == [reason]


# --- an application connection budget of one ---------------------------------------------------


@contextlib.contextmanager
def application_connection_budget(limit: int) -> Iterator[None]:
    """Let the application (Django) hold at most `limit` open database connections, like a
    pool of that size: asking for another one fails at once."""
    connection.ensure_connection()
    opened: list[Any] = [connection.connection]
    original = DatabaseWrapper.get_new_connection

    def guarded(self: DatabaseWrapper, conn_params: dict[str, Any]) -> Any:
        if sum(1 for c in opened if not c.closed) >= limit:
            raise OperationalError(f"application connection budget ({limit}) exhausted")
        conn = original(self, conn_params)
        opened.append(conn)
        return conn

    DatabaseWrapper.get_new_connection = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        DatabaseWrapper.get_new_connection = original  # type: ignore[method-assign]


def test_progress_writes_work_while_the_application_connection_budget_is_one(
    tmp_path: Path,
) -> None:
    b = make_binding(tmp_path=tmp_path)
    seen: dict[str, Any] = {}

    def second_application_connection() -> None:
        try:
            HeartbeatRun.objects.count()
            seen["control"] = "got a second connection"
        except OperationalError as exc:
            seen["control"] = str(exc)
        finally:
            connection.close()

    def action(own: FinalizationOwnership) -> None:
        # Control: the budget is real; another application connection is refused.
        probe = threading.Thread(target=second_application_connection)
        probe.start()
        probe.join(timeout=10)
        op = WorkspaceOperation.objects.create(
            company=b.company, heartbeat_run=b.run, issue=b.issue, phase="progress"
        )
        with raw_connection() as observer:  # committed, not parked inside the lock transaction
            row = observer.execute(
                "SELECT count(*) FROM workspace_operations WHERE id = %s", [op.pk]
            ).fetchone()
        seen["visible"] = row[0] if row else None
        seen["lock_held"] = _advisory_locks_of(own.lock_backend_pid)

    with application_connection_budget(1):
        first = with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=action)
        full = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert first == Acquired(None)
    assert seen == {
        "control": "application connection budget (1) exhausted",
        "visible": 1,
        "lock_held": 1,
    }
    assert isinstance(full, Acquired)
    assert full.value.status == "committed"
    assert b.dest_dir is not None
    assert (b.dest_dir / "README.md").read_text() == "hello\n"


# --- the follow-up job an owner defers as it lets go ------------------------------------------


def _finalize_jobs(run_id: Any) -> list[Any]:
    return pending_jobs(finalization_queueing_lock(run_id))


def test_an_owner_leaving_work_behind_defers_its_follow_up_at_commit() -> None:
    b = make_binding()
    seen_inside: list[Any] = []

    def action(own: FinalizationOwnership) -> None:
        # Nothing is deferred while the owner is still working (and nothing committed here).
        with raw_connection() as other:
            seen_inside.extend(
                other.execute(
                    "SELECT id FROM procrastinate_jobs WHERE queueing_lock = %s",
                    [finalization_queueing_lock(b.run.pk)],
                ).fetchall()
            )

    before = db_now()
    with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=action)
    jobs = _finalize_jobs(b.run.pk)
    assert seen_inside == []
    assert [job.status for job in jobs] == ["todo"]
    assert jobs[0].args == {
        "company_id": str(b.company.pk),
        "run_id": str(b.run.pk),
        "explicit": False,
    }
    # Not before the lock transaction has surely ended.
    assert jobs[0].scheduled_at is not None
    assert jobs[0].scheduled_at >= before + FOLLOW_UP_DELAY


def test_a_committed_run_leaves_no_follow_up(tmp_path: Path) -> None:
    b = make_binding(tmp_path=tmp_path)
    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)
    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "committed"
    assert _finalize_jobs(b.run.pk) == []


def test_a_refused_owner_defers_nothing() -> None:
    b = make_binding(receipt=receipt_for(hostname="elsewhere.example"))
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: 1
    )
    assert outcome == NotAcquired("owner_unverified")
    assert _finalize_jobs(b.run.pk) == []


# --- same-boot join evidence after a real cleanup failure -------------------------------------


def test_failed_cleanup_leaves_join_evidence_only_this_boot_can_use() -> None:
    b = make_binding()
    tokens: list[str] = []

    def kill_my_application_connection(own: FinalizationOwnership) -> None:
        tokens.append(own.token)
        pid = connection.connection.info.backend_pid
        with raw_connection() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])

    # The action finished, but the final check and the receipt removal both fail: the
    # application's connection died under them.
    with pytest.raises(FinalizationOwnershipLost):
        with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=kill_my_application_connection
        )
    connection.close()
    b.run.refresh_from_db()
    left = b.run.runner_profile_json[OWNER_KEY]
    assert left["token"] == tokens[0]
    assert left["controllerBootId"] == current_controller_identity().boot_id
    assert tokens[0] in memory.joined_owner_tokens

    # This boot knows its action joined, so it takes the receipt over without a board action.
    assert with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda o: "again"
    ) == Acquired("again")
    takeover = ActivityEvent.objects.get(action="run.finalization_owner_takeover")
    assert takeover.details["takeoverBasis"] == "same_boot_joined"
    assert not IssueRecoveryAction.objects.exists()
    assert not memory.joined_owner_tokens


def test_a_receipt_left_by_a_failed_cleanup_is_removed_once_the_database_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failover: the action ended but its receipt could not be removed (the connection died,
    and the removal itself fails). The process retries in the background, removes it once the
    database answers, and defers the run's next attempt, so that any worker, not only this
    one, can carry on without holding the run for the board."""
    monkeypatch.setattr(receipt_release, "RELEASE_RETRY_DELAYS", (0.05, 0.05, 0.05, 0.05))
    b = make_binding()
    tokens: list[str] = []
    real_remove = receipt_release._remove_receipt
    attempts: list[int] = []

    def still_away_once(**kwargs: Any) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise OperationalError("the database is still failing over")
        real_remove(**kwargs)

    def kill_my_application_connection(own: FinalizationOwnership) -> None:
        tokens.append(own.token)
        monkeypatch.setattr(receipt_release, "_remove_receipt", still_away_once)
        with raw_connection() as admin:
            admin.execute(
                "SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid]
            )

    with pytest.raises(FinalizationOwnershipLost):
        with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=kill_my_application_connection
        )
    connection.close()
    deadline = time.monotonic() + 10
    while tokens[0] in memory.joined_owner_tokens and time.monotonic() < deadline:
        time.sleep(0.02)  # the background retry
    b.run.refresh_from_db()
    assert OWNER_KEY not in b.run.runner_profile_json
    assert len(attempts) == 2  # the removal at release failed, the first retry removed it
    released = ActivityEvent.objects.get(action="run.finalization_owner_released")
    assert released.details == {"token": tokens[0]}
    assert _finalize_jobs(b.run.pk) != []  # the next attempt, for any worker


# --- platform proof: what assert_held rechecks ----------------------------------------------------


def _record_stop(run_id: Any, token: str, worker_id: str) -> None:
    stopped_at = "2026-01-02T03:04:05+00:00"
    worker_stop_record(
        run_id=run_id,
        owner_token=token,
        worker_id=worker_id,
        stopped_at=stopped_at,
        signature=worker_stop_signature(
            secret=SECRET,
            run_id=run_id,
            owner_token=token,
            worker_id=worker_id,
            stopped_at=stopped_at,
        ),
    )


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize("with_issue", [True, False])
def test_a_worker_whose_stop_is_not_reported_yet_is_platform_stop_pending(
    with_issue: bool,
) -> None:
    """The platform knows the worker but has reported no stop: wait for it. The hold is
    recorded against the run's issue; a run without an issue has none to record."""
    prior = receipt_for(hostname="pod-2.cluster", worker={"id": "pod-2"})
    b = make_binding(receipt=prior)
    if not with_issue:
        HeartbeatRun.objects.filter(pk=b.run.pk).update(issue=None, native_issue=None)
    ran: list[int] = []
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: ran.append(1)
    )
    assert outcome == NotAcquired("platform_stop_pending")
    assert ran == []
    assert HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json[OWNER_KEY] == prior
    holds = IssueRecoveryAction.objects.filter(cause=OWNER_UNVERIFIED_CAUSE)
    if with_issue:
        assert holds.get().fingerprint == owner_fingerprint(b.run.pk, prior)
    else:
        assert not holds.exists()


class _PendingWithProof:
    """A worker platform whose answer carries a proof although its status is not `verified`."""

    status: StopStatus = "pending"

    def current_worker(self) -> dict[str, Any] | None:
        return None

    def request_stop_proof(self, *, run_id: Any, owner_token: str, worker: Any) -> StopProofCheck:
        return StopProofCheck(self.status, {"workerId": worker["id"]})


class _UnverifiedWithProof(_PendingWithProof):
    status: StopStatus = "unverified"


@pytest.mark.parametrize(
    ("platform", "reason"),
    [("_PendingWithProof", "platform_stop_pending"), ("_UnverifiedWithProof", "owner_unverified")],
)
def test_only_a_verified_stop_check_authorises_a_takeover(platform: str, reason: str) -> None:
    """The platform's status decides, not whether its answer carries a proof."""
    prior = receipt_for(hostname="pod-7.cluster", worker={"id": "pod-7"})
    b = make_binding(receipt=prior)
    with override_settings(PAPERCLIP_WORKER_PLATFORM=f"{__name__}.{platform}"):
        outcome = with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda own: "ran"
        )
    assert outcome == NotAcquired(reason)
    profile = HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json
    assert (profile[OWNER_KEY], STOP_PROOF_KEY in profile) == (prior, False)
    hold = IssueRecoveryAction.objects.get(cause=OWNER_UNVERIFIED_CAUSE)
    assert hold.fingerprint == owner_fingerprint(b.run.pk, prior)


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
def test_platform_proof_takeover_finalizes_and_commits(tmp_path: Path) -> None:
    prior = receipt_for(hostname="pod-9.cluster", worker={"id": "pod-9"})
    b = make_binding(tmp_path=tmp_path, receipt=prior)
    _record_stop(b.run.pk, prior["token"], "pod-9")

    outcome = run_finalize(company_id=b.company.pk, run_id=b.run.pk)

    # The commit is the owner's own progress, not a replaced task.
    assert isinstance(outcome, Acquired)
    assert outcome.value.status == "committed"
    b.refresh()
    assert (b.coordinator.phase, b.run.status) == ("committed", "succeeded")
    assert b.dest_dir is not None
    assert (b.dest_dir / "src" / "main.py").exists()


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
# A later run taking the issue (its slots) is not "the task moved on": the held run's saved
# result still waits (docs/recovery.md#one-hold-per-held-run).
@pytest.mark.parametrize("how", ["result_replaced"])
def test_platform_proof_takeover_stops_when_the_task_moves_on(how: str) -> None:
    prior = receipt_for(hostname="pod-3.cluster", worker={"id": "pod-3"})
    b = make_binding(receipt=prior)
    _record_stop(b.run.pk, prior["token"], "pod-3")

    def action(own: FinalizationOwnership) -> None:
        own.assert_held()
        if how == "issue_rebound":  # the task was handed to another run meanwhile
            newer = NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue)
            Issue.objects.filter(pk=b.issue.pk).update(execution_run=newer)
        else:  # another accepted result of this run now waits: not the one taken over for
            other = NativeRunResultFactory(run=b.run, company=b.company, issue=b.issue)
            NativeRunFinalization.objects.filter(pk=b.run.pk).update(result=other)
        own.assert_held()

    with pytest.raises(FinalizationOwnershipLost) as lost:
        with_finalization_ownership(company_id=b.company.pk, run_id=b.run.pk, action=action)
    assert lost.value.reason == "task_replaced"


def _retained_repair(receipt: dict[str, Any]) -> tuple[Any, IssueRecoveryAction]:
    b = make_binding(receipt=receipt)
    HeartbeatRun.objects.filter(pk=b.run.pk).update(status="failed")
    b.issue.execution_run = None
    b.issue.checkout_run = None
    b.issue.save(update_fields=["execution_run", "checkout_run"])
    repair = IssueRecoveryAction.objects.create(
        company=b.company,
        source_issue=b.issue,
        kind="workspace_validation",
        owner_type="board",
        cause="native_workspace_sync_out_retry_exhausted",
        fingerprint="export-1",
        evidence={
            "runId": str(b.run.pk),
            "workspaceRecovery": {"schema": "paperclip.workspace-recovery.v1"},
        },
        next_action="repair",
    )
    return b, repair


def test_ownership_binds_only_this_companys_native_run_or_the_legacy_run_of_a_retained_repair() -> (
    None
):
    b, repair = _retained_repair(receipt_for(hostname="elsewhere.example"))
    ran: list[int] = []
    args = {"run_id": b.run.pk, "action": lambda own: ran.append(1)}
    with pytest.raises(FinalizationBindingMissing) as missing:  # named under another company
        with_finalization_ownership(company_id=CompanyFactory().pk, **args)
    assert missing.value.details == {"run_id": str(b.run.pk)}
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runtime_mode="legacy")
    with pytest.raises(FinalizationBindingMissing):  # a legacy run has no native finalization
        with_finalization_ownership(company_id=b.company.pk, **args)
    # ... but its retained repair is finalized (here: held for an unverified owner).
    assert with_finalization_ownership(
        company_id=b.company.pk, retained_repair_action_id=repair.pk, **args
    ) == NotAcquired("owner_unverified")
    assert ran == []


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
def test_retained_repair_with_proof_rechecks_the_repair_binding() -> None:
    prior = receipt_for(hostname="pod-4.cluster", worker={"id": "pod-4"})
    b, repair = _retained_repair(prior)
    _record_stop(b.run.pk, prior["token"], "pod-4")
    intruder = NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue)

    def action(own: FinalizationOwnership) -> None:
        own.assert_held()
        b.issue.execution_run = intruder  # not the recorded independent continuation
        b.issue.save(update_fields=["execution_run"])
        own.assert_held()

    with pytest.raises(FinalizationOwnershipLost) as lost:
        with_finalization_ownership(
            company_id=b.company.pk,
            run_id=b.run.pk,
            action=action,
            retained_repair_action_id=repair.pk,
        )
    assert lost.value.reason == "task_replaced"


def test_retained_repair_never_records_a_hold_and_a_held_lock_is_busy() -> None:
    b, repair = _retained_repair(receipt_for(hostname="elsewhere.example"))
    args = {"company_id": b.company.pk, "run_id": b.run.pk, "retained_repair_action_id": repair.pk}
    assert with_finalization_ownership(**args, action=lambda o: 1) == NotAcquired(
        "owner_unverified"
    )
    assert list(IssueRecoveryAction.objects.values_list("pk", flat=True)) == [repair.pk]
    HeartbeatRun.objects.filter(pk=b.run.pk).update(runner_profile_json={})
    inside, release = threading.Event(), threading.Event()

    def hold(own: FinalizationOwnership) -> None:
        inside.set()
        assert release.wait(timeout=10)

    def holder() -> Any:
        try:
            return with_finalization_ownership(
                company_id=b.company.pk, run_id=b.run.pk, action=hold
            )
        finally:
            connection.close()

    worker = threading.Thread(target=holder)
    worker.start()
    try:
        assert inside.wait(timeout=10)
        # The same process holds it, but a retained repair never reports owner_active.
        assert with_finalization_ownership(**args, action=lambda o: 1) == NotAcquired("busy")
    finally:
        release.set()
        worker.join(timeout=10)


# --- platform proof: the task must still be current under the swap --------------------------


def _proof_binding(worker_id: str) -> tuple[Any, dict[str, Any]]:
    prior = receipt_for(hostname=f"{worker_id}.cluster", worker={"id": worker_id})
    b = make_binding(receipt=prior)
    _record_stop(b.run.pk, prior["token"], worker_id)
    return b, prior


def _move_on(b: Any, how: str) -> None:
    """Break one condition of "the accepted result still waits for this run's finalization"."""
    coordinators = NativeRunFinalization.objects.filter(pk=b.run.pk)
    if how == "no_result":
        coordinators.update(result=None)
    elif how == "committed":
        coordinators.update(phase="committed")
    elif how == "issue_rebound":
        newer = NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue)
        Issue.objects.filter(pk=b.issue.pk).update(execution_run=newer)
    elif how == "result_not_accepted":
        NativeRunResult.objects.filter(pk=b.result.pk).update(schema_status="rejected")
    elif how == "coordinator_of_another_issue":
        coordinators.update(issue=IssueFactory(company=b.company))
    elif how == "coordinator_of_another_company":
        coordinators.update(company=CompanyFactory())
    elif how == "issue_of_another_company":
        Issue.objects.filter(pk=b.issue.pk).update(company=CompanyFactory())
    elif how.startswith("result_of_another_"):
        other_run = NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue)
        fields: dict[str, Any] = {"run": other_run}
        if how == "result_of_another_issue":
            fields = {"run": b.run, "issue": IssueFactory(company=b.company)}
        elif how == "result_of_another_company":
            fields = {"run": b.run, "company": CompanyFactory()}
        coordinators.update(result=NativeRunResultFactory(**fields))
    else:
        assert how == "still_current"


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize(
    "how",
    [
        "still_current",
        "no_result",
        "committed",
        "issue_rebound",
        "result_not_accepted",
        "coordinator_of_another_issue",
        "coordinator_of_another_company",
        "issue_of_another_company",
        "result_of_another_run",
        "result_of_another_issue",
        "result_of_another_company",
    ],
)
def test_a_platform_proof_takes_over_only_while_this_runs_accepted_result_waits(
    how: str,
) -> None:
    b, prior = _proof_binding("pod-5")
    _move_on(b, how)
    ran: list[FinalizationOwnership] = []
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: ran.append(own) or "ran"
    )
    takeovers = ActivityEvent.objects.filter(action="run.finalization_owner_takeover")
    if how in ("still_current", "issue_rebound"):  # a later run holding the issue: still ours
        assert outcome == Acquired("ran")
        assert takeovers.get().details["takeoverBasis"] == "platform_stop_proof"
        return
    assert outcome == NotAcquired("binding_changed")
    assert ran == []
    assert HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json[OWNER_KEY] == prior
    assert not takeovers.exists()
    assert not ActivityEvent.objects.filter(action="issue.workspace_owner_stop_verified").exists()


def _takeover_waits_behind(table: str, row_id: Any, takeover: Any) -> tuple[bool, Any]:
    """Hold `table`'s row `row_id` on another connection, run `takeover` in a thread and see
    whether it queues behind that row before it finishes; then let go."""
    with raw_connection(autocommit=False) as gate:
        key = "run_id" if table == "native_run_finalizations" else "id"
        gate.execute(f"SELECT 1 FROM {table} WHERE {key} = %s FOR NO KEY UPDATE", [row_id])  # noqa: S608

        def attempt() -> Any:
            try:
                return takeover()
            finally:
                connection.close()

        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(attempt)
            waited = wait_for_lock_waiters(1, until=future.done, holder=gate, table=table)
            gate.rollback()
            return waited, future.result(timeout=30)


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize("table", ["issues", "native_run_finalizations"])
def test_a_platform_proof_takeover_rechecks_the_task_under_its_row_locks(table: str) -> None:
    """The recheck runs under the issue and coordinator row locks (atomic with the swap): a
    takeover queues behind either row held elsewhere."""
    b, _ = _proof_binding("pod-6")
    row_id = b.issue.pk if table == "issues" else b.run.pk
    waited, outcome = _takeover_waits_behind(
        table,
        row_id,
        lambda: with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda own: "ran"
        ),
    )
    assert waited, f"the takeover did not wait for the held {table} row: {outcome}"
    assert outcome == Acquired("ran")


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize("lookalike", ["run", "coordinator"])
def test_a_platform_proof_takeover_neither_reads_nor_locks_the_first_rows_of_the_company(
    lookalike: str,
) -> None:
    """A run (without an issue) or a committed coordinator of the company that sorts first by
    primary key (what a lookup without its key would read and lock) changes nothing: held on
    another connection, the takeover does not queue behind it, and goes through."""
    b, _ = _proof_binding("pod-11")
    first = uuid.UUID(int=0)
    if lookalike == "run":
        HeartbeatRunFactory(id=first, company=b.company, agent=b.agent)
        table = "heartbeat_runs"
    else:
        earlier = NativeRunFactory(
            id=first, company=b.company, agent=b.agent, issue=b.issue, status="failed"
        )
        NativeRunFinalizationFactory(run=earlier, phase="committed")
        table = "native_run_finalizations"
    waited, outcome = _takeover_waits_behind(
        table,
        first,
        lambda: with_finalization_ownership(
            company_id=b.company.pk, run_id=b.run.pk, action=lambda own: "ran"
        ),
    )
    assert not waited, f"the takeover queued behind another run's {table} row"
    assert outcome == Acquired("ran")


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
def test_a_platform_proof_takeover_of_a_run_deleted_before_the_swap_claims_nothing() -> None:
    b, _ = _proof_binding("pod-12")
    acquire.before_claim_hook = lambda: HeartbeatRun.objects.filter(pk=b.run.pk).delete()
    ran: list[int] = []
    outcome = with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: ran.append(1)
    )
    assert outcome == NotAcquired("binding_changed")
    assert ran == []
    assert not ActivityEvent.objects.filter(action__startswith="run.finalization_owner").exists()


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize("table", ["issues", "native_run_finalizations", "issue_recovery_actions"])
def test_a_retained_repair_takeover_rechecks_the_repair_under_its_row_locks(table: str) -> None:
    prior = receipt_for(hostname="pod-7.cluster", worker={"id": "pod-7"})
    b, repair = _retained_repair(prior)
    _record_stop(b.run.pk, prior["token"], "pod-7")
    row_id = {"issues": b.issue.pk, "native_run_finalizations": b.run.pk}.get(table, repair.pk)
    waited, outcome = _takeover_waits_behind(
        table,
        row_id,
        lambda: with_finalization_ownership(
            company_id=b.company.pk,
            run_id=b.run.pk,
            action=lambda own: "ran",
            retained_repair_action_id=repair.pk,
        ),
    )
    assert waited, f"the takeover did not wait for the held {table} row: {outcome}"
    assert outcome == Acquired("ran")


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
def test_a_platform_proof_takeover_is_audited_and_resumes_only_this_owners_live_hold() -> None:
    b, prior = _proof_binding("pod-8")
    fingerprint = owner_fingerprint(b.run.pk, prior)
    held = {"workspaceOwnerRecovery": {"state": "operator_required"}}

    def hold(**fields: Any) -> IssueRecoveryAction:
        return RecoveryActionFactory(
            cause=OWNER_UNVERIFIED_CAUSE, fingerprint=fingerprint, evidence=held, **fields
        )

    mine = hold(source_issue=b.issue)
    other_issue = hold(source_issue=IssueFactory(company=b.company))
    resolved = hold(source_issue=b.issue, status="resolved")
    other_company = hold(source_issue=b.issue, company=CompanyFactory())
    other_owner = RecoveryActionFactory(
        source_issue=IssueFactory(company=b.company),
        cause=OWNER_UNVERIFIED_CAUSE,
        fingerprint="another-owner",
        evidence=held,
    )
    long_ago = db_now() - timedelta(days=1)
    IssueRecoveryAction.objects.update(updated_at=long_ago)

    assert with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: "ran"
    ) == Acquired("ran")

    verified = ActivityEvent.objects.get(action="issue.workspace_owner_stop_verified")
    assert (verified.company_id, verified.actor_type, verified.actor_id) == (
        b.company.pk,
        "system",
        "workspace-recovery",
    )
    assert (verified.entity_type, verified.entity_id, verified.run_id) == (
        "issue",
        str(b.issue.pk),
        b.run.pk,
    )
    assert verified.details["proof"]["workerId"] == "pod-8"
    # The proof is stored with the receipt it authorised, and stays after the release.
    stored = HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json
    assert stored[STOP_PROOF_KEY] == verified.details["proof"]
    takeover = ActivityEvent.objects.get(action="run.finalization_owner_takeover")
    assert (takeover.company_id, takeover.actor_id, takeover.run_id) == (
        b.company.pk,
        "finalization-controller",
        b.run.pk,
    )
    assert (takeover.entity_type, takeover.entity_id) == ("heartbeat_run", str(b.run.pk))
    assert takeover.details["priorToken"] == prior["token"]
    assert set(takeover.details["owner"]) >= {"token", "controllerBootId", "hostname", "pid"}

    def state(action: IssueRecoveryAction) -> Any:
        return IssueRecoveryAction.objects.get(pk=action.pk).evidence["workspaceOwnerRecovery"]

    assert state(mine) == {"state": "resuming"}
    assert IssueRecoveryAction.objects.get(pk=mine.pk).updated_at > long_ago
    for untouched in (other_issue, resolved, other_company, other_owner):
        assert state(untouched) == {"state": "operator_required"}
        assert IssueRecoveryAction.objects.get(pk=untouched.pk).updated_at == long_ago


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize("whose", ["another_owner", "another_cause"])
def test_a_platform_proof_takeover_leaves_another_live_action_of_the_issue_alone(
    whose: str,
) -> None:
    b, prior = _proof_binding("pod-9")
    theirs = RecoveryActionFactory(
        source_issue=b.issue,
        cause=OWNER_UNVERIFIED_CAUSE if whose == "another_owner" else "stranded",
        fingerprint="another-owner"
        if whose == "another_owner"
        else owner_fingerprint(b.run.pk, prior),
        evidence={"workspaceOwnerRecovery": {"state": "operator_required"}},
    )
    assert with_finalization_ownership(
        company_id=b.company.pk, run_id=b.run.pk, action=lambda own: "ran"
    ) == Acquired("ran")
    theirs.refresh_from_db()
    assert theirs.evidence["workspaceOwnerRecovery"] == {"state": "operator_required"}


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize(
    ("how", "current"),
    [
        ("still_current", True),
        ("continuation_holds_the_issue", True),
        ("evidence_names_another_run", False),
        ("no_workspace_recovery", False),
        ("controller_lease_live", False),
        ("run_not_terminal", False),
        ("another_run_holds_the_issue", False),
        ("another_run_checked_the_issue_out", False),
        ("continuation_of_another_mode", False),
        ("continuation_of_another_source_run", False),
        ("continuation_without_a_run_id", False),
        ("repair_of_another_issue", False),
        ("repair_of_another_company", False),
        ("issue_of_another_company", False),
        # A coordinator row recorded under another company is not this run's: its lease
        # does not hold the repair back.
        ("controller_lease_under_another_company", True),
    ],
)
def test_a_retained_repair_proof_takes_over_only_while_the_repair_still_names_this_run(
    how: str, current: bool
) -> None:
    prior = receipt_for(hostname="pod-10.cluster", worker={"id": "pod-10"})
    b, repair = _retained_repair(prior)
    _record_stop(b.run.pk, prior["token"], "pod-10")
    other = NativeRunFactory(company=b.company, agent=b.agent, issue=b.issue, status="failed")
    evidence = dict(repair.evidence)
    continuation = {
        "runId": str(other.pk),
        "readiness": {"mode": "fresh_isolated_workspace", "sourceRunId": str(b.run.pk)},
    }
    if how.startswith("continuation"):
        Issue.objects.filter(pk=b.issue.pk).update(execution_run=other, checkout_run=other)
        if how == "continuation_of_another_mode":
            continuation["readiness"] = {**continuation["readiness"], "mode": "shared"}
        elif how == "continuation_of_another_source_run":
            continuation["readiness"] = {**continuation["readiness"], "sourceRunId": str(other.pk)}
        elif how == "continuation_without_a_run_id":
            continuation["runId"] = None  # type: ignore[assignment]
        evidence["explicitUserContinuation"] = continuation
    elif how == "evidence_names_another_run":
        evidence["runId"] = str(other.pk)
    elif how == "no_workspace_recovery":
        del evidence["workspaceRecovery"]
    elif how == "controller_lease_live":
        NativeRunFinalization.objects.filter(pk=b.run.pk).update(lease_owner="boot-x:1:owner")
    elif how == "run_not_terminal":
        HeartbeatRun.objects.filter(pk=b.run.pk).update(status="running")
    elif how == "another_run_holds_the_issue":
        Issue.objects.filter(pk=b.issue.pk).update(execution_run=other)
    elif how == "another_run_checked_the_issue_out":
        Issue.objects.filter(pk=b.issue.pk).update(checkout_run=other)
    elif how == "repair_of_another_issue":
        IssueRecoveryAction.objects.filter(pk=repair.pk).update(
            source_issue=IssueFactory(company=b.company)
        )
    elif how == "repair_of_another_company":
        IssueRecoveryAction.objects.filter(pk=repair.pk).update(company=CompanyFactory())
    elif how == "issue_of_another_company":
        Issue.objects.filter(pk=b.issue.pk).update(company=CompanyFactory())
    elif how == "controller_lease_under_another_company":
        NativeRunFinalization.objects.filter(pk=b.run.pk).update(
            company=CompanyFactory(), lease_owner="boot-x:1:owner"
        )
    IssueRecoveryAction.objects.filter(pk=repair.pk).update(evidence=evidence)

    outcome = with_finalization_ownership(
        company_id=b.company.pk,
        run_id=b.run.pk,
        action=lambda own: "ran",
        retained_repair_action_id=repair.pk,
    )
    if current:
        assert outcome == Acquired("ran")
        return
    assert outcome == NotAcquired("binding_changed")
    assert HeartbeatRun.objects.get(pk=b.run.pk).runner_profile_json[OWNER_KEY] == prior
    assert not ActivityEvent.objects.filter(action="run.finalization_owner_takeover").exists()


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
@pytest.mark.parametrize("lookalike", ["issue", "coordinator", "action"])
def test_a_retained_repair_takeover_neither_reads_nor_locks_the_first_rows_of_the_company(
    lookalike: str,
) -> None:
    """An issue held by another run, a coordinator with a live lease, or a resolved action of
    the issue that sorts first by primary key in the company (what a lookup without its key
    would read and lock) changes nothing: held on another connection, the takeover does not
    queue behind it, and goes through."""
    prior = receipt_for(hostname="pod-13.cluster", worker={"id": "pod-13"})
    b, repair = _retained_repair(prior)
    _record_stop(b.run.pk, prior["token"], "pod-13")
    first = uuid.UUID(int=0)
    if lookalike == "issue":
        holder = NativeRunFactory(company=b.company, agent=b.agent)
        IssueFactory(id=first, company=b.company, execution_run=holder, checkout_run=holder)
        table = "issues"
    elif lookalike == "coordinator":
        earlier = NativeRunFactory(id=first, company=b.company, agent=b.agent, issue=b.issue)
        NativeRunFinalizationFactory(run=earlier, lease_owner="boot-x:1:owner")
        table = "native_run_finalizations"
    else:
        RecoveryActionFactory(id=first, source_issue=b.issue, status="resolved")
        table = "issue_recovery_actions"
    waited, outcome = _takeover_waits_behind(
        table,
        first,
        lambda: with_finalization_ownership(
            company_id=b.company.pk,
            run_id=b.run.pk,
            action=lambda own: "ran",
            retained_repair_action_id=repair.pk,
        ),
    )
    assert not waited, f"the takeover queued behind another {table} row of the company"
    assert outcome == Acquired("ran")


@override_settings(PAPERCLIP_PLATFORM_STOP_SECRET=SECRET)
def test_a_retained_repair_takeover_reads_the_run_under_its_row_lock() -> None:
    """The run's status is read under its row lock: a run that another transaction holding
    the row fails meanwhile counts as terminal once that transaction commits."""
    prior = receipt_for(hostname="pod-14.cluster", worker={"id": "pod-14"})
    b, repair = _retained_repair(prior)
    _record_stop(b.run.pk, prior["token"], "pod-14")
    HeartbeatRun.objects.filter(pk=b.run.pk).update(status="running")
    with raw_connection(autocommit=False) as gate:
        gate.execute("UPDATE heartbeat_runs SET status = 'failed' WHERE id = %s", [b.run.pk])

        def attempt() -> Any:
            try:
                return with_finalization_ownership(
                    company_id=b.company.pk,
                    run_id=b.run.pk,
                    action=lambda own: "ran",
                    retained_repair_action_id=repair.pk,
                )
            finally:
                connection.close()

        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(attempt)
            waited = wait_for_lock_waiters(
                1, until=future.done, holder=gate, table="heartbeat_runs"
            )
            gate.commit()
            outcome = future.result(timeout=30)
    assert waited, f"the takeover did not wait for the held run row: {outcome}"
    assert outcome == Acquired("ran")
