"""`cas_store_blobs`, how the server stores directory blobs it made itself (a merge, an
adoption, a board resolution): a transaction per chunk of blobs, each verified against its name,
on every backend."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from paperclip.models import CasBlob, Company
from paperclip.snapshots.store import uploads
from paperclip.snapshots.store.names import BlobDigestMismatch
from paperclip.snapshots.store.reads import cas_load_many
from tests.paperclip.snapshots.helpers import NOTHING, kept, name_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("backend")]


def test_blobs_are_stored_a_chunk_per_transaction_and_read_back(
    company: Company, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(uploads, "STORE_CHUNK", 2)
    blobs = {name_of(b"dir %d" % i): b"dir %d" % i for i in range(5)}
    with CaptureQueriesContext(connection) as queries:
        uploads.cas_store_blobs(company_id=company.pk, blobs=blobs)
    upserts = [q for q in queries.captured_queries if "INSERT INTO cas_blobs" in q["sql"]]
    assert len(upserts) == 3  # 2 + 2 + 1, not 5
    assert cas_load_many(company_id=company.pk, digests=list(blobs), max_bytes=100) == blobs
    # Again: nothing new, nothing lost.
    uploads.cas_store_blobs(company_id=company.pk, blobs=blobs)
    assert CasBlob.objects.filter(company_id=company.pk).count() == 5


def test_a_blob_that_is_not_its_name_stores_nothing_of_its_chunk(company: Company) -> None:
    good = b"a directory"
    blobs = {name_of(good): good, name_of(b"other"): b"not the other"}
    with pytest.raises(BlobDigestMismatch):
        uploads.cas_store_blobs(company_id=company.pk, blobs=blobs)
    assert kept(company.pk, name_of(good)) == NOTHING
