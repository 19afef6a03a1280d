"""The fence tables, created by celery-fence's own migrations (see ``..schema``), and the
unmanaged models the admin reads them through."""

from __future__ import annotations

import django.db.models.deletion
from django.db import migrations, models

from celery_fence.contrib.django import schema


class Migration(migrations.Migration):
    initial = True
    atomic = False  # the fence tables are made on a connection of their own
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.RunPython(schema.upgrade, schema.keep),
        migrations.CreateModel(
            name="Job",
            fields=[
                ("key", models.CharField(max_length=512, primary_key=True, serialize=False)),
                ("task_name", models.CharField(max_length=255)),
                ("status", models.CharField(max_length=16)),
                ("generation", models.BigIntegerField()),
                ("attempt_id", models.CharField(max_length=64)),
                ("attempts", models.IntegerField()),
                ("result", models.JSONField(null=True)),
                ("request", models.JSONField(null=True)),
                ("error_type", models.CharField(max_length=255, null=True)),
                ("error_message", models.TextField(null=True)),
                ("created_at", models.DateTimeField()),
                ("updated_at", models.DateTimeField()),
                ("finished_at", models.DateTimeField(null=True)),
                ("retry_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "fenced job",
                "db_table": "fence_jobs",
                "ordering": ["-updated_at"],
                "managed": False,
            },
        ),
        migrations.CreateModel(
            name="Transition",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("generation", models.BigIntegerField(null=True)),
                ("attempt_id", models.CharField(max_length=64, null=True)),
                ("action", models.CharField(max_length=32)),
                ("reason", models.CharField(max_length=255, null=True)),
                ("at", models.DateTimeField()),
                (
                    "job",
                    models.ForeignKey(
                        db_column="key",
                        db_constraint=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="history",
                        to="celery_fence.job",
                    ),
                ),
            ],
            options={
                "verbose_name": "transition",
                "db_table": "fence_transitions",
                "ordering": ["id"],
                "managed": False,
            },
        ),
    ]
