"""Recovery-source inspection: every failure reason, the hand-off rule, the owner's lease,
the board endpoint and the admin panel."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

import recovery.selectors.source.inspection
import recovery.services
from leases.models import EnvironmentLease
from paperclip.db.clock import db_now
from paperclip.models import (
    Company,
    ExecutionWorkspaceSnapshot,
    HeartbeatRun,
    NativeRunFinalization,
)
from recovery.admin.source_panel import source_panel_html
from recovery.errors import SourceFailure, SourceInspectionLimit
from recovery.selectors.source.execution import adapter_execution_control
from recovery.selectors.source.hand_off import retired_reusable_lease_predecessors
from recovery.selectors.source.inspection import recovery_source_inspect
from recovery.selectors.source.owned_lease import recovery_source_owned_lease
from tests.helpers import assert_error
from tests.leases.environment.factories import (
    EnvironmentLeaseFactory,
    Scenario,
    build_scenario,
    set_meta,
    sync_reference,
)
from tests.paperclip.factories import (
    AgentFactory,
    EnvironmentFactory,
    ExecutionWorkspaceFactory,
    IssueFactory,
    NativeRunFactory,
    NativeRunFinalizationFactory,
    NativeRunResultFactory,
)
from tests.recovery.factories import RecoveryActionFactory

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def inspect(s: Scenario, **options: Any) -> Any:
    return recovery_source_inspect(**s.identity(), **options)


def failure_of(s: Scenario) -> SourceFailure:
    with pytest.raises(SourceFailure) as caught:
        inspect(s)
    return caught.value


# --- Scenario mutations ----------------------------------------------------------------------


def save(obj: Any, **fields: Any) -> None:
    for key, value in fields.items():
        setattr(obj, key, value)
    obj.save()


def make_remote(s: Scenario, *, state: str = "prepared", **authority: Any) -> None:
    """Turn the scenario into a remote-workspace run (reference + workspace authority)."""
    snapshot = None
    if state == "saved":
        snapshot = str(ExecutionWorkspaceSnapshot.objects.create(
            company=s.company, execution_workspace=s.workspace, status="committed"
        ).pk)  # fmt: skip
    reference = {
        "workspaceId": str(s.workspace.pk),
        "leaseId": str(s.lease.pk),
        "providerLeaseId": s.lease.provider_lease_id,
        "remoteCwd": "/workspace",
        "epoch": 3,
        "state": state,
        "snapshotId": snapshot,
    }
    record = {
        "epoch": 3,
        "dirty": state == "prepared",
        "writerRunId": str(s.run.pk) if state == "prepared" else None,
        "snapshotId": snapshot,
        "location": {
            "leaseId": str(s.lease.pk),
            "providerLeaseId": s.lease.provider_lease_id,
            "remoteCwd": "/workspace",
            "environmentId": str(s.environment.pk),
        },
    }
    record.update(authority)
    save(s.run, runner_profile_json={"remoteWorkspace": reference})
    save(s.workspace, metadata={"remoteWorkspaceAuthority": record})


def remote_unsaved_snapshot(s: Scenario) -> None:
    make_remote(s, state="saved")
    ExecutionWorkspaceSnapshot.objects.update(status="pending")


def restore_ids(*ids: Any) -> Callable[[Scenario], None]:
    def mutate(s: Scenario) -> None:
        lease_ids = [str(s.lease.pk) if i == "lease" else i for i in ids]
        save(
            s.run,
            result_json={
                "workspaceRestoreRecovery": {
                    "schema": "paperclip.workspace-restore-recovery.v1",
                    "leaseIds": lease_ids,
                }
            },
        )

    return mutate


def other_live_lease(s: Scenario) -> None:
    EnvironmentLeaseFactory(
        company=s.company,
        environment=s.environment,
        provider=s.lease.provider,
        provider_lease_id=s.lease.provider_lease_id,
        status="active",
    )


def queued_writer(s: Scenario) -> None:
    NativeRunFactory(company=s.company, issue=s.issue, native_issue=s.issue, status="queued")


def workspace_writer(s: Scenario) -> None:
    NativeRunFactory(
        company=s.company,
        status="running",
        context_snapshot={"executionWorkspaceId": str(s.workspace.pk)},
    )


def vanished_environment(s: Scenario) -> None:
    # Simulates an instance-scoped environment deleted behind the lease's back (no FK action).
    with connection.cursor() as cursor:
        # Run the FK checks queued so far now, while the row still exists.
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")
        cursor.execute("SET LOCAL session_replication_role = replica")
        cursor.execute("DELETE FROM environments WHERE id = %s", [s.environment.pk])
        cursor.execute("SET LOCAL session_replication_role = origin")


BINDING = "source_binding_invalid"
R = "service_required"

FAILURES: list[Any] = [
    pytest.param(
        lambda s: s.overrides.update(run_id=uuid.uuid4()),
        BINDING,
        "source_run_missing",
        R,
        id="source_run_missing",
    ),
    pytest.param(
        lambda s: s.overrides.update(action_id=uuid.uuid4()),
        BINDING,
        "recovery_action_missing",
        R,
        id="recovery_action_missing",
    ),
    pytest.param(
        lambda s: save(s.action, evidence={"runId": str(uuid.uuid4())}),
        BINDING,
        "recovery_action_run_mismatch",
        R,
        id="recovery_action_run_mismatch",
    ),
    pytest.param(
        lambda s: save(s.run, status="running"),
        BINDING,
        "source_run_not_terminal",
        R,
        id="source_run_not_terminal",
    ),
    pytest.param(
        lambda s: save(
            s.run, native_issue=None, issue=None, context_snapshot={"issueId": str(uuid.uuid4())}
        ),
        BINDING,
        "source_issue_mismatch",
        R,
        id="source_issue_mismatch",
    ),
    pytest.param(
        lambda s: s.set_reference(descriptorSha256="not-hex"),
        BINDING,
        "native_reference_invalid",
        R,
        id="native_reference_invalid",
    ),
    pytest.param(
        lambda s: save(
            s.run,
            runner_profile_json={**s.run.runner_profile_json, "remoteWorkspace": {"epoch": 1}},
        ),
        BINDING,
        "native_reference_invalid",
        R,
        id="native_reference_invalid-remote-malformed",
    ),
    pytest.param(
        lambda s: make_remote(s, epoch=4),
        BINDING,
        "workspace_reference_mismatch",
        R,
        id="workspace_reference_mismatch-epoch",
    ),
    pytest.param(
        lambda s: make_remote(s, writerRunId=str(uuid.uuid4())),
        BINDING,
        "workspace_reference_mismatch",
        R,
        id="workspace_reference_mismatch-writer",
    ),
    pytest.param(
        remote_unsaved_snapshot,
        BINDING,
        "workspace_reference_mismatch",
        R,
        id="workspace_reference_mismatch-snapshot",
    ),
    pytest.param(
        lambda s: save(s.lease, execution_workspace=ExecutionWorkspaceFactory(company=s.company)),
        BINDING,
        "workspace_reference_mismatch",
        R,
        id="workspace_reference_mismatch-lease-workspace",
    ),
    pytest.param(
        lambda s: (
            make_remote(s),
            save(s.lease, environment=EnvironmentFactory(company=s.company)),
        ),
        BINDING,
        "workspace_reference_mismatch",
        R,
        id="workspace_reference_mismatch-environment",
    ),
    pytest.param(
        lambda s: save(s.run, result_json={"workspaceRestoreRecovery": {"schema": "v0"}}),
        BINDING,
        "restore_reference_invalid",
        R,
        id="restore_reference_invalid",
    ),
    pytest.param(
        lambda s: save(
            s.action,
            evidence={
                **s.action.evidence,
                "historicalWorkspaceSource": {
                    "schema": "paperclip.historical-workspace-source.v1",
                    "runId": str(uuid.uuid4()),
                },
            },
        ),
        BINDING,
        "historical_reference_invalid",
        R,
        id="historical_reference_invalid",
    ),
    pytest.param(
        restore_ids("lease", "not-a-uuid"),
        BINDING,
        "lease_reference_invalid",
        R,
        id="lease_reference_invalid-format",
    ),
    pytest.param(
        restore_ids("lease", "lease"),
        BINDING,
        "lease_reference_invalid",
        R,
        id="lease_reference_invalid-duplicate",
    ),
    pytest.param(
        restore_ids(str(uuid.uuid4())),
        BINDING,
        "lease_reference_invalid",
        R,
        id="lease_reference_invalid-reference-lease-missing",
    ),
    pytest.param(
        lambda s: save(s.lease, heartbeat_run=NativeRunFactory(company=s.company)),
        BINDING,
        "source_lease_not_bound",
        R,
        id="source_lease_not_bound",
    ),
    pytest.param(
        lambda s: save(s.lease, issue=None),
        BINDING,
        "lease_issue_mismatch",
        R,
        id="lease_issue_mismatch",
    ),
    pytest.param(
        lambda s: save(s.lease, environment=None),
        BINDING,
        "lease_environment_missing",
        R,
        id="lease_environment_missing",
    ),
    pytest.param(
        lambda s: save(s.lease, provider_lease_id=None),
        BINDING,
        "lease_allocation_missing",
        R,
        id="lease_allocation_missing",
    ),
    pytest.param(
        lambda s: save(s.lease, provider="local"),
        BINDING,
        "lease_provider_invalid",
        R,
        id="lease_provider_invalid",
    ),
    pytest.param(
        lambda s: set_meta(s.lease, remoteCwd="workspace"),
        BINDING,
        "lease_cwd_invalid",
        R,
        id="lease_cwd_invalid",
    ),
    pytest.param(
        lambda s: s.set_reference(providerLeaseId="sbx-elsewhere"),
        BINDING,
        "allocation_reference_mismatch",
        R,
        id="allocation_reference_mismatch",
    ),
    pytest.param(
        lambda s: s.set_reference(remoteCwd="/elsewhere"),
        BINDING,
        "cwd_reference_mismatch",
        R,
        id="cwd_reference_mismatch",
    ),
    pytest.param(
        lambda s: save(s.action, cause="stranded_assigned_issue"),
        "historical_source_missing",
        None,
        "use_alternative_strategy",
        id="historical_source_missing",
    ),
    pytest.param(
        lambda s: NativeRunFinalizationFactory(run=s.run, lease_owner="boot:1:x"),
        "agent_stop_unconfirmed",
        None,
        "recheck_evidence",
        id="agent_stop_unconfirmed-coordinator",
    ),
    pytest.param(
        lambda s: NativeRunFinalizationFactory(
            run=s.run, lease_owner="boot:1:x", lease_expires_at=timezone.now() + timedelta(hours=1)
        ),
        "agent_stop_unconfirmed",
        None,
        "recheck_evidence",
        id="agent_stop_unconfirmed-controller-lease",
    ),
    pytest.param(
        other_live_lease,
        "allocation_ownership_ambiguous",
        None,
        R,
        id="allocation_ownership_ambiguous",
    ),
    pytest.param(
        queued_writer,
        "workspace_writer_active",
        None,
        "recheck_evidence",
        id="workspace_writer_active-issue",
    ),
    pytest.param(
        workspace_writer,
        "workspace_writer_active",
        None,
        "recheck_evidence",
        id="workspace_writer_active-workspace",
    ),
    pytest.param(vanished_environment, "source_unavailable", None, R, id="source_unavailable"),
    pytest.param(
        lambda s: save(s.run, native_issue=IssueFactory(company=s.company)),
        BINDING,
        "source_issue_mismatch",
        R,
        id="source_issue_mismatch-native-issue-wins-over-issue",
    ),
    pytest.param(
        lambda s: ORDERED["native_reference_invalid"](s),
        BINDING,
        "native_reference_invalid",
        R,
        id="native_reference_invalid-both-references",
    ),
    pytest.param(
        lambda s: save(
            s.action,
            evidence={
                **s.action.evidence,
                "historicalWorkspaceSource": {"schema": "v0", "runId": str(s.run.pk)},
            },
        ),
        BINDING,
        "historical_reference_invalid",
        R,
        id="historical_reference_invalid-schema",
    ),
    pytest.param(
        lambda s: save(s.lease, provider=None),
        BINDING,
        "lease_provider_invalid",
        R,
        id="lease_provider_invalid-none",
    ),
    pytest.param(
        lambda s: (
            save(s.action, cause="stranded_assigned_issue"),
            save(
                s.action,
                evidence={
                    **s.action.evidence,
                    "historicalWorkspaceSource": {
                        "schema": "paperclip.historical-workspace-source.v1",
                        "runId": str(s.run.pk),
                        "leaseIds": [],
                    },
                },
            ),
        ),
        "historical_source_missing",
        None,
        "use_alternative_strategy",
        id="historical_source_missing-empty-list",
    ),
]


@pytest.mark.django_db
@pytest.mark.parametrize(("mutate", "code", "reason", "disposition"), FAILURES)
def test_inspection_failures(
    mutate: Callable[[Scenario], Any], code: str, reason: str | None, disposition: str
) -> None:
    s = build_scenario()
    assert len(inspect(s).sources) == 1  # the baseline is a valid source
    mutate(s)
    failure = failure_of(s)
    assert (failure.code, failure.reason, failure.disposition) == (code, reason, disposition)
    assert failure.details.get("reason") == reason
    assert failure.details["disposition"] == disposition


# --- Check order: the first failing check (in the seed's order) decides the answer ---------


def _foreign_live_lease(s: Scenario) -> None:
    """A live lease on the same allocation, in an environment that still exists."""
    EnvironmentLeaseFactory(
        company=s.company,
        environment=EnvironmentFactory(company=s.company),
        provider=s.lease.provider,
        provider_lease_id=s.lease.provider_lease_id,
        status="active",
    )


# (reported failure, mutation that introduces it), earliest check first. Each mutation leaves
# every other mutation's failure in place, so applying them from the last to the first stacks
# failures up: after each step the newly added (earlier) failure must be the one reported.
ORDERED_FAILURES: list[tuple[str, Callable[[Scenario], Any]]] = [
    ("source_run_missing", lambda s: s.overrides.update(run_id=uuid.uuid4())),
    ("recovery_action_missing", lambda s: s.overrides.update(action_id=uuid.uuid4())),
    (
        "recovery_action_run_mismatch",
        lambda s: save(s.action, evidence={**s.action.evidence, "runId": str(uuid.uuid4())}),
    ),
    ("source_run_not_terminal", lambda s: save(s.run, status="running")),
    (
        "source_issue_mismatch",
        lambda s: save(
            s.run, native_issue=None, issue=None, context_snapshot={"issueId": str(uuid.uuid4())}
        ),
    ),
    (
        "native_reference_invalid",  # a native and a remote reference at once
        lambda s: save(
            s.run,
            runner_profile_json={
                **s.run.runner_profile_json,
                "remoteWorkspace": {
                    "workspaceId": str(s.workspace.pk),
                    "leaseId": str(s.lease.pk),
                    "providerLeaseId": "sbx-remote",
                    "remoteCwd": "/workspace",
                    "epoch": 1,
                    "state": "prepared",
                    "snapshotId": None,
                },
            },
        ),
    ),
    (
        "restore_reference_invalid",
        lambda s: save(s.run, result_json={"workspaceRestoreRecovery": {"schema": "v0"}}),
    ),
    (
        "historical_reference_invalid",
        lambda s: save(
            s.action,
            evidence={
                **s.action.evidence,
                "historicalWorkspaceSource": {
                    "schema": "paperclip.historical-workspace-source.v1",
                    "runId": str(uuid.uuid4()),
                },
            },
        ),
    ),
    ("historical_source_missing", lambda s: save(s.action, cause="stranded_assigned_issue")),
    ("lease_reference_invalid", lambda s: s.set_reference(leaseId="not-a-uuid")),
    (
        "agent_stop_unconfirmed",
        lambda s: NativeRunFinalizationFactory(run=s.run, lease_owner="boot:1:x"),
    ),
    (
        "source_lease_not_bound",
        lambda s: save(s.lease, heartbeat_run=NativeRunFactory(company=s.company)),
    ),
    ("lease_issue_mismatch", lambda s: save(s.lease, issue=None)),
    ("lease_environment_missing", lambda s: save(s.lease, environment=None)),
    ("lease_allocation_missing", lambda s: save(s.lease, provider_lease_id=None)),
    ("lease_provider_invalid", lambda s: save(s.lease, provider="local")),
    ("lease_policy_not_retained", lambda s: save(s.lease, lease_policy="mystery")),
    ("lease_cwd_invalid", lambda s: set_meta(s.lease, remoteCwd="workspace")),
    ("allocation_reference_mismatch", lambda s: s.set_reference(providerLeaseId="sbx-other")),
    ("cwd_reference_mismatch", lambda s: s.set_reference(remoteCwd="/elsewhere")),
    (
        "workspace_reference_mismatch",
        lambda s: save(s.lease, execution_workspace=ExecutionWorkspaceFactory(company=s.company)),
    ),
    ("allocation_ownership_ambiguous", _foreign_live_lease),
    ("workspace_writer_active", queued_writer),
    ("source_unavailable", vanished_environment),
]


ORDERED = dict(ORDERED_FAILURES)


def _reported(s: Scenario) -> str:
    failure = failure_of(s)
    return failure.reason or failure.code


@pytest.mark.django_db
def test_the_first_failing_check_in_seed_order_decides() -> None:
    s = build_scenario()
    reported = []
    for expected, mutate in reversed(ORDERED_FAILURES):
        mutate(s)
        reported.append((expected, _reported(s)))
    assert [got for _, got in reported] == [want for want, _ in reported]


@pytest.mark.django_db
def test_remote_reference_mismatch_precedes_the_restore_record() -> None:
    s = build_scenario()
    make_remote(s, epoch=4)
    save(s.run, result_json={"workspaceRestoreRecovery": {"schema": "v0"}})
    assert _reported(s) == "workspace_reference_mismatch"


@pytest.mark.django_db
def test_the_source_limit_precedes_the_lease_id_checks() -> None:
    s = build_scenario()
    restore_ids("not-a-uuid", "not-a-uuid-either")(s)
    assert _reported(s) == "lease_reference_invalid"
    with pytest.raises(SourceInspectionLimit):
        inspect(s, maximum_sources=1)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("order", "expected"),
    [
        (("lease", "missing"), "workspace_writer_active"),
        (("missing", "lease"), "source_lease_not_bound"),
    ],
)
def test_leases_are_checked_one_after_another_in_recorded_order(
    order: tuple[str, str], expected: str
) -> None:
    """Every check of a lease (writer check included) runs before the next lease is looked at."""
    s = build_scenario()
    missing = str(uuid.uuid4())
    restore_ids(*(missing if item == "missing" else item for item in order))(s)
    queued_writer(s)
    assert _reported(s) == expected


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("policy", "observed"),
    [("reuse_by_environment", "reuse_by_environment"), ("mystery", "unrecognized")],
)
def test_policy_not_retained_reports_the_observed_policy(policy: str, observed: str) -> None:
    s = build_scenario()
    save(s.lease, lease_policy=policy)
    failure = failure_of(s)
    assert (failure.reason, failure.observed_lease_policy) == (
        "lease_policy_not_retained",
        observed,
    )
    assert failure.details["observed_lease_policy"] == observed


@pytest.mark.django_db
def test_an_expired_controller_lease_and_an_unheld_coordinator_do_not_block() -> None:
    s = build_scenario()
    NativeRunFinalizationFactory(
        run=s.run, lease_owner="boot:1:x", lease_expires_at=db_now() - timedelta(seconds=1)
    )
    assert inspect(s).sources
    NativeRunFinalization.objects.filter(run=s.run).update(lease_owner=None)
    assert inspect(s).sources


@pytest.mark.django_db
def test_the_lease_read_is_the_one_the_controller_lease_service_keeps() -> None:
    """Only the coordinator's lease counts: the run row's `controller_lease_expires_at` is
    written by nothing, so a value there neither blocks nor unblocks the inspection."""
    s = build_scenario()
    save(s.run, controller_lease_expires_at=db_now() + timedelta(hours=1))
    assert inspect(s).sources
    NativeRunFinalizationFactory(
        run=s.run, lease_owner="boot:1:x", lease_expires_at=db_now() + timedelta(hours=1)
    )
    assert failure_of(s).code == "agent_stop_unconfirmed"


@pytest.mark.django_db
def test_executing_in_this_process_is_unconfirmed_stop() -> None:
    s = build_scenario()
    with adapter_execution_control(s.run.pk):
        assert failure_of(s).code == "agent_stop_unconfirmed"
    assert inspect(s).sources


@pytest.mark.django_db
def test_baseline_source() -> None:
    s = build_scenario()
    (source,) = inspect(s).sources
    assert source.lease.pk == s.lease.pk
    assert source.environment.pk == s.environment.pk
    assert source.reference is not None
    assert source.reference.lease_id == str(s.lease.pk)
    assert (source.remote_reference, source.remote_workspace) == (None, None)
    assert (source.remote_cwd, source.preservation_only) == ("/workspace", False)


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["prepared", "saved"])
def test_remote_source(state: str) -> None:
    s = build_scenario()
    make_remote(s, state=state)
    (source,) = inspect(s).sources
    assert source.remote_reference is not None
    assert source.remote_reference.state == state
    assert source.remote_workspace is not None
    assert source.remote_workspace.pk == s.workspace.pk
    assert source.reference is None


@pytest.mark.django_db
def test_historical_evidence_names_the_source_for_other_causes() -> None:
    s = build_scenario()
    history = {
        "schema": "paperclip.historical-workspace-source.v1",
        "runId": str(s.run.pk),
        "leaseIds": [str(s.lease.pk)],
    }
    save(
        s.action,
        cause="stranded_assigned_issue",
        evidence={**s.action.evidence, "historicalWorkspaceSource": history},
    )
    assert [src.lease.pk for src in inspect(s).sources] == [s.lease.pk]


@pytest.mark.django_db
def test_maximum_sources_limits_the_inspection() -> None:
    s = build_scenario()
    second = EnvironmentLeaseFactory(company=s.company, heartbeat_run=s.run, issue=s.issue)
    restore_ids("lease", str(second.pk))(s)
    with pytest.raises(SourceInspectionLimit):
        inspect(s, maximum_sources=1)


@pytest.mark.django_db
def test_legacy_migration_record_marks_preservation_only() -> None:
    s = build_scenario()
    save(
        s.run,
        result_json={
            "legacyWorkspaceSourceMigration": {
                "schema": "paperclip.legacy-workspace-source-migration.v1",
                "companyId": str(s.company.pk),
                "runId": str(s.run.pk),
                "leaseId": str(s.lease.pk),
                "descriptorSha256": s.reference["descriptorSha256"],
            }
        },
    )
    assert inspect(s).sources[0].preservation_only is True


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("mode", "spelling", "on_other_issue", "blocked"),
    [
        pytest.param("fresh_isolated_workspace", str, False, False, id="exempt"),
        pytest.param("shared", str, False, True, id="not-fresh-isolated"),
        # The recorded id must be the run's id exactly as stored (the seed compares text).
        pytest.param("fresh_isolated_workspace", str.upper, False, True, id="id-spelled-other"),
        # Only an action of this issue can exempt a continuation.
        pytest.param("fresh_isolated_workspace", str, True, True, id="action-of-other-issue"),
    ],
)
def test_explicit_fresh_isolated_continuation_is_not_a_writer(
    mode: str, spelling: Callable[[str], str], on_other_issue: bool, blocked: bool
) -> None:
    s = build_scenario()
    continuation = NativeRunFactory(
        company=s.company, issue=s.issue, native_issue=s.issue, status="queued"
    )
    evidence = {
        "runId": str(s.run.pk),
        "explicitUserContinuation": {
            "runId": spelling(str(continuation.pk)),
            "readiness": {"mode": mode},
        },
    }
    if on_other_issue:
        RecoveryActionFactory(
            workspace_source=True, source_issue=IssueFactory(company=s.company), evidence=evidence
        )
    else:
        save(s.action, evidence=evidence)
    if blocked:
        assert failure_of(s).code == "workspace_writer_active"
    else:
        assert inspect(s).sources


def _accepted_export(s: Scenario, *, terminal: str = "succeeded") -> None:
    result = NativeRunResultFactory(
        run=s.run, result_json={"result": {}, "terminal": {"runTerminalState": terminal}}
    )
    NativeRunFinalizationFactory(run=s.run, phase="terminal_failure", result=result)
    save(s.lease, lease_policy="reuse_by_environment")


@pytest.mark.django_db
@pytest.mark.parametrize(("terminal", "allowed"), [("succeeded", True), ("failed", False)])
def test_reusable_allocation_needs_an_accepted_succeeded_export_result(
    terminal: str, allowed: bool
) -> None:
    s = build_scenario()
    _accepted_export(s, terminal=terminal)
    if allowed:
        assert inspect(s).sources[0].lease.lease_policy == "reuse_by_environment"
    else:
        assert failure_of(s).reason == "lease_policy_not_retained"


def _handoff(s: Scenario, *, finalized: bool = True, phase: str = "committed") -> EnvironmentLease:
    """A retired predecessor that handed the reusable allocation to the scenario's lease."""
    _accepted_export(s)
    prior = NativeRunFactory(
        company=s.company, agent=s.agent, issue=s.issue, native_issue=s.issue, status="succeeded"
    )
    predecessor = EnvironmentLeaseFactory(
        company=s.company,
        environment=s.environment,
        issue=s.issue,
        heartbeat_run=prior,
        provider=s.lease.provider,
        provider_lease_id=s.lease.provider_lease_id,
        lease_policy="reuse_by_environment",
        status="released",
    )
    EnvironmentLease.objects.filter(pk=predecessor.pk).update(
        acquired_at=T0, released_at=T0 + timedelta(hours=1)
    )
    EnvironmentLease.objects.filter(pk=s.lease.pk).update(acquired_at=T0 + timedelta(hours=2))
    save(
        prior,
        runner_profile_json={
            "nativeWorkspaceSync": sync_reference(
                predecessor, s.workspace.pk, state="finalized" if finalized else "prepared"
            )
        },
    )
    NativeRunFinalizationFactory(run=prior, phase=phase)
    return predecessor


@pytest.mark.django_db
def test_clean_handoff_chain_is_accepted() -> None:
    s = build_scenario()
    _handoff(s)
    assert inspect(s).sources[0].lease.pk == s.lease.pk


@pytest.mark.django_db
@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(lambda s, p: _handoff(s, finalized=False), id="predecessor-not-saved"),
        pytest.param(
            lambda s, p: _handoff(s, phase="workspace_finalizing"), id="predecessor-unsettled"
        ),
        pytest.param(
            lambda s, p: (_handoff(s), set_meta(s.lease, agentId=str(uuid.uuid4()))),
            id="other-agent",
        ),
        pytest.param(
            lambda s, p: (
                _handoff(s),
                HeartbeatRun.objects.exclude(pk=s.run.pk)
                .filter(status="succeeded")
                .update(status="running"),
            ),
            id="predecessor-run-live",
        ),
    ],
)
def test_unclean_handoff_is_ambiguous(spoil: Callable[[Scenario, Any], Any]) -> None:
    s = build_scenario()
    spoil(s, None)
    assert failure_of(s).code == "allocation_ownership_ambiguous"


def _prior_run(s: Scenario) -> HeartbeatRun:
    return HeartbeatRun.objects.exclude(pk=s.run.pk).get(
        runner_profile_json__has_any_keys=["nativeWorkspaceSync", "remoteWorkspace"]
    )


def _prior_reference(s: Scenario, **changes: Any) -> None:
    prior = _prior_run(s)
    reference = {**prior.runner_profile_json["nativeWorkspaceSync"], **changes}
    save(prior, runner_profile_json={"nativeWorkspaceSync": reference})


def _prior_owner(s: Scenario, **changes: Any) -> None:
    NativeRunFinalization.objects.filter(run=_prior_run(s)).update(**changes)


PREDECESSOR_SPOILERS: list[Any] = [
    pytest.param(lambda s: save(_prior_run(s), runtime_mode="legacy"), id="prior-not-native"),
    pytest.param(
        lambda s: save(_prior_run(s), agent=AgentFactory(company=s.company)), id="prior-agent"
    ),
    pytest.param(
        lambda s: save(_prior_run(s), native_issue=IssueFactory(company=s.company)),
        id="prior-issue",
    ),
    pytest.param(
        lambda s: NativeRunFinalization.objects.filter(run=_prior_run(s)).update(
            lease_owner="boot:1:x", lease_expires_at=timezone.now() + timedelta(hours=1)
        ),
        id="prior-controller-lease-live",
    ),
    pytest.param(
        lambda s: NativeRunFinalization.objects.filter(run=_prior_run(s)).delete(),
        id="prior-coordinator-missing",
    ),
    pytest.param(
        lambda s: _prior_owner(s, issue=IssueFactory(company=s.company)),
        id="prior-coordinator-other-issue",
    ),
    pytest.param(lambda s: _prior_owner(s, lease_owner="boot:2:y"), id="prior-coordinator-held"),
    pytest.param(lambda s: save(_prior_run(s), runner_profile_json={}), id="prior-no-descriptor"),
    pytest.param(lambda s: _prior_reference(s, finalHostSha256=None), id="prior-no-host-digest"),
    pytest.param(lambda s: _prior_reference(s, leaseId=str(s.lease.pk)), id="prior-lease-id"),
    pytest.param(lambda s: _prior_reference(s, providerLeaseId="sbx-other"), id="prior-allocation"),
    pytest.param(
        lambda s: _prior_reference(s, workspaceId=str(uuid.uuid4())), id="prior-workspace"
    ),
    pytest.param(lambda s: _prior_reference(s, remoteCwd="/elsewhere"), id="prior-cwd"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("spoil", PREDECESSOR_SPOILERS)
def test_every_predecessor_condition_is_required(spoil: Callable[[Scenario], Any]) -> None:
    s = build_scenario()
    _handoff(s)
    assert inspect(s).sources  # the clean hand-off passes ...
    spoil(s)
    failure = failure_of(s)  # ... and each broken condition makes it ambiguous
    assert (failure.code, failure.disposition) == ("allocation_ownership_ambiguous", R)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("phase", "accepted"),
    [("committed", True), ("terminal_failure", True), ("applied", True), ("observed", False)],
)
def test_settled_predecessor_phases(phase: str, accepted: bool) -> None:
    s = build_scenario()
    _handoff(s, phase=phase)
    if accepted:
        assert inspect(s).sources
    else:
        assert failure_of(s).code == "allocation_ownership_ambiguous"


@pytest.mark.django_db
def test_predecessor_executing_in_this_process_is_ambiguous() -> None:
    s = build_scenario()
    _handoff(s)
    with adapter_execution_control(_prior_run(s).pk):
        assert failure_of(s).code == "allocation_ownership_ambiguous"
    assert inspect(s).sources


def _remote_handoff(s: Scenario, *, prior_epoch: int, prior_state: str = "saved") -> None:
    """The scenario's run is remote (epoch 3, reusable lease); a retired predecessor saved the
    same allocation at `prior_epoch`."""
    make_remote(s)
    save(s.lease, lease_policy="reuse_by_execution_workspace")
    prior = NativeRunFactory(
        company=s.company, agent=s.agent, issue=s.issue, native_issue=s.issue, status="succeeded"
    )
    predecessor = EnvironmentLeaseFactory(
        company=s.company,
        environment=s.environment,
        issue=s.issue,
        heartbeat_run=prior,
        provider=s.lease.provider,
        provider_lease_id=s.lease.provider_lease_id,
        lease_policy="reuse_by_execution_workspace",
        status="released",
    )
    EnvironmentLease.objects.filter(pk=predecessor.pk).update(
        acquired_at=T0, released_at=T0 + timedelta(hours=1)
    )
    EnvironmentLease.objects.filter(pk=s.lease.pk).update(acquired_at=T0 + timedelta(hours=2))
    remote = {
        "workspaceId": str(s.workspace.pk),
        "leaseId": str(predecessor.pk),
        "providerLeaseId": s.lease.provider_lease_id,
        "remoteCwd": "/workspace",
        "epoch": prior_epoch,
        "state": prior_state,
        "snapshotId": str(uuid.uuid4()) if prior_state == "saved" else None,
    }
    save(prior, runner_profile_json={"remoteWorkspace": remote})
    NativeRunFinalizationFactory(run=prior, phase="applied")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("prior_epoch", "prior_state", "accepted"),
    [(2, "saved", True), (3, "saved", False), (2, "prepared", False)],
)
def test_remote_predecessor_must_have_saved_an_earlier_epoch(
    prior_epoch: int, prior_state: str, accepted: bool
) -> None:
    s = build_scenario()
    _remote_handoff(s, prior_epoch=prior_epoch, prior_state=prior_state)
    if accepted:
        (source,) = inspect(s).sources
        assert source.remote_reference is not None
    else:
        assert failure_of(s).code == "allocation_ownership_ambiguous"


# --- The hand-off rule, both sides ----------------------------------------------------------


COMPANY, ENV = uuid.uuid4(), uuid.uuid4()


def lease_at(hours: float, *, released: float | None = None, **fields: Any) -> EnvironmentLease:
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "company_id": COMPANY,
        "environment_id": ENV,
        "heartbeat_run_id": uuid.uuid4(),
        "provider": "daytona",
        "provider_lease_id": "sbx-1",
        "lease_policy": "reuse_by_environment",
        "status": "released" if released is not None else "active",
        "acquired_at": T0 + timedelta(hours=hours),
        "released_at": T0 + timedelta(hours=released) if released is not None else None,
    }
    values.update(fields)
    return EnvironmentLease(**values)


HANDOFF: list[Any] = [
    pytest.param({}, [], [], id="no-history"),
    pytest.param({}, [dict(hours=0, released=1)], [0], id="one-retired"),
    pytest.param(
        {}, [dict(hours=2, released=3), dict(hours=0, released=1)], [1, 0], id="chain-sorted"
    ),
    pytest.param({}, [dict(hours=0, released=1, status="expired")], [0], id="expired"),
    pytest.param({}, [dict(hours=0, released=1, status="failed")], [0], id="failed"),
    pytest.param(
        {"lease_policy": "ephemeral"}, [dict(hours=0, released=1)], None, id="lease-not-reusable"
    ),
    pytest.param({}, [dict(hours=0)], None, id="predecessor-live"),
    pytest.param(
        {}, [dict(hours=0, released=1, status="retained")], None, id="predecessor-retained"
    ),
    pytest.param({}, [dict(hours=0, status="released")], None, id="released-without-time"),
    pytest.param({}, [dict(hours=0, released=5)], None, id="overlaps-lease"),
    pytest.param(
        {}, [dict(hours=0, released=2.5), dict(hours=2, released=3)], None, id="chain-overlap"
    ),
    pytest.param({}, [dict(hours=4, released=4.5)], None, id="acquired-after-lease"),
    pytest.param({}, [dict(hours=3.5, released=3.6)], None, id="same-acquisition-as-lease"),
    pytest.param(
        {},
        [dict(hours=0, released=1), dict(hours=0, released=0.5)],
        None,
        id="duplicate-acquisition",
    ),
    pytest.param(
        {}, [dict(hours=0, released=1, company_id=uuid.uuid4())], None, id="other-company"
    ),
    pytest.param(
        {}, [dict(hours=0, released=1, environment_id=uuid.uuid4())], None, id="other-environment"
    ),
    pytest.param(
        {}, [dict(hours=0, released=1, lease_policy="ephemeral")], None, id="predecessor-ephemeral"
    ),
    pytest.param(
        {}, [dict(hours=0, released=1, heartbeat_run_id=None)], None, id="predecessor-without-run"
    ),
    pytest.param(
        {},
        [dict(hours=0, released=1, released_before_acquired=True)],
        None,
        id="released-before-acquired",
    ),
    pytest.param({"same_run": True}, [dict(hours=0, released=1)], None, id="same-run-as-lease"),
]


@pytest.mark.parametrize(("lease_fields", "history_specs", "expected"), HANDOFF)
def test_retired_reusable_lease_predecessors(
    lease_fields: dict[str, Any], history_specs: list[dict[str, Any]], expected: list[int] | None
) -> None:
    # A copy: the parameters are module-level dicts, and a second run of this test in the same
    # process (mutmut runs it once to map the tests, then again) must see them unchanged.
    lease_fields = dict(lease_fields)
    same_run = lease_fields.pop("same_run", False)
    lease = lease_at(3.5, **lease_fields)
    history = []
    for spec in history_specs:
        spec = dict(spec)
        backwards = spec.pop("released_before_acquired", False)
        item = lease_at(**spec)
        if backwards:
            item.released_at = item.acquired_at - timedelta(minutes=1)
        if same_run:
            item.heartbeat_run_id = lease.heartbeat_run_id
        history.append(item)
    result = retired_reusable_lease_predecessors(lease, history)
    if expected is None:
        assert result is None
    else:
        assert result == [history[i] for i in expected]


# --- The preservation owner's lease ---------------------------------------------------------


class Ownership:
    def __init__(self, token: str, *, lose_after: int | None = None) -> None:
        self.token = token
        self.checks = 0
        self.lose_after = lose_after

    def assert_held(self) -> None:
        self.checks += 1
        if self.lose_after is not None and self.checks > self.lose_after:
            raise RuntimeError("ownership lost")


def _claimed(s: Scenario, token: str) -> None:
    set_meta(s.lease, pendingCleanupInFlight=True, pendingCleanupAttemptId=token)


def owned(s: Scenario, ownership: Ownership, **changes: Any) -> Any:
    arguments = {
        **s.identity(),
        "lease_id": s.lease.pk,
        "environment_id": s.environment.pk,
        "ownership": ownership,
    }
    arguments.update(changes)
    return recovery_source_owned_lease(**arguments)


@pytest.mark.django_db
def test_owner_reopens_its_own_stop_only_allocation() -> None:
    s = build_scenario()
    ownership = Ownership("tok-1")
    _claimed(s, "tok-1")
    assert owned(s, ownership).lease.pk == s.lease.pk
    assert ownership.checks == 2  # before and after the inspection


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("prepare", "changes", "reason"),
    [
        (lambda s: _claimed(s, "tok-1"), {"lease_id": uuid.uuid4()}, "recovery_lease_not_selected"),
        (
            lambda s: _claimed(s, "tok-1"),
            {"environment_id": uuid.uuid4()},
            "recovery_environment_mismatch",
        ),
        (
            lambda s: set_meta(s.lease, pendingCleanupAttemptId="tok-1"),
            {},
            "recovery_lease_not_claimed",
        ),
        (lambda s: _claimed(s, "tok-other"), {}, "recovery_owner_mismatch"),
        (
            lambda s: (
                _claimed(s, "tok-1"),
                set_meta(s.lease, nativeWorkspaceExportResume={"schema": "x"}),
            ),
            {},
            "recovery_stop_intent_missing",
        ),
    ],
)
def test_owner_lease_refusals(
    prepare: Callable[[Scenario], Any], changes: dict[str, Any], reason: str
) -> None:
    s = build_scenario()
    prepare(s)
    with pytest.raises(SourceFailure) as caught:
        owned(s, Ownership("tok-1"), **changes)
    assert (caught.value.code, caught.value.reason) == ("source_binding_invalid", reason)


@pytest.mark.django_db
def test_owner_lease_rechecks_ownership_after_inspection() -> None:
    s = build_scenario()
    _claimed(s, "tok-1")
    after_inspection = Ownership("tok-1", lose_after=1)
    with pytest.raises(RuntimeError, match="ownership lost"):
        owned(s, after_inspection)
    assert after_inspection.checks == 2  # held before inspecting, lost at the recheck after
    before_inspection = Ownership("tok-1", lose_after=0)
    with pytest.raises(RuntimeError, match="ownership lost"):
        owned(s, before_inspection)
    assert before_inspection.checks == 1


# --- Board endpoint and admin panel ---------------------------------------------------------


def url(s: Scenario, run_id: Any = None, *, action_id: Any = None) -> str:
    base = f"/api/issues/{s.issue.pk}/recovery-actions/{action_id or s.action.pk}/source"
    return base if run_id is None else f"{base}?run_id={run_id}"


@pytest.mark.django_db
def test_board_endpoint_returns_the_sources(company: Company, board_client: APIClient) -> None:
    s = build_scenario(company=company)
    response = board_client.get(url(s, s.run.pk))
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["run"]["id"] == str(s.run.pk)
    assert body["run"]["finalization_owner"] is None
    assert body["action"]["id"] == str(s.action.pk)
    assert body["action"]["evidence"] == {"runId": str(s.run.pk)}
    (source,) = body["sources"]
    assert source["lease"]["id"] == str(s.lease.pk)
    assert source["environment"]["id"] == str(s.environment.pk)
    assert source["reference"]["leaseId"] == str(s.lease.pk)
    assert (source["remote_cwd"], source["preservation_only"]) == ("/workspace", False)


SERVICE = {"disposition": "service_required"}
RECHECK = {"disposition": "recheck_evidence"}
UNRECOGNIZED = {
    "reason": "lease_policy_not_retained",
    "disposition": "service_required",
    "observed_lease_policy": "unrecognized",
}


@pytest.mark.parametrize(
    ("mutate", "status", "code", "details"),
    [
        (lambda s: save(s.lease, lease_policy="mystery"), 422, BINDING, UNRECOGNIZED),
        (
            lambda s: save(s.action, cause="other"),
            422,
            "historical_source_missing",
            {"disposition": "use_alternative_strategy"},
        ),
        (other_live_lease, 422, "allocation_ownership_ambiguous", SERVICE),
        (vanished_environment, 422, "source_unavailable", SERVICE),
        (
            lambda s: NativeRunFinalizationFactory(run=s.run, lease_owner="x"),
            409,
            "agent_stop_unconfirmed",
            RECHECK,
        ),
        (queued_writer, 409, "workspace_writer_active", RECHECK),
    ],
)
@pytest.mark.django_db
def test_board_endpoint_failures(
    company: Company,
    board_client: APIClient,
    mutate: Callable[[Scenario], Any],
    status: int,
    code: str,
    details: dict[str, str],
) -> None:
    s = build_scenario(company=company)
    mutate(s)
    response = board_client.get(url(s, s.run.pk))
    error = assert_error(response, status, code)
    assert error["details"] == details
    assert error["message"]


@pytest.mark.django_db
def test_board_endpoint_scoping_and_validation(
    company: Company,
    other_company: Company,
    agent_client: APIClient,
    board_client: APIClient,
    make_board_client: Callable[..., APIClient],
) -> None:
    s = build_scenario(company=company)
    assert agent_client.get(url(s, s.run.pk)).status_code == 403
    assert make_board_client(other_company).get(url(s, s.run.pk)).status_code == 404
    assert make_board_client(superuser=True).get(url(s, s.run.pk)).status_code == 200
    for bad in (url(s), url(s, "not-a-uuid")):
        response = board_client.get(bad)
        assert response.status_code == 400
        assert "run_id" in response.json()["error"]["details"]["fields"]
    assert board_client.get(url(s, s.run.pk, action_id="nope")).status_code == 404
    missing = board_client.get(url(s, s.run.pk, action_id=uuid.uuid4()))
    error = assert_error(missing, 422, "source_binding_invalid")
    assert error["details"]["reason"] == "recovery_action_missing"


@pytest.mark.django_db(transaction=True)
def test_inspection_outside_a_transaction_uses_one_read_only_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = build_scenario()
    seen: list[tuple[str, str]] = []
    checks = recovery.selectors.source.inspection._inspect

    def observed(*args: Any) -> Any:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('transaction_isolation'),"
                " current_setting('transaction_read_only')"
            )
            seen.append(cursor.fetchone())
        return checks(*args)

    monkeypatch.setattr(recovery.selectors.source.inspection, "_inspect", observed)
    assert not connection.in_atomic_block
    assert len(inspect(s).sources) == 1
    assert seen == [("repeatable read", "on")]
    assert failure_of(Scenario(**{**s.__dict__, "overrides": {"run_id": uuid.uuid4()}})).reason == (
        "source_run_missing"
    )


@pytest.mark.django_db
def test_admin_panel_shows_sources_or_the_failure() -> None:
    s = build_scenario()
    html = source_panel_html(s.action)
    assert str(s.lease.pk) in html
    assert "every check passed" in html
    save(s.lease, lease_policy="mystery")
    html = source_panel_html(s.action)
    for text in (
        "source_binding_invalid",
        "lease_policy_not_retained",
        "service_required",
        "unrecognized",
    ):
        assert text in html
    save(s.action, evidence={"runId": "<script>alert(1)</script>"})
    html = source_panel_html(s.action)
    assert "<script>" not in html
    assert "&lt;script&gt;" in html


def test_services_are_reachable_under_their_contract_names() -> None:
    assert recovery.services.recovery_source_inspect is recovery_source_inspect
    assert recovery.services.recovery_source_owned_lease is recovery_source_owned_lease
