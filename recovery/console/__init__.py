"""The operator console, a Django app of its own (label `console`) on the floor above every
domain app, `recovery` included: it sits in `recovery`'s folder only because the top-level
folders are fixed (docs/architecture.md). Nothing else in `recovery` imports it."""
