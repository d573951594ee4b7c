"""Workspace snapshots: the content-addressed store, trees, merge and materialization
(docs/snapshots.md)."""
