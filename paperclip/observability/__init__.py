"""Metrics (Prometheus) and structured logs: docs/operations.md."""
