"""The Django app: ``INSTALLED_APPS += ["celery_fence.contrib.django"]``."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryFenceConfig(AppConfig):
    """celery-fence's tables through ``manage.py migrate``, its settings checked by
    ``manage.py check``, and a read-only admin of its jobs."""

    name = "celery_fence.contrib.django"
    label = "celery_fence"
    verbose_name = "celery-fence"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery_fence.contrib.django import checks  # noqa: F401 - registers the system checks
