"""Checkpoint parts as bytes, step 3 of 3: the sealed columns are required and `material` goes.

Undone, `material` comes back nullable (0004 undone refills it, 0003 undone requires it again).
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('checkpoints', '0004_checkpoint_material_to_bytea'),
    ]

    operations = [
        migrations.AlterField(
            model_name='nativerunnercheckpoint',
            name='scheme',
            field=models.TextField(),
        ),
        migrations.AlterField(
            model_name='nativerunnercheckpoint',
            name='key_id',
            field=models.TextField(),
        ),
        migrations.AlterField(
            model_name='nativerunnercheckpoint',
            name='nonce',
            field=models.BinaryField(),
        ),
        migrations.AlterField(
            model_name='nativerunnercheckpoint',
            name='ciphertext',
            field=models.BinaryField(),
        ),
        migrations.RemoveField(
            model_name='nativerunnercheckpoint',
            name='material',
        ),
    ]
