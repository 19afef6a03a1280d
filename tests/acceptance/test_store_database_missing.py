"""A store whose PostgreSQL database does not exist, or goes away while workers run.

At start: the worker refuses to start with one line naming the database and the fix (create it),
and ``fence init-db`` names ``createdb``, not itself. Later (the database dropped under running
workers): each claim's re-send backs off exponentially, bounded by ``fence_retry_backoff_max``,
and the message is never dropped: once the database is back the job completes, once.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest
import redis
import sqlalchemy as sa

from celery_fence.store import Store
from tests.integration.test_cli import assert_one_line_error, fence_cli
from tests.support import ledger
from tests.support.broker import broker_queue_length
from tests.support.env import PG_ADMIN_URL
from tests.support.stores import with_driver
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # worker_env's


def _admin(statement: str) -> None:
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(statement)
    finally:
        admin.dispose()


@pytest.fixture
def own_database() -> Iterator[tuple[str, str]]:
    """A database name of this test's own (not created) and its psycopg2 URL; dropped after."""
    name = f"celery_fence_gone_{uuid.uuid4().hex[:10]}"
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    yield name, url
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_worker_whose_store_database_does_not_exist_refuses_to_start(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    own_database: tuple[str, str],
    driver: str,
) -> None:
    name, url = own_database
    key = f"nodb:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key)
    # Given a store URL whose database was never created, the worker exits at start (bounded
    # by the harness's ready timeout) with one line naming the database and the fix,
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited at start") as refused:
        spawn_worker("nodb", FENCE_T_DB=with_driver(url, driver))
    assert time.monotonic() - started < 60
    lines = [line for line in str(refused.value).splitlines() if "celery-fence:" in line]
    assert lines, str(refused.value)
    assert f'the store database "{name}" does not exist' in lines[-1]
    assert f"createdb {name}" in lines[-1] and "the worker does not start" in lines[-1]
    # and it consumed nothing: the message waits for a worker that can store its job.
    assert broker_queue_length(client_app) == 1


def test_init_db_on_a_missing_database_names_createdb(
    worker_env: dict[str, str], own_database: tuple[str, str]
) -> None:
    name, url = own_database
    for driver in ("psycopg2", "psycopg"):
        env = {**worker_env, "FENCE_T_DB": with_driver(url, driver)}
        for args in (("init-db",), ("check",), ("ls",)):
            line = assert_one_line_error(fence_cli(env, *args), 1, f"createdb {name}")
            assert "tables are missing" not in line, line


def _resend_countdowns(log: str, task: str) -> list[float]:
    return [
        float(m.group(1))
        for m in re.finditer(rf"fence re-send task={re.escape(task)} id=\S+ in ([0-9.]+)s", log)
    ]


def test_a_store_that_goes_away_is_waited_out_with_growing_backoff(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    own_database: tuple[str, str],
) -> None:
    name, url = own_database
    _admin(f'CREATE DATABASE "{name}"')
    Store(url).create_schema()
    # Given a worker that started on a store that exists (backoff 0.2 s, capped at 1.6 s),
    worker = spawn_worker("gone", FENCE_T_DB=url, FENCE_T_BACKOFF="0.2", FENCE_T_BACKOFF_MAX="1.6")
    # when the database goes away and a job comes in,
    _admin(f'DROP DATABASE "{name}" WITH (FORCE)')
    key = f"gone:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key)
    task = client_app.work.name
    wait_until(lambda: len(_resend_countdowns(worker.log(), task)) >= 6, 60, what="6 re-sends")
    # then each re-send waits longer than the one before, up to the cap (exponential, bounded),
    # each between half and all of its ceiling, 0.2 s x 2^n capped at 1.6 s (logged to 0.01 s)
    countdowns = _resend_countdowns(worker.log(), task)[:6]
    for n, countdown in enumerate(countdowns):
        top = min(1.6, 0.2 * 2**n)
        assert top / 2 - 0.01 <= countdown <= top + 0.01, (n, countdowns)
    assert countdowns[3] > countdowns[0] * 3, countdowns
    assert ledger.run_count(redis_client, prefix, key) == 0  # the body never ran unregistered
    # and the message is never dropped: once the database is back, the job completes, once.
    _admin(f'CREATE DATABASE "{name}"')
    store = Store(url)
    store.create_schema()
    try:
        wait_until(
            lambda: getattr(store.get(key), "status", None) == "completed",
            60,
            what="completed once the store is back",
        )
    finally:
        store.dispose()
    assert ledger.run_count(redis_client, prefix, key) == 1
