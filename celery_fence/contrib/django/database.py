"""The store's database from Django's ``DATABASES``: the URL of an alias, and whether a Django
connection is on the store's database (``fence.atomic()`` needs both in one database)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from celery_fence.errors import ConfigurationError
from celery_fence.store.urls import different_database

POSTGRESQL_ENGINES = frozenset(
    {
        "django.db.backends.postgresql",
        "django.db.backends.postgresql_psycopg2",
        "django.contrib.gis.db.backends.postgis",
    }
)
SQLITE_ENGINES = frozenset(
    {"django.db.backends.sqlite3", "django.contrib.gis.db.backends.spatialite"}
)
#: Django's own ``OPTIONS`` of the PostgreSQL backend: not libpq connection parameters.
_DJANGO_ONLY_OPTIONS = frozenset(
    {"isolation_level", "server_side_binding", "pool", "assume_role", "cursor_factory"}
)


def url_for_alias(alias: str) -> str:
    """The store URL of ``DATABASES[alias]`` as the settings give it now."""
    try:
        databases = settings.DATABASES
    except ImproperlyConfigured as exc:
        raise ConfigurationError(
            f"fence_database={alias!r} names a Django DATABASES alias, but Django's settings are "
            f"not configured ({exc}): set DJANGO_SETTINGS_MODULE before the Celery app reads its "
            "settings (the standard proj/celery.py does), or set fence_database_url instead."
        ) from None
    if alias not in databases:
        known = ", ".join(repr(a) for a in databases) or "none"
        raise ConfigurationError(
            f"CELERY_FENCE_DATABASE={alias!r} is not an alias in DATABASES (aliases: {known}): "
            "set it to one of them, e.g. 'default'."
        )
    off = autocommit_off(alias, databases[alias])
    if off is not None:  # the settings' check, worker start and `celery fence check` refuse it
        raise ConfigurationError(f"CELERY_FENCE_DATABASE={alias!r}: {off}")
    return url_for_settings(alias, databases[alias])


def url_for_settings(alias: str, db: Mapping[str, Any]) -> str:
    """A SQLAlchemy URL for one ``DATABASES`` entry: PostgreSQL (psycopg 3 when it is
    installed, else psycopg2) or a SQLite file."""
    engine = db.get("ENGINE", "")
    if engine in POSTGRESQL_ENGINES:
        driver = "psycopg" if importlib.util.find_spec("psycopg") is not None else "psycopg2"
        options = dict(db.get("OPTIONS") or {})
        query = {
            name: str(value)
            for name, value in options.items()
            if name not in _DJANGO_ONLY_OPTIONS and isinstance(value, (str, int, float))
        }
        port = db.get("PORT")
        url = sa.URL.create(
            f"postgresql+{driver}",
            username=db.get("USER") or None,
            password=db.get("PASSWORD") or None,
            host=db.get("HOST") or None,
            port=int(port) if port else None,
            database=db.get("NAME") or None,
            query=query,
        )
        return url.render_as_string(hide_password=False)
    if engine in SQLITE_ENGINES:
        name = str(db.get("NAME") or "")
        if name in ("", ":memory:") or "mode=memory" in name:
            raise ConfigurationError(
                f"DATABASES[{alias!r}] is an in-memory SQLite database: the fence store is shared "
                "by every worker process, so it needs a file. Set NAME (and TEST['NAME'] for "
                "tests) to a file path, or set CELERY_FENCE_DATABASE_URL."
            )
        if name.startswith("file:"):
            name = name[len("file:") :].split("?", 1)[0]
        return f"sqlite:///{os.path.abspath(name)}"
    raise ConfigurationError(
        f"DATABASES[{alias!r}] uses ENGINE {engine!r}; the fence store runs on PostgreSQL "
        "(django.db.backends.postgresql) and SQLite (django.db.backends.sqlite3): point "
        "CELERY_FENCE_DATABASE at such an alias, or set CELERY_FENCE_DATABASE_URL."
    )


def same_database_problem(store_url: str, alias: str, db: Mapping[str, Any]) -> str | None:
    """Why Django's ``alias`` (settings ``db``) is not the store's database, or None."""
    try:
        theirs = sa.engine.make_url(url_for_settings(alias, db))
    except ConfigurationError as exc:
        return str(exc)
    return different_database(sa.engine.make_url(store_url), theirs)


def atomic_aliases_on(store_url: str) -> list[str]:
    """The aliases on the store's database whose connection, in this thread, is inside a
    ``transaction.atomic()`` block (or has autocommit off): a fenced task run now in this thread
    would wait on that transaction's locks. Only connections already made in this thread are
    looked at; none is opened."""
    found = []
    for conn in connections.all(initialized_only=True):
        if not (conn.in_atomic_block or (conn.connection is not None and not conn.autocommit)):
            continue
        if same_database_problem(store_url, conn.alias, conn.settings_dict) is None:
            found.append(conn.alias)
    return found


def autocommit_off(alias: str, db: Mapping[str, Any]) -> str | None:
    """The refusal of ``DATABASES[alias]["AUTOCOMMIT"] = False``, or None: Django then never
    commits an outermost ``atomic()`` block, so ``fence.atomic()``'s writes would roll back when
    the session ends while the job is stored ``completed``."""
    if db.get("AUTOCOMMIT", True):
        return None
    return (
        f"DATABASES[{alias!r}]['AUTOCOMMIT'] is False: Django then never commits a transaction "
        f"itself, so self.fence.atomic(using={alias!r}) would end without committing, its writes "
        "would roll back when the session ends, and the job would still be stored completed. "
        f"Remove 'AUTOCOMMIT': False from DATABASES[{alias!r}] (Django's default, True): "
        "fence.atomic() is the transaction, and it commits only after the ownership check."
    )
