"""Unmanaged models over the fence tables, for the admin: read them, never write them (every
write goes through the store, fenced)."""

from __future__ import annotations

from django.db import models


class Job(models.Model):
    key = models.CharField(max_length=512, primary_key=True)
    task_name = models.CharField(max_length=255)
    status = models.CharField(max_length=16)
    generation = models.BigIntegerField()
    attempt_id = models.CharField(max_length=64)
    attempts = models.IntegerField()
    result = models.JSONField(null=True)
    request = models.JSONField(null=True)
    error_type = models.CharField(max_length=255, null=True)
    error_message = models.TextField(null=True)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)
    retry_at = models.DateTimeField(null=True)
    unique_key = models.CharField(max_length=512, null=True)

    class Meta:
        managed = False
        db_table = "fence_jobs"
        ordering = ["-updated_at"]
        verbose_name = "fenced job"

    def __str__(self) -> str:
        return f"{self.key} ({self.status}, generation {self.generation})"


class Transition(models.Model):
    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(
        Job,
        db_column="key",
        db_constraint=False,
        on_delete=models.DO_NOTHING,
        related_name="history",
    )
    generation = models.BigIntegerField(null=True)
    attempt_id = models.CharField(max_length=64, null=True)
    action = models.CharField(max_length=32)
    reason = models.CharField(max_length=255, null=True)
    at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "fence_transitions"
        ordering = ["id"]
        verbose_name = "transition"

    def __str__(self) -> str:
        return f"{self.action} generation {self.generation}"


class OutboxEffect(models.Model):
    """A row of ``fence_outbox`` without its payload: the model has no payload field, so the
    admin never even selects it (what a handler sends may be personal data)."""

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=512)
    name = models.CharField(max_length=255)
    idempotency_key = models.CharField(max_length=128)
    status = models.CharField(max_length=16)
    attempts = models.IntegerField()
    available_at = models.DateTimeField()
    claimed_by = models.CharField(max_length=64, null=True)
    claimed_until = models.DateTimeField(null=True)
    last_error = models.TextField(null=True)
    created_at = models.DateTimeField()
    delivered_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "fence_outbox"
        ordering = ["-id"]
        verbose_name = "outbox effect"

    def __str__(self) -> str:
        return f"{self.name} of {self.key} ({self.status})"
