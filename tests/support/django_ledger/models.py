from __future__ import annotations

from django.db import models


class Entry(models.Model):
    key = models.CharField(max_length=200)
    writer = models.CharField(max_length=64)

    class Meta:
        app_label = "django_ledger"
        db_table = "t_django_entries"
