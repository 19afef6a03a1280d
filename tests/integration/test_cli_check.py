"""``celery -A <app> fence check``: task settings, Redis, the database, the schema, and a fenced
write and read on every store the app's tasks use, rolled back."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from celery_fence.store import Store
from celery_fence.store.probe import PROBE_KEY_PREFIX
from tests.integration.test_cli import (
    CELERY,
    UNREACHABLE_PG,
    UNREACHABLE_REDIS,
    assert_one_line_error,
    fence_cli,
    ok,
)
from tests.support.env import PG_ADMIN_URL
from tests.support.stores import with_driver
from tests.support.worker import ROOT

# The checks do not depend on the store's dialect (the missing-schema test uses PostgreSQL itself).
pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def test_check_passes_on_a_good_setup(worker_env: dict[str, str]) -> None:
    out = ok(fence_cli(worker_env, "check"))
    assert "settings: ok" in out and "redis: ok" in out and "schema current" in out


def test_check_names_a_bad_setting_and_the_fix(worker_env: dict[str, str]) -> None:
    proc = fence_cli({**worker_env, "FENCE_T_TTL": "2.0", "FENCE_T_RENEW": "1.9"}, "check")
    assert_one_line_error(proc, 1, "fence_renew_interval=1.9", "fence_lease_ttl")


def test_check_says_when_redis_is_unreachable(worker_env: dict[str, str]) -> None:
    proc = fence_cli({**worker_env, "FENCE_T_REDIS": UNREACHABLE_REDIS}, "check")
    assert_one_line_error(proc, 1, "127.0.0.1:1")


def test_check_says_when_the_database_is_unreachable(worker_env: dict[str, str]) -> None:
    proc = fence_cli({**worker_env, "FENCE_T_DB": UNREACHABLE_PG}, "check")
    assert_one_line_error(proc, 1)


def test_check_says_when_the_schema_is_missing(worker_env: dict[str, str]) -> None:
    # Given a PostgreSQL database without the celery-fence tables
    name = f"fence_check_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(False)
    try:
        proc = fence_cli({**worker_env, "FENCE_T_DB": url}, "check")
        assert_one_line_error(proc, 1, "tables missing", "fence init-db")
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_check_runs_a_fenced_write_and_read_through_psycopg_3_and_leaves_nothing(
    worker_env: dict[str, str], pg_url: str
) -> None:
    url = with_driver(pg_url, "psycopg")
    out = ok(fence_cli({**worker_env, "FENCE_T_DB": url}, "check"))
    assert f"store: ok ({url}: registered, retried, re-registered, commit-checked" in out
    assert "rolled back" in out
    with sa.create_engine(pg_url, poolclass=sa.pool.NullPool).connect() as conn:
        for table in ("fence_jobs", "fence_transitions", "fence_outbox"):
            left = conn.execute(
                sa.text(f"SELECT count(*) FROM {table} WHERE key LIKE :probe"),
                {"probe": f"{PROBE_KEY_PREFIX}%"},
            ).scalar()
            assert left == 0, table


@pytest.fixture
def read_only_pg_url() -> Iterator[str]:
    """A database with the fence tables, as a role that may only read them (password in URL)."""
    name = f"fence_ro_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD 'hush-{name}'")
    owner_url = sa.engine.make_url(PG_ADMIN_URL).set(database=name)
    store = Store(owner_url.render_as_string(False))
    store.create_schema()
    with store.engine.connect() as conn:
        conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {name}")
    store.dispose()
    url = owner_url.set(drivername="postgresql+psycopg", username=name, password=f"hush-{name}")
    yield url.render_as_string(False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f"DROP ROLE IF EXISTS {name}")
    admin.dispose()


def test_check_fails_on_a_fenced_tasks_store_that_its_role_cannot_write(
    worker_env: dict[str, str], read_only_pg_url: str
) -> None:
    # Given an app whose own store is fine and one task whose store the role can only read
    env = {**worker_env, "FENCE_T_DB2": read_only_pg_url}
    proc = subprocess.run(
        [CELERY, "-A", "tests.support.two_stores_app", "fence", "check"],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
    )
    # then check fails on that store: its URL (password hidden), the error and the fix.
    shown = sa.engine.make_url(read_only_pg_url).render_as_string(hide_password=True)
    line = assert_one_line_error(proc, 1, f"store {shown}", "InsufficientPrivilege", "grant")
    assert "hush-" not in proc.stdout + proc.stderr
    assert "registration" in line and "fence_jobs" in line
    assert "database: ok" in proc.stdout  # the schema is there: only the write tells
