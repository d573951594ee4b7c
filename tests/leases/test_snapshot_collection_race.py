"""Upload, collect, register, forced on separate connections: the collector's reachability
pass sees a blob nobody references yet; before its DELETE, the real snapshot registration of
a tree reaching that blob commits on another connection. The blob must survive with its bytes
and the snapshot be registered (docs/snapshots.md#collection)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection
from django.db.models.expressions import RawSQL

from leases.services import run_snapshot_register
from paperclip.models import CasBlob, RunSnapshot
from paperclip.snapshots.collect import CollectProgress, cas_collect
from paperclip.snapshots.store.reads import cas_open
from tests.conftest import s3_settings
from tests.leases.factories import running_run
from tests.recovery.snapshots import store_tree

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("backend", ["filesystem", "postgres", "s3"])
def test_a_registration_committed_after_the_reachability_pass_keeps_its_blobs(
    backend: str,
    settings: Any,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    settings.PAPERCLIP_CAS_BACKEND = backend
    settings.PAPERCLIP_CAS_DIR = tmp_path / "cas"
    if backend == "s3":
        s3_settings(settings, monkeypatch, request.getfixturevalue("s3_server"))
    run, claim = running_run()
    assert claim is not None
    assert claim.lease is not None
    company, agent = run.company, run.agent
    tree = store_tree(company.pk, {"work.txt": b"the run's only copy\n"})
    old = RawSQL("now() - interval '2 days'", [])
    CasBlob.objects.filter(company_id=company.pk).update(created_at=old, referenced_at=old)
    reached, registered = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def pause(step: CollectProgress) -> None:
        if step.phase == "reached":
            assert step.candidates == 2  # the file and its directory: unreferenced so far
            reached.set()
            assert registered.wait(timeout=15)

    def register() -> None:
        try:
            assert reached.wait(timeout=15)
            run_snapshot_register(
                company_id=company.pk,
                run_id=run.pk,
                agent_id=agent.pk,
                tree=tree,
                base=None,
                generation=claim.lease.generation,  # type: ignore[union-attr]
            )
        except BaseException as exc:
            errors.append(exc)
        finally:
            registered.set()
            connection.close()

    thread = threading.Thread(target=register)
    thread.start()
    summary = cas_collect(batch_size=10, progress=pause)
    thread.join(timeout=15)
    assert errors == []
    assert summary.candidates == 2
    assert summary.deleted == 0
    assert RunSnapshot.objects.filter(run=run, tree=tree).exists()
    for blob in CasBlob.objects.filter(company_id=company.pk).values_list("digest", flat=True):
        reader = cas_open(company_id=company.pk, digest=blob)
        assert reader is not None
        b"".join(reader.chunks)
