"""Unique jobs: the ``unique_key`` column and its partial unique index (celery-fence's own
migration ``celery_fence_0005_unique``), run on the fence database as ``0001`` runs the first,
and the field on the admin's unmanaged model."""

from __future__ import annotations

from django.db import migrations, models

from celery_fence.contrib.django import schema


class Migration(migrations.Migration):
    atomic = False  # the fence tables are changed on a connection of their own
    dependencies = [("celery_fence", "0005_beat")]

    operations = [
        migrations.RunPython(schema.upgrade, schema.keep),
        migrations.AddField(
            model_name="job",
            name="unique_key",
            field=models.CharField(max_length=512, null=True),
        ),
    ]
