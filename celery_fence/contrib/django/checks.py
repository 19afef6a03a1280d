"""``manage.py check``: the fence settings, validated as a worker validates them."""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.db import connections

from celery_fence.contrib.django.database import autocommit_off, same_database_problem
from celery_fence.contrib.django.settings import STORE_UNSET, fence_alias, fence_config, store_named
from celery_fence.errors import ConfigurationError


@checks.register(checks.Tags.database, "celery_fence")
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    alias = fence_alias()
    if alias is not None and alias in connections:
        off = autocommit_off(alias, connections[alias].settings_dict)
        if off is not None:
            return [_autocommit_error(off)]
    try:
        config = fence_config()
    except ConfigurationError as exc:
        return [
            checks.Error(
                str(exc),
                hint="Fix the CELERY_FENCE_* setting named above (see docs/django.md).",
                id="celery_fence.E001",
            )
        ]
    if alias is None:
        # The store set by URL: an alias on its database is one fence.atomic() runs on, and
        # AUTOCOMMIT off there loses the block's writes (while the job says completed).
        for name in connections:
            db = connections[name].settings_dict
            off = autocommit_off(name, db)
            if off is not None and same_database_problem(config.database_url, name, db) is None:
                return [_autocommit_error(off)]
        if not store_named():
            return [
                checks.Error(
                    STORE_UNSET,
                    hint='Set CELERY_FENCE_DATABASE = "default" (the alias your models use).',
                    id="celery_fence.E002",
                )
            ]
        return []
    problem = same_database_problem(config.database_url, alias, connections[alias].settings_dict)
    if problem is not None:
        return [
            checks.Warning(
                f"CELERY_FENCE_DATABASE_URL is not DATABASES[{alias!r}] ({problem}): the URL wins, "
                f"so self.fence.atomic(using={alias!r}) will refuse to run.",
                hint="Remove CELERY_FENCE_DATABASE_URL, or point it at that database.",
                id="celery_fence.W002",
            )
        ]
    return []


def _autocommit_error(message: str) -> checks.CheckMessage:
    return checks.Error(
        message,
        hint="Remove 'AUTOCOMMIT': False from that DATABASES entry (see docs/django.md).",
        id="celery_fence.E003",
    )
