from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    # Every audited write inserts into this table: build the indexes without blocking them
    # (CONCURRENTLY cannot run inside a transaction).
    atomic = False

    dependencies = [
        ("paperclip", "0004_flat_cost_indexes"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="activityevent",
            index=models.Index(
                fields=["company", "action", "created_at"], name="activity_company_action_idx"
            ),
        ),
        AddIndexConcurrently(
            model_name="activityevent",
            index=models.Index(
                fields=["company", "entity_type", "created_at"], name="activity_company_entity_idx"
            ),
        ),
    ]
