"""A read-only admin of the fenced jobs: status (``pending (never claimed)`` for an enqueued job
no worker has claimed yet, with a filter for those), key, generation, attempts, last error, each
job's history; actions for what the CLI does (requeue a dead job, recover stranded ones). Every
change goes through the store (fenced), never through these models. The outbox's effects are
listed read-only too (state, attempts, last error, idempotency key; never payloads), searchable by
job key: ``celery -A proj fence outbox requeue`` puts dead ones back."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages

from celery_fence.contrib.django.models import Job, OutboxEffect, Transition
from celery_fence.contrib.django.operations import (
    current_celery_app,
    recover_stranded,
    requeue_dead,
)
from celery_fence.contrib.django.settings import fence_alias
from celery_fence.schema import PENDING


class ReadOnly:
    """No add, change or delete: the rows are the store's."""

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: Any, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: Any, obj: Any = None) -> bool:
        return False


class TransitionInline(ReadOnly, admin.TabularInline):
    model = Transition
    fields = ("at", "action", "generation", "attempt_id", "reason")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ("id",)


class NeverClaimedFilter(admin.SimpleListFilter):
    """Jobs enqueued and not yet claimed by any worker (``pending``, generation 0)."""

    title = "claimed"
    parameter_name = "never_claimed"

    def lookups(self, request: Any, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "never claimed")]

    def queryset(self, request: Any, queryset: Any) -> Any:
        if self.value() == "yes":
            return queryset.filter(status=PENDING, generation=0)
        return queryset


@admin.register(Job)
class JobAdmin(ReadOnly, admin.ModelAdmin):
    list_display = (
        "key",
        "shown_status",
        "task_name",
        "generation",
        "attempts",
        "updated_at",
        "error_type",
    )
    list_filter = ("status", NeverClaimedFilter, "task_name")
    search_fields = ("key",)
    readonly_fields = (
        "key",
        "task_name",
        "status",
        "generation",
        "attempt_id",
        "attempts",
        "error_type",
        "error_message",
        "created_at",
        "updated_at",
        "finished_at",
        "retry_at",
        "request",
        "result",
    )
    inlines = (TransitionInline,)
    actions = ("requeue_dead", "recover_stranded")

    @admin.display(description="status", ordering="status")
    def shown_status(self, job: Job) -> str:
        """``pending (never claimed)`` for a job no worker has claimed yet (enqueued)."""
        never = job.status == PENDING and job.generation == 0
        return f"{job.status} (never claimed)" if never else job.status

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).using(fence_alias() or "default")

    def has_operate_permission(self, request: Any) -> bool:
        """The actions re-send messages: superusers only (viewing follows Django's permissions)."""
        return bool(request.user.is_active and request.user.is_superuser)

    @admin.action(
        description="Requeue the selected dead jobs (celery fence requeue)",
        permissions=["operate"],
    )
    def requeue_dead(self, request: Any, queryset: Any) -> None:
        app = current_celery_app()
        for key in queryset.values_list("key", flat=True):
            self.message_user(request, requeue_dead(app, key), messages.INFO)

    @admin.action(
        description="Recover stranded jobs (celery fence recover; ignores the selection)",
        permissions=["operate"],
    )
    def recover_stranded(self, request: Any, queryset: Any) -> None:
        self.message_user(request, recover_stranded(current_celery_app()), messages.INFO)


@admin.register(OutboxEffect)
class OutboxEffectAdmin(ReadOnly, admin.ModelAdmin):
    """The outbox's effects, newest first, without their payloads (the model has no such field):
    requeue a dead one with ``celery -A proj fence outbox requeue ID``."""

    list_display = (
        "id",
        "key",
        "name",
        "status",
        "attempts",
        "available_at",
        "last_error",
        "created_at",
        "delivered_at",
    )
    list_filter = ("status",)
    search_fields = ("key",)
    readonly_fields = (
        "id",
        "key",
        "name",
        "idempotency_key",
        "status",
        "attempts",
        "available_at",
        "claimed_by",
        "claimed_until",
        "last_error",
        "created_at",
        "delivered_at",
    )

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).using(fence_alias() or "default")
