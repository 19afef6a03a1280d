"""A read-only admin of the fenced jobs: status (``pending (never claimed)`` for an enqueued job
no worker has claimed yet, with a filter for those), key (as stored), generation, the lease in
Redis (holder generation and time left: one round trip for the page), attempts, last error
(searchable, like the task name), timestamps to the millisecond, each job's history; actions
for what the CLI does (requeue a dead job, recording the admin user in the transition's reason;
recover stranded ones, also as a button that needs no selection). Every change goes through the
store (fenced), never through these models. The outbox's effects are listed read-only too (state,
attempts, last error, idempotency key; never payloads), searchable by job key: ``celery -A proj
fence outbox requeue`` puts dead ones back."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from celery_fence.config import FenceConfig
from celery_fence.contrib.django.models import Job, OutboxEffect, Transition
from celery_fence.contrib.django.operations import (
    current_celery_app,
    recover_stranded,
    requeue_dead,
)
from celery_fence.contrib.django.settings import fence_alias
from celery_fence.pipeline.backends import lease_store
from celery_fence.schema import PENDING

logger = logging.getLogger("celery_fence.admin")

#: How many characters of a job's last error the list shows (the whole of it: hover, or the job).
ERROR_CHARS = 120


def millis(value: dt.datetime | None) -> str:
    """``2024-05-01 10:00:31.042``: a timestamp to the millisecond, in the current time zone
    (Django's default formats stop at the second, and fence transitions are milliseconds apart)."""
    if value is None:
        return "-"
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}"


def shown_key(key: str) -> Any:
    """The key exactly as stored: never capitalised, in code type so ``:`` and case read clearly."""
    return format_html(
        '<code class="fence-key" style="text-transform:none;overflow-wrap:anywhere">{}</code>', key
    )


def shown_error(error_type: str | None, message: str | None) -> Any:
    """``Type: message`` (the type's last dotted part) truncated to :data:`ERROR_CHARS`, the
    whole as a tooltip, wrapping: the column stays on screen at 1400 px however long the error."""
    if not error_type and not message:
        return "-"
    full = f"{error_type or 'Error'}: {message}" if message else str(error_type)
    name = (error_type or "").rsplit(".", 1)[-1]  # builtins.ConnectionError -> ConnectionError
    shown = f"{name}: {message}" if name and message else (name or str(message))
    short = shown if len(shown) <= ERROR_CHARS else shown[: ERROR_CHARS - 1] + "\u2026"
    return format_html(
        '<span class="fence-error" title="{}" style="display:inline-block;max-width:16em;'
        'white-space:normal;overflow-wrap:anywhere">{}</span>',
        full,
        short,
    )


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
    fields = ("at_ms", "action", "generation", "attempt_id", "reason")
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ("id",)

    @admin.display(description="at")
    def at_ms(self, transition: Transition) -> str:
        return millis(transition.at)


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


class JobChangeList(ChangeList):
    """Reads the leases of the page's jobs from Redis in one round trip, once per page."""

    def get_results(self, request: Any) -> None:
        super().get_results(request)
        jobs = list(self.result_list)
        leases = self.model_admin.leases_of([job.key for job in jobs])
        for job in jobs:
            job.fence_lease = leases.get(job.key, ())


@admin.register(Job)
class JobAdmin(ReadOnly, admin.ModelAdmin):
    list_display = (
        "shown_key",
        "shown_status",
        "task",
        "shown_generation",
        "lease",
        "tries",
        "updated_ms",
        "error",
    )
    list_display_links = ("shown_key",)
    list_filter = ("status", NeverClaimedFilter, "task_name")
    search_fields = ("key", "task_name", "error_type", "error_message")
    search_help_text = "Search by key, task name or error (type or message)."
    readonly_fields = (
        "shown_key",
        "task_name",
        "status",
        "generation",
        "lease",
        "attempt_id",
        "attempts",
        "error_type",
        "error_message",
        "created_ms",
        "updated_ms",
        "finished_ms",
        "retry_ms",
        "request",
        "result",
    )
    inlines = (TransitionInline,)
    actions = ("requeue_dead", "recover_stranded")
    change_list_template = "admin/celery_fence/job/change_list.html"

    @admin.display(description="key", ordering="key")
    def shown_key(self, job: Job) -> Any:
        return shown_key(job.key)

    @admin.display(description="status", ordering="status")
    def shown_status(self, job: Job) -> str:
        """``pending (never claimed)`` for a job no worker has claimed yet (enqueued)."""
        never = job.status == PENDING and job.generation == 0
        return f"{job.status} (never claimed)" if never else job.status

    @admin.display(description="task", ordering="task_name")
    def task(self, job: Job) -> Any:
        """The task's last dotted part (the whole name as a tooltip): the list fits 1400 px."""
        return format_html(
            '<span title="{}">{}</span>', job.task_name, job.task_name.split(".")[-1]
        )

    @admin.display(description="gen", ordering="generation")
    def shown_generation(self, job: Job) -> int:
        return job.generation

    @admin.display(description="tries", ordering="attempts")
    def tries(self, job: Job) -> int:
        return job.attempts

    @admin.display(description="lease")
    def lease(self, job: Job) -> str:
        """``gen 2, 1.4 s left`` for a live lease in Redis; ``-`` for none (``?`` when Redis
        could not be read). A lease whose generation is not the stored one says so."""
        found = getattr(job, "fence_lease", None)
        if found is None:  # a change page: read this one
            found = self.leases_of([job.key]).get(job.key, ())
        if found == ():
            return "-"
        if found == "?":
            return "? (Redis unavailable)"
        remaining, generation = found
        shown = f"gen {generation}, {remaining:.1f} s left"
        return shown if generation == job.generation else f"{shown} (stored {job.generation})"

    @admin.display(description="updated", ordering="updated_at")
    def updated_ms(self, job: Job) -> str:
        return millis(job.updated_at)

    @admin.display(description="created", ordering="created_at")
    def created_ms(self, job: Job) -> str:
        return millis(job.created_at)

    @admin.display(description="finished", ordering="finished_at")
    def finished_ms(self, job: Job) -> str:
        return millis(job.finished_at)

    @admin.display(description="retry at", ordering="retry_at")
    def retry_ms(self, job: Job) -> str:
        return millis(job.retry_at)

    @admin.display(description="error", ordering="error_type")
    def error(self, job: Job) -> Any:
        return shown_error(job.error_type, job.error_message)

    def leases_of(self, keys: list[str]) -> dict[str, Any]:
        """key -> (seconds left, generation) for the live leases among ``keys``; every key maps
        to ``"?"`` when Redis cannot be read (the page still shows)."""
        if not keys:
            return {}
        try:
            leases = lease_store(FenceConfig.from_app(current_celery_app()))
            return dict(leases.remaining_many(keys))
        except Exception as exc:  # a view: never fail the page on Redis
            logger.warning("could not read the leases for the admin: %s", type(exc).__name__)
            return dict.fromkeys(keys, "?")

    def get_changelist(self, request: Any, **kwargs: Any) -> type[ChangeList]:
        return JobChangeList

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).using(fence_alias() or "default")

    def has_operate_permission(self, request: Any) -> bool:
        """The actions re-send messages: superusers only (viewing follows Django's permissions)."""
        return bool(request.user.is_active and request.user.is_superuser)

    def get_urls(self) -> list[Any]:
        recover = path(
            "recover/",
            self.admin_site.admin_view(self.recover_view),
            name="celery_fence_job_recover",
        )
        return [recover, *super().get_urls()]

    def changelist_view(self, request: Any, extra_context: dict[str, Any] | None = None) -> Any:
        context = {**(extra_context or {}), "can_operate": self.has_operate_permission(request)}
        return super().changelist_view(request, extra_context=context)

    def recover_view(self, request: Any) -> Any:
        """The "Recover stranded jobs" button: one ``celery fence recover`` run, no selection."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_operate_permission(request):
            raise PermissionDenied
        self.message_user(request, recover_stranded(current_celery_app()), messages.INFO)
        return HttpResponseRedirect(reverse("admin:celery_fence_job_changelist"))

    @admin.action(
        description="Requeue the selected dead jobs (celery fence requeue)",
        permissions=["operate"],
    )
    def requeue_dead(self, request: Any, queryset: Any) -> None:
        app = current_celery_app()
        by = request.user.get_username()
        for key in queryset.values_list("key", flat=True):
            self.message_user(request, requeue_dead(app, key, by=by), messages.INFO)

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
        "available_ms",
        "error",
        "created_ms",
        "delivered_ms",
    )
    list_filter = ("status",)
    search_fields = ("key", "name", "last_error")
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
        "created_ms",
        "delivered_ms",
    )

    @admin.display(description="available at", ordering="available_at")
    def available_ms(self, effect: OutboxEffect) -> str:
        return millis(effect.available_at)

    @admin.display(description="created", ordering="created_at")
    def created_ms(self, effect: OutboxEffect) -> str:
        return millis(effect.created_at)

    @admin.display(description="delivered", ordering="delivered_at")
    def delivered_ms(self, effect: OutboxEffect) -> str:
        return millis(effect.delivered_at)

    @admin.display(description="last error")
    def error(self, effect: OutboxEffect) -> Any:
        return shown_error(None, effect.last_error) if effect.last_error else "-"

    def get_queryset(self, request: Any) -> Any:
        return super().get_queryset(request).using(fence_alias() or "default")
