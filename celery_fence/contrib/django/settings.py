"""The fence settings as Django's ``settings`` holds them (``CELERY_FENCE_*``, or ``FENCE_*``),
read with :mod:`celery_fence.config`'s validation: for the system checks and the migration, which
run without a Celery app."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from celery_fence.config import FenceConfig
from celery_fence.settings import DJANGO_STORE_UNSET

PREFIXES = ("CELERY_FENCE_", "FENCE_")


def fence_settings() -> dict[str, Any]:
    """Every ``CELERY_FENCE_*`` / ``FENCE_*`` setting of the project."""
    return {name: getattr(settings, name) for name in dir(settings) if name.startswith(PREFIXES)}


def fence_alias() -> str | None:
    """``CELERY_FENCE_DATABASE`` (or ``FENCE_DATABASE``), if set."""
    found = fence_settings()
    for name in ("CELERY_FENCE_DATABASE", "FENCE_DATABASE"):
        if found.get(name) is not None:
            return str(found[name])
    return None


#: Why a Django project must name its store (``manage.py check``'s ``celery_fence.E002``, and
#: ``celery fence check``).
STORE_UNSET = DJANGO_STORE_UNSET


def store_named() -> bool:
    """Whether the project names the store: ``CELERY_FENCE_DATABASE`` or
    ``CELERY_FENCE_DATABASE_URL`` (or their ``FENCE_`` spellings)."""
    found = fence_settings()
    return any(
        found.get(prefix + name) is not None
        for prefix in PREFIXES
        for name in ("DATABASE", "DATABASE_URL")
    )


def fence_config() -> FenceConfig:
    """The validated settings (raises :class:`~celery_fence.ConfigurationError`)."""
    return FenceConfig.from_mapping(fence_settings())
