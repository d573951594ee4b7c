"""Checkpoint parts as bytes, step 1 of 3: the sealed columns, nullable until 0004 fills them.

`material` becomes nullable too, so that undoing 0005 can re-add it to a table with rows.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('checkpoints', '0002_checkpoint_work'),
    ]

    operations = [
        migrations.AlterField(
            model_name='nativerunnercheckpoint',
            name='material',
            field=models.JSONField(null=True),
        ),
        migrations.AddField(
            model_name='nativerunnercheckpoint',
            name='scheme',
            field=models.TextField(null=True),
        ),
        migrations.AddField(
            model_name='nativerunnercheckpoint',
            name='key_id',
            field=models.TextField(null=True),
        ),
        migrations.AddField(
            model_name='nativerunnercheckpoint',
            name='nonce',
            field=models.BinaryField(null=True),
        ),
        migrations.AddField(
            model_name='nativerunnercheckpoint',
            name='ciphertext',
            field=models.BinaryField(null=True),
        ),
    ]
