"""``celery -A <app> fence check``: task settings, Redis, the database, the schema."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from tests.integration.test_cli import (
    UNREACHABLE_PG,
    UNREACHABLE_REDIS,
    assert_one_line_error,
    fence_cli,
    ok,
)
from tests.support.env import PG_ADMIN_URL

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
