"""The fenced checkpoint writer (docs/checkpoints.md#owner-fence) and the readers."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from django.db import connection
from psycopg import sql

from checkpoints.crypto import key_file_path, keyring
from checkpoints.errors import CheckpointBindingMismatch, CheckpointOwnerLost, CheckpointUnreadable
from checkpoints.models import NativeRunnerCheckpoint, NativeRunnerCheckpointWork
from checkpoints.selectors import (
    checkpoint_exists,
    checkpoint_header_load,
    checkpoint_load,
    checkpoint_restore,
    list_expired_authorities,
    runner_run_get,
)
from checkpoints.services import (
    CheckpointOwner,
    CheckpointWrite,
    Predecessor,
    checkpoint_write,
    checkpoint_write_validate,
    max_part_bytes,
    max_parts_per_write,
    max_write_bytes,
)
from checkpoints.services.shared import LIVE_RUN_RECOVERY_CHANNEL
from paperclip.errors import InvalidRequest, PermissionDenied
from paperclip.models import ActivityEvent, HeartbeatRun, Issue, NativeRunFinalization
from tests.checkpoints.factories import coordinator, expire_lease, lease, owner_of
from tests.helpers import LOCK_WAIT_TIMEOUT, raw_connection
from tests.paperclip.factories import (
    AgentFactory,
    CompanyFactory,
    HeartbeatRunFactory,
    IssueFactory,
    NativeRunFactory,
    NativeRunResultFactory,
)

pytestmark = pytest.mark.django_db


def write(
    fin: NativeRunFinalization,
    owner: CheckpointOwner,
    *,
    changed: dict[str, str] | None = None,
    removed: Sequence[str] = (),
    reset: bool = False,
    work: Sequence[str] = (),
    predecessor: Predecessor | None = None,
) -> CheckpointWrite:
    return checkpoint_write(
        run_id=fin.run_id,
        agent_id=fin.run.agent_id,
        owner=owner,
        reset=reset,
        changed=changed or {},
        removed=list(removed),
        work_command_ids=list(work),
        predecessor=predecessor,
    )


def stored(fin: NativeRunFinalization) -> dict[str, str]:
    return checkpoint_load(binding=runner_run_get(run_id=fin.run_id, agent_id=None).binding)


def write_tolerated(
    fin: NativeRunFinalization, owner: CheckpointOwner, changed: dict[str, str], **kw: Any
) -> None:
    """Write as an expired owner and check the write was let through as a tolerated one (not
    as an active one's): answered and audited `ownerActive: false`, its parts stored."""
    audits = ActivityEvent.objects.filter(run=fin.run, action="checkpoint.written")
    tolerated = audits.filter(details__ownerActive=False)
    before = (audits.count(), tolerated.count(), stored(fin))
    result = write(fin, owner, changed=changed, **kw)
    assert result.owner_active is False
    assert (audits.count(), tolerated.count()) == (before[0] + 1, before[1] + 1)
    assert stored(fin) == {**before[2], **changed}


def give_result(fin: NativeRunFinalization) -> None:
    fin.result = NativeRunResultFactory(run=fin.run)
    fin.save(update_fields=["result"])


# --- active owner ---------------------------------------------------------------------------


def test_active_owner_writes_removes_resets_and_counts_parts() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    assert write(fin, owner, changed={"header": "h1", "a": "1", "b": "2"}).parts == 3
    assert write(fin, owner, changed={"a": "1b"}, removed=["b"]).parts == 2
    assert stored(fin) == {"header": "h1", "a": "1b"}
    secret = "PLAINTEXT-MARKER-h2"  # '-' never occurs in base64, so no accidental match
    assert write(fin, owner, reset=True, changed={"header": secret}).parts == 1
    assert stored(fin) == {"header": secret}
    row = NativeRunnerCheckpoint.objects.get(run=fin.run, part="header")
    assert row.size_bytes == len(secret)
    assert secret.encode() not in bytes(row.ciphertext)  # encrypted at rest
    assert len(bytes(row.nonce)) == 12
    assert row.scheme == "paperclip_aes256gcm_v2"
    assert ActivityEvent.objects.filter(run=fin.run, action="checkpoint.written").count() == 3


def test_size_bytes_counts_utf8_bytes() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    write(fin, owner, changed={"p": "é€"})
    assert NativeRunnerCheckpoint.objects.get(run=fin.run).size_bytes == 5
    assert stored(fin) == {"p": "é€"}


@pytest.mark.parametrize(
    "tamper",
    [
        {"generation": 2},
        {"boot_id": "boot-b"},
        {"lease_owner": "boot-a:1:forged"},
    ],
)
def test_stale_generation_other_boot_or_forged_owner_is_rejected(tamper: dict[str, Any]) -> None:
    fin = coordinator()
    grant = lease(fin.run)
    good = owner_of(grant)
    write(fin, good, changed={"a": "kept"})
    bad = _replace(good, **tamper)
    with pytest.raises(CheckpointOwnerLost):
        write(fin, bad, changed={"a": "overwritten"})
    assert stored(fin) == {"a": "kept"}


def _replace(owner: CheckpointOwner, **changes: Any) -> CheckpointOwner:
    fields = {
        "boot_id": owner.boot_id,
        "lease_owner": owner.lease_owner,
        "generation": owner.generation,
        "authority_run_id": owner.authority_run_id,
    }
    fields.update(changes)
    return CheckpointOwner(**fields)


def test_previous_generation_is_fenced_after_a_takeover() -> None:
    fin = coordinator()
    old = owner_of(lease(fin.run, boot_id="boot-a"))
    expire_lease(fin.run_id)
    new = owner_of(lease(fin.run, boot_id="boot-b"))
    write(fin, new, changed={"a": "new"})
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, old, changed={"a": "old"})
    assert exc.value.details["reason"] == "generation_or_boot_changed"
    assert stored(fin) == {"a": "new"}


# --- expired owner tolerance (§3.5) ---------------------------------------------------------


def test_expired_owner_without_result_is_lost() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    expire_lease(fin.run_id)
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "late"})
    assert exc.value.details["reason"] == "lease_not_held"
    assert not NativeRunnerCheckpoint.objects.filter(run=fin.run).exists()


def test_expired_owner_with_result_and_no_new_work_is_tolerated_new_work_is_not() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    write(fin, owner, changed={"a": "1"}, work=["cmd-1", "cmd-2"])
    give_result(fin)
    expire_lease(fin.run_id)
    write_tolerated(fin, owner, {"a": "2"}, work=["cmd-2"])
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "3"}, work=["cmd-2", "cmd-3"])
    assert exc.value.details["reason"] == "new_work_after_lease"
    assert stored(fin) == {"a": "2"}
    # The remembered ids are the previous snapshot's, not a union.
    assert NativeRunnerCheckpointWork.objects.get(run=fin.run).work_command_ids == ["cmd-2"]
    with pytest.raises(CheckpointOwnerLost) as again:
        write(fin, owner, changed={"a": "4"}, work=["cmd-1"])
    assert again.value.details["reason"] == "new_work_after_lease"
    assert stored(fin) == {"a": "2"}


def test_work_remembered_from_another_owner_counts_as_new_work() -> None:
    fin = coordinator()
    first = owner_of(lease(fin.run, boot_id="boot-a"))
    write(fin, first, changed={"a": "1"}, work=["cmd-1"])
    expire_lease(fin.run_id)
    second = owner_of(lease(fin.run, boot_id="boot-a"))
    give_result(fin)
    expire_lease(fin.run_id)
    # cmd-1 is remembered, but as first's snapshot: for second it is new work.
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, second, changed={"a": "2"}, work=["cmd-1"])
    assert exc.value.details["reason"] == "new_work_after_lease"
    assert stored(fin) == {"a": "1"}
    assert NativeRunnerCheckpointWork.objects.get(run=fin.run).lease_owner == first.lease_owner


def test_work_remembered_from_the_same_owner_is_tolerated_after_its_lease() -> None:
    fin = coordinator()
    first = owner_of(lease(fin.run, boot_id="boot-a"))
    write(fin, first, work=["cmd-1"])
    expire_lease(fin.run_id)
    second = owner_of(lease(fin.run, boot_id="boot-a"))
    write(fin, second, work=["cmd-1"])
    give_result(fin)
    expire_lease(fin.run_id)
    # second's own previous snapshot had cmd-1: tolerated.
    write_tolerated(fin, second, {"a": "2"}, work=["cmd-1"])
    assert NativeRunnerCheckpointWork.objects.get(run=fin.run).lease_owner == second.lease_owner


def _expired_with_result() -> tuple[NativeRunFinalization, CheckpointOwner]:
    fin = coordinator()
    owner = owner_of(lease(fin.run, boot_id="boot-a"))
    give_result(fin)
    expire_lease(fin.run_id)
    return fin, owner


def _bind_issue_to(issue_id: object, run_id: object) -> None:
    Issue.objects.filter(pk=issue_id).update(execution_run_id=run_id)


def test_tolerated_when_issue_unbound_or_bound_to_this_run() -> None:
    fin, owner = _expired_with_result()
    _bind_issue_to(fin.issue_id, None)
    write_tolerated(fin, owner, {"a": "1"})
    _bind_issue_to(fin.issue_id, fin.run_id)
    write_tolerated(fin, owner, {"a": "2"})


def test_lost_when_issue_is_gone() -> None:
    fin, owner = _expired_with_result()
    # The fence's issue lookup is scoped by company: a company mismatch looks like a gone issue.
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL DEFERRED")
        cursor.execute(
            "UPDATE issues SET company_id = gen_random_uuid() WHERE id = %s", [fin.issue_id]
        )
        with pytest.raises(CheckpointOwnerLost) as exc:
            write(fin, owner, changed={"a": "x"})
        cursor.execute(
            "UPDATE issues SET company_id = %s WHERE id = %s", [fin.company_id, fin.issue_id]
        )
    assert exc.value.details["reason"] == "issue_missing"


def _native_successor(fin: NativeRunFinalization, boot_id: str, *, live: bool) -> HeartbeatRun:
    succ = NativeRunFactory(company=fin.company, issue=fin.issue, agent=fin.run.agent)
    NativeRunFinalization.objects.create(run=succ, company=fin.company, issue=fin.issue)
    lease(succ, boot_id=boot_id)
    if not live:
        expire_lease(succ.pk)
    _bind_issue_to(fin.issue_id, succ.pk)
    return succ


def test_tolerated_for_a_live_native_successor_on_the_same_boot() -> None:
    fin, owner = _expired_with_result()
    succ = _native_successor(fin, "boot-a", live=True)
    assert Issue.objects.get(pk=fin.issue_id).execution_run_id == succ.pk  # really rebound
    write_tolerated(fin, owner, {"a": "1"})


@pytest.mark.parametrize(("boot", "live"), [("boot-b", True), ("boot-a", False)])
def test_lost_for_a_foreign_or_expired_native_successor(boot: str, live: bool) -> None:
    fin, owner = _expired_with_result()
    _native_successor(fin, boot, live=live)
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "1"})
    assert exc.value.details["reason"] == "issue_rebound"


def _legacy_successor(fin: NativeRunFinalization, **overrides: Any) -> HeartbeatRun:
    boot = uuid.uuid4()
    fields: dict[str, Any] = {
        "company": fin.company,
        "agent": fin.run.agent,
        "issue": fin.issue,
        "status": "running",
        "execution_stage": "preparing",
        "controller_boot_id": boot,
    }
    fields.update(overrides)
    succ = HeartbeatRunFactory(**fields)
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE heartbeat_runs SET controller_lease_expires_at = clock_timestamp() + "
            "interval '60 seconds' WHERE id = %s",
            [succ.pk],
        )
    _bind_issue_to(fin.issue_id, succ.pk)
    return succ


def test_tolerated_for_a_preparing_legacy_successor_of_the_same_controller_boot() -> None:
    fin = coordinator()
    boot = str(uuid.uuid4())
    owner = owner_of(lease(fin.run, boot_id=boot))
    give_result(fin)
    expire_lease(fin.run_id)
    succ = _legacy_successor(fin, controller_boot_id=uuid.UUID(boot))
    assert Issue.objects.get(pk=fin.issue_id).execution_run_id == succ.pk  # really rebound
    write_tolerated(fin, owner, {"a": "1"})


@pytest.mark.parametrize(
    "flaw",
    [
        "other_boot",
        "not_preparing",
        "has_coordinator",
        "lease_expired",
        "not_running",
        "not_legacy",
        "other_issue",
    ],
)
def test_lost_for_an_illegitimate_legacy_successor(flaw: str) -> None:
    fin = coordinator()
    boot = str(uuid.uuid4())
    owner = owner_of(lease(fin.run, boot_id=boot))
    give_result(fin)
    expire_lease(fin.run_id)
    overrides: dict[str, Any] = {"controller_boot_id": uuid.UUID(boot)}
    if flaw == "other_boot":
        overrides["controller_boot_id"] = uuid.uuid4()
    if flaw == "not_preparing":
        overrides["execution_stage"] = "executing"
    if flaw == "not_running":
        overrides["status"] = "queued"
    if flaw == "not_legacy":
        overrides["runtime_mode"] = "native"
    if flaw == "other_issue":
        overrides["issue"] = IssueFactory(company=fin.company)
    succ = _legacy_successor(fin, **overrides)
    if flaw == "has_coordinator":
        NativeRunFinalization.objects.create(run=succ, company=fin.company, issue=fin.issue)
    if flaw == "lease_expired":
        HeartbeatRun.objects.filter(pk=succ.pk).update(controller_lease_expires_at=None)
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "1"})
    assert exc.value.details["reason"] == "issue_rebound"


# --- authority run, predecessor, validation --------------------------------------------------


def test_authority_run_carries_the_lease_for_another_runs_parts() -> None:
    authority = coordinator()
    attached = NativeRunFactory(
        company=authority.company, issue=authority.issue, agent=authority.run.agent
    )
    owner = owner_of(lease(authority.run), authority_run_id=authority.run_id)
    checkpoint_write(
        run_id=attached.pk,
        agent_id=attached.agent_id,
        owner=owner,
        reset=False,
        changed={"a": "1"},
        removed=[],
        work_command_ids=[],
        predecessor=None,
    )
    assert NativeRunnerCheckpoint.objects.filter(run=attached).count() == 1
    assert not NativeRunnerCheckpoint.objects.filter(run=authority.run).exists()


def test_predecessor_must_be_this_issues_run_with_that_session() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    session = uuid.uuid4()
    prior = NativeRunFactory(
        company=fin.company, issue=fin.issue, agent=fin.run.agent, native_session_id=session
    )
    write(fin, owner, changed={"a": "1"}, predecessor=Predecessor(prior.pk, session))
    other_issue_run = NativeRunFactory(company=fin.company, native_session_id=session)
    for bad in (
        Predecessor(prior.pk, uuid.uuid4()),
        Predecessor(other_issue_run.pk, session),
        Predecessor(uuid.uuid4(), session),
    ):
        with pytest.raises(CheckpointBindingMismatch) as exc:
            write(fin, owner, changed={"a": "2"}, predecessor=bad)
        assert exc.value.details == {
            "reason": "predecessor_mismatch",
            "predecessor_run_id": str(bad.run_id),
        }
    assert stored(fin) == {"a": "1"}


@pytest.mark.parametrize(
    ("changed", "removed", "work"),
    [
        ({"": "x"}, [], []),
        ({"a" * 201: "x"}, [], []),
        ({"bad\nname": "x"}, [], []),
        ({}, ["bad\x00name"], []),
        ({"a": "x"}, ["a"], []),
        ({}, [], [""]),
        ({}, [], ["cmd\x00-1"]),  # jsonb cannot hold NUL: a 400, not a DataError
        ({}, [], ["cmd-\ud800"]),
        ({"a": "lone \udc00 surrogate"}, [], []),  # no UTF-8 form: a 400, not a crash
    ],
)
def test_invalid_writes_change_nothing(
    changed: dict[str, str], removed: list[str], work: list[str]
) -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    with pytest.raises(InvalidRequest):
        write(fin, owner, changed=changed, removed=removed, work=work)
    assert not NativeRunnerCheckpoint.objects.filter(run=fin.run).exists()
    assert not ActivityEvent.objects.filter(run=fin.run, action="checkpoint.written").exists()


def test_part_size_limit(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_MAX_PART_BYTES = 10
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    write(fin, owner, changed={"a": "x" * 10})
    with pytest.raises(InvalidRequest) as exc:
        write(fin, owner, changed={"a": "x" * 11})
    assert "changed" in exc.value.details["fields"]


# --- readers --------------------------------------------------------------------------------


def test_readers_header_exists_restore() -> None:
    fin = coordinator()
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_header_load(binding=binding) is None
    assert not checkpoint_exists(binding=binding)
    assert checkpoint_restore(binding=binding) is None
    owner = owner_of(lease(fin.run))
    header = '{"recoveryEvidence": {"normalizedSessionId": "s-1"}}'
    write(fin, owner, changed={"header": header, "log": "x"})
    assert checkpoint_exists(binding=binding)
    assert checkpoint_header_load(binding=binding) == header
    assert checkpoint_restore(binding=binding, normalized_session_id="s-1") == {
        "header": header,
        "log": "x",
    }
    with pytest.raises(CheckpointBindingMismatch):
        checkpoint_restore(binding=binding, normalized_session_id="s-2")


def test_unreadable_part_is_named_and_header_reads_null() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    write(fin, owner, changed={"header": "h", "zzz": "z"})
    header_row = NativeRunnerCheckpoint.objects.get(run=fin.run, part="header")
    zzz_row = NativeRunnerCheckpoint.objects.get(run=fin.run, part="zzz")
    # Swap the two ciphertexts between rows of the same run.
    NativeRunnerCheckpoint.objects.filter(pk=header_row.pk).update(
        nonce=zzz_row.nonce, ciphertext=zzz_row.ciphertext
    )
    binding = runner_run_get(run_id=fin.run_id, agent_id=None).binding
    assert checkpoint_header_load(binding=binding) is None
    with pytest.raises(CheckpointUnreadable) as exc:
        checkpoint_load(binding=binding)
    assert exc.value.details["part"] == "header"
    assert exc.value.details["reason"] == "authentication_failed"


def test_list_expired_authorities() -> None:
    due = coordinator()
    write(due, owner_of(lease(due.run)), changed={"a": "1"})
    expire_lease(due.run_id)
    live = coordinator()
    write(live, owner_of(lease(live.run)), changed={"a": "1"})
    no_parts = coordinator()
    lease(no_parts.run)
    expire_lease(no_parts.run_id)
    with_result = coordinator()
    write(with_result, owner_of(lease(with_result.run)), changed={"a": "1"})
    give_result(with_result)
    expire_lease(with_result.run_id)
    not_running = coordinator()
    write(not_running, owner_of(lease(not_running.run)), changed={"a": "1"})
    expire_lease(not_running.run_id)
    HeartbeatRun.objects.filter(pk=not_running.run_id).update(status="failed")
    never_leased = coordinator()  # a null expiry counts as lapsed
    write(never_leased, owner_of(lease(never_leased.run)), changed={"a": "1"})
    NativeRunFinalization.objects.filter(pk=never_leased.run_id).update(lease_expires_at=None)
    past_observed = coordinator()
    write(past_observed, owner_of(lease(past_observed.run)), changed={"a": "1"})
    expire_lease(past_observed.run_id)
    NativeRunFinalization.objects.filter(pk=past_observed.run_id).update(
        phase="workspace_finalizing"
    )
    due_too = coordinator()
    write(due_too, owner_of(lease(due_too.run)), changed={"a": "1"})
    expire_lease(due_too.run_id)
    candidates = [
        due.run_id,
        live.run_id,
        no_parts.run_id,
        with_result.run_id,
        not_running.run_id,
        never_leased.run_id,
        past_observed.run_id,
        due_too.run_id,
    ]
    matches = sorted([due.run_id, never_leased.run_id, due_too.run_id])
    # Every match, not just the first: one blocked run must not starve the others.
    assert list_expired_authorities(run_ids=candidates) == matches
    assert list_expired_authorities(run_ids=[due_too.run_id]) == [due_too.run_id]
    assert list_expired_authorities(run_ids=[]) == []
    assert list_expired_authorities() == matches  # no inventory given: every run


# --- found by `make mutate` (docs/testing.md) ------------------------------------------------


def test_an_active_owners_write_is_answered_and_audited_as_active_with_its_counts() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    first = write(fin, owner, changed={"a": "1", "b": "2"})
    assert (first.owner_active, first.parts, first.changed, first.removed) == (True, 2, 2, 0)
    second = write(fin, owner, changed={"c": "3"}, removed=["a"])
    assert (second.owner_active, second.parts, second.changed, second.removed) == (True, 2, 1, 1)
    audits = ActivityEvent.objects.filter(run=fin.run, action="checkpoint.written")
    assert [a.details["ownerActive"] for a in audits] == [True, True]


def test_a_reset_deletes_only_this_runs_parts_not_another_run_of_the_same_issue() -> None:
    fin = coordinator()
    other_run = NativeRunFactory(company=fin.company, issue=fin.issue, agent=fin.run.agent)
    other = NativeRunFinalization.objects.create(
        run=other_run, company=fin.company, issue=fin.issue
    )
    write(other, owner_of(lease(other_run)), changed={"kept": "other run's"})
    owner = owner_of(lease(fin.run))
    write(fin, owner, changed={"a": "1"})
    assert write(fin, owner, reset=True, changed={"b": "2"}).removed == 1
    assert stored(fin) == {"b": "2"}
    assert stored(other) == {"kept": "other run's"}


@pytest.mark.parametrize("foreign", ["company", "issue"])
def test_lost_when_the_bound_runs_live_coordinator_names_another_company_or_issue(
    foreign: str,
) -> None:
    fin, owner = _expired_with_result()
    succ = _native_successor(fin, "boot-a", live=True)
    elsewhere = (
        {"company_id": CompanyFactory().pk}
        if foreign == "company"
        else {"issue_id": IssueFactory(company=fin.company).pk}
    )
    NativeRunFinalization.objects.filter(run=succ).update(**elsewhere)
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "1"})
    assert exc.value.details["reason"] == "issue_rebound"


def test_lost_when_the_issue_is_bound_to_another_run_than_the_live_native_successor() -> None:
    fin, owner = _expired_with_result()
    _native_successor(fin, "boot-a", live=True)  # live on the boot, but not the bound run
    bound = NativeRunFactory(company=fin.company, issue=fin.issue, agent=fin.run.agent)
    _bind_issue_to(fin.issue_id, bound.pk)
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "1"})
    assert exc.value.details["reason"] == "issue_rebound"


def _expired_on_a_fresh_boot() -> tuple[NativeRunFinalization, CheckpointOwner, uuid.UUID]:
    fin = coordinator()
    boot = uuid.uuid4()
    owner = owner_of(lease(fin.run, boot_id=str(boot)))
    give_result(fin)
    expire_lease(fin.run_id)
    return fin, owner, boot


def test_lost_for_a_legacy_successor_of_another_company() -> None:
    fin, owner, boot = _expired_on_a_fresh_boot()
    succ = _legacy_successor(fin, controller_boot_id=boot)
    HeartbeatRun.objects.filter(pk=succ.pk).update(company_id=CompanyFactory().pk)
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "1"})
    assert exc.value.details["reason"] == "issue_rebound"


def test_lost_when_the_issue_is_bound_to_another_run_than_the_legacy_successor() -> None:
    fin, owner, boot = _expired_on_a_fresh_boot()
    _legacy_successor(fin, controller_boot_id=boot)  # legitimate, but not the bound run
    bound = HeartbeatRunFactory(company=fin.company, agent=fin.run.agent, issue=fin.issue)
    _bind_issue_to(fin.issue_id, bound.pk)
    with pytest.raises(CheckpointOwnerLost) as exc:
        write(fin, owner, changed={"a": "1"})
    assert exc.value.details["reason"] == "issue_rebound"


def test_the_default_write_limits_admit_exactly_their_size_and_refuse_one_more() -> None:
    mib = 1024 * 1024
    assert (max_part_bytes(), max_write_bytes(), max_parts_per_write()) == (
        8 * mib,
        16 * mib,
        10_000,
    )

    def refused(
        changed: dict[str, str], work: Sequence[str] = (), removed: Sequence[str] = ()
    ) -> dict[str, list[str]]:
        with pytest.raises(InvalidRequest) as exc:
            checkpoint_write_validate(
                changed=changed, removed=list(removed), work_command_ids=list(work)
            )
        fields: dict[str, list[str]] = exc.value.details["fields"]
        return fields

    checkpoint_write_validate(
        changed={"a": "x" * (8 * mib), "b": "é" * (4 * mib)},  # 8 MiB each, 16 in all
        removed=[],
        work_command_ids=[f"{i:0200d}" for i in range(10_000)],
    )
    checkpoint_write_validate(
        changed={f"p{i}": "" for i in range(10_000)}, removed=[], work_command_ids=[]
    )
    assert set(refused({"a": "x" * (8 * mib + 1)})) == {"changed"}
    assert set(refused({"a": "é" * (4 * mib) + "x"})) == {"changed"}  # bytes, not characters
    # Three parts under the part limit that together pass the write limit.
    assert len(refused({name: "x" * (6 * mib) for name in "abc"})["changed"]) == 1
    assert set(refused({"a": "x" * (8 * mib), "b": "x" * (8 * mib), "c": "x"})) == {"changed"}
    assert set(refused({f"p{i}": "" for i in range(10_001)})) == {"changed"}
    assert set(refused({}, work=[str(i) for i in range(10_001)])) == {"work_command_ids"}
    assert set(refused({}, work=["x" * 201])) == {"work_command_ids"}


def test_another_agent_cannot_write_the_runs_checkpoint_even_with_its_owner() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    stranger = AgentFactory(company=fin.company)
    with pytest.raises(PermissionDenied):
        checkpoint_write(
            run_id=fin.run_id,
            agent_id=stranger.pk,
            owner=owner,
            reset=False,
            changed={"a": "1"},
            removed=[],
            work_command_ids=[],
            predecessor=None,
        )
    assert stored(fin) == {}


def test_the_first_write_without_configured_keys_creates_the_key_file(settings: Any) -> None:
    settings.PAPERCLIP_CHECKPOINT_KEYS = []
    assert not key_file_path().exists()
    fin = coordinator()
    write(fin, owner_of(lease(fin.run)), changed={"a": "1"})
    assert key_file_path().is_file()
    assert stored(fin) == {"a": "1"}


def test_the_fence_reads_the_bound_issue_not_another_issue_of_the_company() -> None:
    fin, owner = _expired_with_result()
    _bind_issue_to(fin.issue_id, None)  # tolerated: the issue is free
    # The company's first issue by primary key is bound to an unrelated run.
    first = IssueFactory(company=fin.company, id=uuid.UUID(int=0))
    _bind_issue_to(first.pk, NativeRunFactory(company=fin.company, issue=first).pk)
    write_tolerated(fin, owner, {"a": "1"})


def test_a_predecessor_of_another_company_is_refused() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    session = uuid.uuid4()
    foreign = NativeRunFactory(native_session_id=session)
    HeartbeatRun.objects.filter(pk=foreign.pk).update(native_issue_id=fin.issue_id)
    with pytest.raises(CheckpointBindingMismatch) as exc:
        write(fin, owner, changed={"a": "1"}, predecessor=Predecessor(foreign.pk, session))
    assert exc.value.details["reason"] == "predecessor_mismatch"


def test_a_write_is_audited_with_its_company_agent_run_authority_and_key() -> None:
    fin = coordinator()
    grant = lease(fin.run)
    write(fin, owner_of(grant), changed={"a": "1"}, reset=True)
    audit = ActivityEvent.objects.get(run=fin.run, action="checkpoint.written")
    assert (audit.company_id, audit.actor_type, audit.actor_id) == (
        fin.company_id,
        "agent",
        str(fin.run.agent_id),
    )
    assert (audit.entity_type, audit.entity_id) == ("heartbeat_run", str(fin.run_id))
    assert audit.details == {
        "authorityRunId": str(fin.run_id),
        "generation": grant.generation,
        "ownerActive": True,
        "reset": True,
        "changed": 1,
        "removed": 0,
        "keyId": keyring().primary.key_id,
    }


@pytest.mark.django_db(transaction=True)
def test_a_write_wakes_live_run_recovery_listeners_with_its_company_and_run() -> None:
    fin = coordinator()
    owner = owner_of(lease(fin.run))
    with raw_connection() as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(LIVE_RUN_RECOVERY_CHANNEL)))
        write(fin, owner, changed={"header": "h"})
        # Delivered at the write's commit, so already there: the timeout only bounds a failure.
        woken = list(listener.notifies(timeout=LOCK_WAIT_TIMEOUT, stop_after=1))
    assert [(n.channel, json.loads(n.payload)) for n in woken] == [
        (LIVE_RUN_RECOVERY_CHANNEL, {"companyId": str(fin.company_id), "runId": str(fin.run_id)})
    ]
