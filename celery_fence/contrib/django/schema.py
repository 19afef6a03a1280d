"""The fence tables in a Django database: what the app's migration runs.

The migration runs celery-fence's own Alembic history (:func:`celery_fence.migrate.upgrade`, what
``celery fence init-db`` runs) on the database being migrated, so ``manage.py migrate`` and
``init-db`` create the same tables and record the same version (``fence_alembic_version``), and
either may run after the other. Only the ``CELERY_FENCE_DATABASE`` alias gets the tables (or,
without it, the alias whose database ``CELERY_FENCE_DATABASE_URL`` names), and only where the
project's database routers allow the ``celery_fence`` app to migrate. Test databases are migrated
like any other, so the fence tables are there under pytest-django and Django's test runner.
"""

from __future__ import annotations

from typing import Any

from django.db import router

from celery_fence import migrate
from celery_fence.contrib.django.database import same_database_problem, url_for_settings
from celery_fence.contrib.django.settings import fence_alias, fence_config
from celery_fence.settings import DEFAULT_DATABASE_URL

APP_LABEL = "celery_fence"


def is_fence_database(alias: str, settings_dict: Any) -> bool:
    """Whether Django's ``alias`` holds the fence store."""
    wanted = fence_alias()
    if wanted is not None:
        return alias == wanted
    url = fence_config().database_url
    if url == DEFAULT_DATABASE_URL:
        return False
    return same_database_problem(url, alias, settings_dict) is None


def upgrade(apps: Any, schema_editor: Any) -> None:
    """The migration's forward step: create or upgrade the fence tables on this alias."""
    connection = schema_editor.connection
    alias = connection.alias
    if not router.allow_migrate(alias, APP_LABEL) or not is_fence_database(
        alias, connection.settings_dict
    ):
        return
    migrate.upgrade(url_for_settings(alias, connection.settings_dict))


def keep(apps: Any, schema_editor: Any) -> None:
    """Unapplying keeps the tables (and their jobs): drop them by hand if you mean it."""
