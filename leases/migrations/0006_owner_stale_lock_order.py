"""The owner-stale trigger locks the leases it recomputes in workspace order, as the batch
renew does (docs/locking.md): a status change of an owner naming two leases and a batch renew
of both took the rows in opposite orders, and PostgreSQL aborted one of them (40P01)."""

from django.db import migrations


def _recompute(kind: str, owner_fk: str, *, ordered: bool) -> str:
    where = f"""(l.{owner_fk} = owner_id
                OR (l.company_id IN (OLD.company_id, owner_company)
                    AND l.owner_key = '{kind}:' || owner_id::text))
           AND l.owner_key LIKE '{kind}:%'
           AND l.owner_stale IS DISTINCT FROM runtime_lease_owner_stale(l.company_id, l.owner_key)"""
    if not ordered:
        return f"""        UPDATE execution_workspace_runtime_leases l
           SET owner_stale = runtime_lease_owner_stale(l.company_id, l.owner_key)
         WHERE {where};"""
    return f"""        UPDATE execution_workspace_runtime_leases u
           SET owner_stale = runtime_lease_owner_stale(u.company_id, u.owner_key)
         WHERE u.id IN (
               SELECT l.id FROM execution_workspace_runtime_leases l
                WHERE {where}
                ORDER BY l.execution_workspace_id
                  FOR NO KEY UPDATE);"""


def _function(*, ordered: bool) -> str:
    return f"""
CREATE OR REPLACE FUNCTION runtime_lease_owner_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    owner_id uuid;
    owner_company uuid;
BEGIN
    IF TG_OP = 'DELETE' THEN
        owner_id := OLD.id;
        owner_company := OLD.company_id;
    ELSE
        owner_id := NEW.id;
        owner_company := NEW.company_id;
    END IF;
    -- The leases whose key names this owner: through the owner FK or the key itself (the FK
    -- is already NULL when Django deletes the owner), in the owner's old or new company;
    -- locked in workspace order, as every other writer of several leases takes them.
    IF TG_TABLE_NAME = 'issues' THEN
{_recompute("issue", "owner_issue_id", ordered=ordered)}
    ELSE
{_recompute("run", "owner_run_id", ordered=ordered)}
    END IF;
    RETURN NULL;
END
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("leases", "0005_expiry_floor")]

    operations = [
        migrations.RunSQL(_function(ordered=True), reverse_sql=_function(ordered=False)),
    ]
