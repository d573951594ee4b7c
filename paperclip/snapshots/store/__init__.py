"""The company-scoped content-addressed store (docs/snapshots.md#the-store).

A blob is named `sha256:<64 lowercase hex>` of its bytes and belongs to one company: the same
bytes uploaded by two companies are two blobs, and one company never learns whether another
holds a name. The `CasBlob` row is the index (size, `created_at`, `referenced_at`, the
collector's clock); the bytes live in the backend chosen by `PAPERCLIP_CAS_BACKEND`:

- `filesystem` (default): `<PAPERCLIP_CAS_DIR>/<company_id>/<hex[:2]>/<hex>` (the directory
  defaults to `<PAPERCLIP_DATA_DIR>/cas`), written through a temporary sibling and a rename;
- `postgres`: `CasBlobChunk` rows of at most 1 MiB, in the transaction that writes the row;
- `s3`: objects `<PAPERCLIP_CAS_S3_PREFIX><company_id>/<hex[:2]>/<hex>` of a bucket
  (`paperclip.snapshots.store.s3`), written in the transaction that writes the row.

Every read is verified against the blob's name (`reads.verified_chunks`): bytes that are gone
or wrong are `BlobUnreadable` (422), never served as the blob.

Uploads hash the bytes as they stream into a spooled temporary file (never the whole blob in
memory), refuse them as soon as they pass the size limit, and only then open a transaction.

Safety against the collector (`paperclip.snapshots.collect`): an upload first upserts the row
(`INSERT ... ON CONFLICT DO UPDATE`, which takes the row lock and waits for a collector that
is deleting it, then inserts afresh), then places the bytes, then commits; the collector
deletes rows with `FOR UPDATE SKIP LOCKED`, re-checking their age, and removes their bytes
before its own commit, still holding the rows. So a committed row always has its bytes, and
the collector never removes the bytes of a row an upload re-created. Should bytes be lost all
the same (a crash between the collector's unlinks and its commit), the filesystem backend's
find-missing answers such a blob missing and the next upload of it writes the bytes again.

The package by step: `names` (names, limits, errors, the caller's company), `backends` (the
`BlobBackend` interface and its filesystem and postgres implementations), `s3` (the object
store's), `spool`, `uploads`, `batch`, `reads`, `pins`, and `migration` (copying every blob to
another backend, `manage.py cas_migrate`).
"""
