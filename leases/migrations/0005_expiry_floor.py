"""The expiry floor: renews become HOT updates (docs/data-model.md#expiry-floor).

A renew moves `expires_at`. While `expires_at` had an index, every renew was a non-HOT update:
PostgreSQL wrote a new entry into each of the table's ten indexes for every renewed row. The
index moves to `expiry_floor`, a lower bound of `expires_at` that a renew leaves alone, so a
renew changes no indexed column and the row is updated in place on its page.

`expiry_floor <= expires_at` always (a CHECK), kept by triggers so that no write path can
break it (a service, the admin, a `QuerySet.update`, SQL by hand):

- before an insert: the floor is the new row's `expires_at`;
- before an update that would leave the floor above `expires_at` (a renew with a shorter TTL,
  an expiry pushed into the past): the floor comes down to `expires_at`. The `WHEN` clause is
  evaluated without calling the function, so a renew that extends the expiry runs nothing.

Set-wide reads list expiry candidates with `expiry_floor <= now()` (a superset of the expired
leases, by the invariant) and judge `expires_at` itself; the periodic sweep moves the floors
of live leases up to their `expires_at`, which keeps the candidates few. The table's
fillfactor leaves room on each page for the in-place updates.
"""

from django.db import migrations, models
from django.db.models.functions import Now

TABLE = "execution_workspace_runtime_leases"

FLOOR_FUNCTION = f"""
CREATE FUNCTION runtime_lease_expiry_floor_set() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.expiry_floor := NEW.expires_at;
    RETURN NEW;
END
$$;

CREATE TRIGGER runtime_lease_expiry_floor_insert
    BEFORE INSERT ON {TABLE}
    FOR EACH ROW EXECUTE FUNCTION runtime_lease_expiry_floor_set();

CREATE TRIGGER runtime_lease_expiry_floor_lower
    BEFORE UPDATE ON {TABLE}
    FOR EACH ROW WHEN (NEW.expiry_floor > NEW.expires_at)
    EXECUTE FUNCTION runtime_lease_expiry_floor_set();

ALTER TABLE {TABLE} SET (fillfactor = 80);
"""

DROP_FLOOR_FUNCTION = f"""
ALTER TABLE {TABLE} RESET (fillfactor);
DROP TRIGGER runtime_lease_expiry_floor_lower ON {TABLE};
DROP TRIGGER runtime_lease_expiry_floor_insert ON {TABLE};
DROP FUNCTION runtime_lease_expiry_floor_set();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("leases", "0004_runtime_lease_fence"),
    ]

    operations = [
        migrations.AddField(
            model_name="workspaceruntimelease",
            name="expiry_floor",
            field=models.DateTimeField(db_default=Now(), editable=False),
        ),
        migrations.RunSQL(
            f"UPDATE {TABLE} SET expiry_floor = expires_at",  # noqa: S608
            migrations.RunSQL.noop,
        ),
        migrations.RunSQL(FLOOR_FUNCTION, DROP_FLOOR_FUNCTION),
        migrations.AddConstraint(
            model_name="workspaceruntimelease",
            constraint=models.CheckConstraint(
                condition=models.Q(expiry_floor__lte=models.F("expires_at")),
                name="ws_rt_leases_expiry_floor_lte_expires_at",
            ),
        ),
        migrations.RemoveIndex(
            model_name="workspaceruntimelease",
            name="ws_rt_leases_expires_at_idx",
        ),
        migrations.AddIndex(
            model_name="workspaceruntimelease",
            index=models.Index(fields=["expiry_floor"], name="ws_rt_leases_expiry_floor_idx"),
        ),
    ]
