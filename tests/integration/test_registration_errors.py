"""A registration the database refuses: the reason names the database's error, and blames the
schema only when the error says the fence tables are missing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_fence import FencedTask
from celery_fence import signals as fence_signals
from celery_fence.store import Store
from tests.support.env import PG_ADMIN_URL, REDIS_URL
from tests.support.stores import with_driver


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A PostgreSQL database of this test's own, without the fence tables."""
    name = f"fence_refused_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def _register_reason(url: str, prefix: str) -> str:
    """Run a fenced task in this process on ``url``'s store; the reason of its re-send."""
    app = Celery(f"refused-{prefix}", set_as_current=False)
    app.conf.update(fence_database_url=url, fence_redis_url=REDIS_URL, fence_key_prefix=prefix)

    @app.task(base=FencedTask, bind=True, fence_key=lambda n: f"refused:{n}", name="t.refused")
    def refused(self: Any, n: int) -> int:
        return n

    reasons: list[str] = []

    def on_retry(sender: Any = None, reason: str | None = None, **_: Any) -> None:
        reasons.append(str(reason))

    fence_signals.job_retry_scheduled.connect(on_retry, weak=False)
    try:
        with pytest.raises(sa.exc.ProgrammingError):  # a direct call raises instead of re-sending
            refused(1)
    finally:
        fence_signals.job_retry_scheduled.disconnect(on_retry)
        app.close()
    (reason,) = reasons
    return reason


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_refused_registration_names_the_error_and_blames_the_schema_only_when_missing(
    empty_pg_url: str, prefix: str, driver: str
) -> None:
    url = with_driver(empty_pg_url, driver)
    # Given no fence tables: the reason says so, and how to create them.
    reason = _register_reason(url, prefix)
    assert "UndefinedTable" in reason and "fence_jobs" in reason
    assert "is the schema created? celery fence init-db" in reason
    # Given the tables, but a column the statement cannot write (as a driver problem would be):
    store = Store(url)
    store.create_schema()
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE fence_jobs ALTER COLUMN request TYPE integer USING NULL")
    store.dispose()
    reason = _register_reason(url, prefix)
    # then the reason is the database's error, not a missing schema.
    assert reason.startswith('store refused registration (DatatypeMismatch: column "request"')
    assert "schema" not in reason
