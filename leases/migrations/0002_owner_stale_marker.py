"""The owner-stale marker on runtime leases, kept by triggers (docs/data-model.md#owner-stale-marker).

`owner_stale` says whether the owner a lease's key names (`issue:<uuid>` / `run:<uuid>`) is
missing, hidden, of another company or ended. Set-wide stale reads (the sweep, the dashboard,
the admin's stale filters) list expired leases through the `expires_at` index and owner-stale
ones through a partial index on this column, instead of joining every lease to its owner.

Triggers keep it, not Python, so that no write path can forget it (a service, the admin, a
`QuerySet.update`, SQL by hand):

- on the lease, before insert or an update that names `owner_key`, `company_id` or the
  marker itself: the marker is recomputed from the key (so it cannot be set by hand), locking
  the named owner row FOR SHARE. The lock orders the lease write against a concurrent status
  change of that owner: whichever commits second sees the other's row.
- after an issue's status, hidden_at or company changes, or it is deleted, and the same for a
  run's status or company: its leases' markers are recomputed.

The renew hot path names none of those columns and fires nothing.

The status lists are copies of `leases.selectors.ELIGIBLE_ISSUE_STATUSES` and
`TERMINAL_RUN_STATUSES` as of this migration; tests/leases/test_owner_stale_marker.py pins them
to the live verdict for every status, so a new status needs a migration that replaces
`runtime_lease_owner_stale`.
"""

from django.db import migrations, models

UUID_RE = "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"


def _recompute_leases_naming(kind: str, owner_fk: str) -> str:
    """The statement that recomputes the marker of the leases whose key (`<kind>:<uuid>`) or
    FK names the owner row of the running trigger (`owner_id`, `owner_company`)."""
    return f"""        UPDATE execution_workspace_runtime_leases l
           SET owner_stale = runtime_lease_owner_stale(l.company_id, l.owner_key)
         WHERE (l.{owner_fk} = owner_id
                OR (l.company_id IN (OLD.company_id, owner_company)
                    AND l.owner_key = '{kind}:' || owner_id::text))
           AND l.owner_key LIKE '{kind}:%'
           AND l.owner_stale IS DISTINCT FROM runtime_lease_owner_stale(l.company_id, l.owner_key);"""


OWNER_STALE_FUNCTION = f"""
CREATE FUNCTION runtime_lease_owner_stale(lease_company uuid, key text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    live boolean;
BEGIN
    IF key LIKE 'issue:%' THEN
        IF key !~ '^issue:{UUID_RE}$' THEN
            RETURN true;  -- unparseable: reads as a missing owner
        END IF;
        SELECT i.company_id = lease_company AND i.hidden_at IS NULL
               AND i.status IN ('backlog', 'todo', 'in_progress', 'in_review', 'blocked')
          INTO live FROM issues i WHERE i.id = substr(key, 7)::uuid FOR SHARE;
        RETURN live IS NOT TRUE;
    ELSIF key LIKE 'run:%' THEN
        IF key !~ '^run:{UUID_RE}$' THEN
            RETURN true;
        END IF;
        SELECT r.company_id = lease_company
               AND r.status NOT IN ('cancelled', 'failed', 'interrupted', 'succeeded', 'timed_out')
          INTO live FROM heartbeat_runs r WHERE r.id = substr(key, 5)::uuid FOR SHARE;
        RETURN live IS NOT TRUE;
    END IF;
    RETURN false;  -- an agent (or unknown) owner is stale only by expiry
END
$$;

CREATE FUNCTION runtime_lease_owner_stale_set() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.owner_stale := runtime_lease_owner_stale(NEW.company_id, NEW.owner_key);
    RETURN NEW;
END
$$;

CREATE FUNCTION runtime_lease_owner_changed() RETURNS trigger
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
    -- is already NULL when Django deletes the owner), in the owner's old or new company.
    IF TG_TABLE_NAME = 'issues' THEN
{_recompute_leases_naming("issue", "owner_issue_id")}
    ELSE
{_recompute_leases_naming("run", "owner_run_id")}
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER runtime_lease_owner_stale_set
BEFORE INSERT OR UPDATE OF owner_key, company_id, owner_stale
ON execution_workspace_runtime_leases
FOR EACH ROW EXECUTE FUNCTION runtime_lease_owner_stale_set();

CREATE TRIGGER runtime_lease_owner_changed
AFTER UPDATE OF status, hidden_at, company_id ON issues
FOR EACH ROW WHEN (
    OLD.status IS DISTINCT FROM NEW.status
    OR (OLD.hidden_at IS NULL) IS DISTINCT FROM (NEW.hidden_at IS NULL)
    OR OLD.company_id IS DISTINCT FROM NEW.company_id
) EXECUTE FUNCTION runtime_lease_owner_changed();

CREATE TRIGGER runtime_lease_owner_deleted
AFTER DELETE ON issues
FOR EACH ROW EXECUTE FUNCTION runtime_lease_owner_changed();

CREATE TRIGGER runtime_lease_owner_changed
AFTER UPDATE OF status, company_id ON heartbeat_runs
FOR EACH ROW WHEN (
    OLD.status IS DISTINCT FROM NEW.status OR OLD.company_id IS DISTINCT FROM NEW.company_id
) EXECUTE FUNCTION runtime_lease_owner_changed();

CREATE TRIGGER runtime_lease_owner_deleted
AFTER DELETE ON heartbeat_runs
FOR EACH ROW EXECUTE FUNCTION runtime_lease_owner_changed();

-- The leases that exist already (the trigger above recomputes what this writes).
UPDATE execution_workspace_runtime_leases SET owner_stale = true
 WHERE owner_key LIKE 'issue:%' OR owner_key LIKE 'run:%';
"""

DROP_OWNER_STALE_FUNCTION = """
DROP TRIGGER runtime_lease_owner_deleted ON heartbeat_runs;
DROP TRIGGER runtime_lease_owner_changed ON heartbeat_runs;
DROP TRIGGER runtime_lease_owner_deleted ON issues;
DROP TRIGGER runtime_lease_owner_changed ON issues;
DROP TRIGGER runtime_lease_owner_stale_set ON execution_workspace_runtime_leases;
DROP FUNCTION runtime_lease_owner_changed();
DROP FUNCTION runtime_lease_owner_stale_set();
DROP FUNCTION runtime_lease_owner_stale(uuid, text);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('leases', '0001_initial'),
        ('paperclip', '0004_flat_cost_indexes'),
    ]

    operations = [
        migrations.AddField(
            model_name='workspaceruntimelease',
            name='owner_stale',
            field=models.BooleanField(db_default=False, editable=False),
        ),
        migrations.RunSQL(OWNER_STALE_FUNCTION, DROP_OWNER_STALE_FUNCTION),
    ]
