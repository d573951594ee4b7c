"""Export-resume retention markers on environment leases
(docs/environment.md#export-resume-markers).

A lease whose run has an accepted result but unexported work carries a stop-only intent
(`metadata.nativeWorkspaceExportResume`): cleanup may *stop* that exact allocation, never
destroy it, until verified copy-back and commitment release the marker. The readers here are
strict: any field that does not bind to the row makes the marker unreadable, and an unreadable
marker never degrades into ordinary (destructive) cleanup.

JSON keys inside `metadata` are camelCase (docs/data-model.md#naming-conventions).

Transactions: `export_resume_preserve` runs inside the finalizer's transaction (it must commit
together with the terminal failure it protects). `export_resume_release_completed` and
`export_resume_settle` open a plain `atomic()` (a savepoint when nested) rather than a durable
one, because they are composed into a caller's transaction as well as called alone.

By file: `keys.py` (metadata keys, schemas), `binding.py` (the lease-binding rule),
`sync_reference.py` (the native workspace sync reference), `markers.py` (the stop-only intents'
readers), `termination.py` (provider stop receipts), and the services `preserve.py`,
`release.py` and `settle.py`.
"""
