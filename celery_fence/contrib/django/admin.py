"""A read-only admin of the fenced jobs: status, key, generation, attempts, last error, each
job's history; actions for what the CLI does (requeue a dead job, recover stranded ones). Every
change goes through the store (fenced), never through these models."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages

from .models import Job, Transition
from .operations import current_celery_app, recover_stranded, requeue_dead
from .settings import fence_alias


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


@admin.register(Job)
class JobAdmin(ReadOnly, admin.ModelAdmin):
    list_display = (
        "key",
        "status",
        "task_name",
        "generation",
        "attempts",
        "updated_at",
        "error_type",
    )
    list_filter = ("status", "task_name")
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
