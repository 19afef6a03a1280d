"""The store URLs a test runs on: ``db_url``'s parameters, and the function every ``db_url``
fixture shares.

- ``sqlite``: a SQLite file of the test's own;
- ``postgresql``: the session's PostgreSQL database through psycopg2 (``postgresql+psycopg2://``);
- ``psycopg3``: the same database through psycopg 3 (``postgresql+psycopg://``).

Each pytest-xdist worker has a PostgreSQL database of its own, and its rows are deleted before
each test that asks for it, so a test counts (and recovery re-sends) only rows it made.

Most tests run on the first two (``DEFAULT``); the store's own tests, the fenced commit check, the
outbox and one real-worker test run on all three (``EVERY_DRIVER``), so both drivers are covered
without running every test twice on PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_fence.store import Store

DEFAULT = ("sqlite", "postgresql")
EVERY_DRIVER = ("sqlite", "postgresql", "psycopg3")


def with_driver(url: str, driver: str) -> str:
    """``url`` (a PostgreSQL URL) through ``driver`` (``psycopg`` or ``psycopg2``)."""
    return (
        sa.engine.make_url(url)
        .set(drivername=f"postgresql+{driver}")
        .render_as_string(hide_password=False)
    )


def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL for ``request.param`` (one of :data:`EVERY_DRIVER`), its schema created."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'fence.sqlite3'}"
        Store(url).create_schema()
        return url
    url = str(
        request.getfixturevalue("pg_url_psycopg3" if request.param == "psycopg3" else "pg_url")
    )
    store = Store(url)
    try:  # the session's database: a test sees no row of an earlier one (recover scans them all)
        store.admin.delete_all_rows()
    finally:
        store.dispose()
    return url
