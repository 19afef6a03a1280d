"""The beat scheduler's table (celery-fence's own migration ``celery_fence_0004_beat``), run on
the fence database as ``0001`` runs the first."""

from __future__ import annotations

from django.db import migrations

from celery_fence.contrib.django import schema


class Migration(migrations.Migration):
    atomic = False  # the fence tables are changed on a connection of their own
    dependencies = [("celery_fence", "0004_steps")]

    operations = [migrations.RunPython(schema.upgrade, schema.keep)]
