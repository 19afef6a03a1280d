"""Under pytest-django: the plugin's store and workers on the **test** databases.

pytest-django creates the test databases and renames them in the pytest process only; a worker
process imports the project's settings afresh and would write to the development database. So the
plugin sets the test databases up (``django_db_setup``) before it starts a worker, hands their
names to the workers (``CELERY_FENCE_TESTING``'s ``django_databases``, applied to
``settings.DATABASES`` by :mod:`celery_fence.testing.worker_app` before Django connects), and, when
``CELERY_FENCE_DATABASE`` names an alias, keeps the fence store in that alias's test database
(where ``migrate`` created the fence tables).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class DjangoTestDatabases:
    """The test databases' names by alias, and the store URL when the fence uses an alias."""

    names: dict[str, str]
    store_url: str | None


def test_databases(request: pytest.FixtureRequest) -> DjangoTestDatabases | None:
    """The test databases when pytest-django runs with configured settings, else None."""
    if not request.config.pluginmanager.hasplugin("django"):
        return None
    try:
        from django.conf import settings
    except ImportError:  # pragma: no cover - pytest-django needs Django
        return None
    if not settings.configured:
        return None
    request.getfixturevalue("django_db_setup")
    names: dict[str, str] = {}
    for alias, db in settings.DATABASES.items():
        name = str(db.get("NAME") or "")
        if "sqlite" in str(db.get("ENGINE", "")) and (
            name in ("", ":memory:") or "mode=memory" in name
        ):
            raise RuntimeError(
                f"celery-fence: the test database of DATABASES[{alias!r}] is in-memory SQLite, "
                "which the plugin's worker processes cannot see: set "
                f"DATABASES[{alias!r}]['TEST'] = {{'NAME': 'test_db.sqlite3'}} (a file)."
            )
        names[alias] = name
    from celery_fence.contrib.django.database import url_for_alias
    from celery_fence.contrib.django.settings import fence_alias

    alias = fence_alias()
    return DjangoTestDatabases(names, None if alias is None else url_for_alias(alias))
