"""The unmanaged model the admin lists the outbox's effects through (no payload field); the
table itself is celery-fence's own (``0001``)."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("celery_fence", "0002_unfinished_index")]

    operations = [
        migrations.CreateModel(
            name="OutboxEffect",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("key", models.CharField(max_length=512)),
                ("name", models.CharField(max_length=255)),
                ("idempotency_key", models.CharField(max_length=128)),
                ("status", models.CharField(max_length=16)),
                ("attempts", models.IntegerField()),
                ("available_at", models.DateTimeField()),
                ("claimed_by", models.CharField(max_length=64, null=True)),
                ("claimed_until", models.DateTimeField(null=True)),
                ("last_error", models.TextField(null=True)),
                ("created_at", models.DateTimeField()),
                ("delivered_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "outbox effect",
                "db_table": "fence_outbox",
                "ordering": ["-id"],
                "managed": False,
            },
        ),
    ]
