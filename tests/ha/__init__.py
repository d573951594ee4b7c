"""Several nodes on a replicated PostgreSQL, and its failover (docs/ha.md)."""
