from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Renews write the lease table all the time: build the index without blocking them
    # (CONCURRENTLY cannot run inside a transaction).
    atomic = False

    dependencies = [
        ('leases', '0002_owner_stale_marker'),
    ]

    operations = [
        AddIndexConcurrently(
            model_name='workspaceruntimelease',
            index=models.Index(
                condition=models.Q(owner_stale=True),
                fields=['id'],
                name='ws_rt_leases_owner_stale_idx',
            ),
        ),
    ]
