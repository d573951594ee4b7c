"""Workspace snapshots, the one home of the subsystem (docs/architecture.md#snapshots): the
content-addressed store, trees, registration, merge and resolutions, publishing into the head,
materialization and collection (docs/snapshots.md)."""
