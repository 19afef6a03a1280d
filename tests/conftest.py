"""Fixtures: real Redis, a fresh PostgreSQL database per session, SQLite files, real workers.

Isolation: every test gets its own key prefix, queue and SQLite file; PostgreSQL tests share one
database created for this session (and dropped after it), with keys unique per test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_fence.leases.lease import LeaseStore
from celery_fence.process.runtime import runtime
from celery_fence.store import Store
from celery_fence.testing.broker import delete_queues
from celery_fence.testing.proxy import TcpProxy
from tests.support.env import BROKER_URL, PG_ADMIN_URL, REDIS_URL
from tests.support.schedule import longest_first
from tests.support.stores import DEFAULT, store_url, with_driver
from tests.support.worker import SpawnWorker, Worker, app_worker


def _slow_seconds(item: pytest.Item) -> float | None:
    """``slow(seconds)``, or ``slow(seconds, by_param={id: seconds})`` where a parametrized test's
    cases differ."""
    marker = item.get_closest_marker("slow")
    if marker is None:
        return None
    callspec = getattr(item, "callspec", None)
    by_param = marker.kwargs.get("by_param", {})
    return float(by_param.get(callspec.id if callspec else None, marker.args[0]))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``-n N`` (N > 1), the tests marked ``slow`` start first, spread over the processes
    (:mod:`tests.support.schedule`); a run without xdist keeps the collection order."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        items[:] = longest_first(items, _slow_seconds, workers)


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    client.ping()
    yield client
    client.close()


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    p = f"t{uuid.uuid4().hex[:10]}"
    yield p
    for k in redis_client.scan_iter(f"{p}:*", count=1000):
        redis_client.delete(k)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL database created for this session and dropped after it."""
    name = f"celery_fence_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    Store(url).create_schema()
    yield url
    for store in runtime().stores():
        store.dispose()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def proxy(pg_url: str) -> Iterator[TcpProxy]:
    """A TCP proxy in front of the session's PostgreSQL (outages as a client sees them)."""
    url = sa.engine.make_url(pg_url)
    p = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    p.up()
    yield p
    p.unstall()
    p.down()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'fence.sqlite3'}"


@pytest.fixture(scope="session")
def pg_url_psycopg3(pg_url: str) -> str:
    """The session's PostgreSQL database through psycopg 3 (``postgresql+psycopg://``)."""
    return with_driver(pg_url, "psycopg")


@pytest.fixture(params=DEFAULT)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store URL: SQLite, PostgreSQL through psycopg2, or (where a module asks for
    ``EVERY_DRIVER``, or a test for ``"psycopg3"``) PostgreSQL through psycopg 3."""
    return store_url(request, tmp_path)


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    s.create_schema()
    yield s
    s.dispose()


@pytest.fixture
def fence_store(db_url: str) -> Iterator[Store]:
    """The store of this test's ``db_url``, without creating the schema (the workers' is used)."""
    s = Store(db_url)
    yield s
    s.dispose()


@pytest.fixture
def leases(redis_client: redis.Redis, prefix: str) -> LeaseStore:
    return LeaseStore(redis_client, prefix=prefix)


@pytest.fixture
def worker_env(prefix: str, db_url: str) -> Iterator[dict[str, str]]:
    """Environment for tests/support/app.py workers of this test. Its queue is deleted from the
    Redis broker afterwards, with kombu's binding keys for it (which stopping a worker leaves)."""
    queue = f"{prefix}-q"
    yield {
        "FENCE_T_PREFIX": prefix,
        "FENCE_T_QUEUE": queue,
        "FENCE_T_BROKER": BROKER_URL,
        "FENCE_T_REDIS": REDIS_URL,
        "FENCE_T_DB": db_url,
    }
    broker = Celery(broker=BROKER_URL)
    try:
        delete_queues(broker, [queue])
    finally:
        broker.close()


@pytest.fixture
def spawn_worker(tmp_path: Path, worker_env: dict[str, str]) -> Iterator[SpawnWorker]:
    """``spawn_worker(name, **env_overrides)`` -> a started :class:`Worker`; all stopped after."""
    started: list[Worker] = []

    def spawn(
        name: str = "w1",
        *,
        concurrency: int = 1,
        pool: str = "prefork",
        loglevel: str = "INFO",
        extra_args: tuple[str, ...] = (),
        **env: str,
    ) -> Worker:
        w = app_worker(
            "tests.support.app",
            env={**worker_env, **env},
            queue=worker_env["FENCE_T_QUEUE"],
            name=f"{name}-{uuid.uuid4().hex[:6]}",
            log_dir=tmp_path,
            concurrency=concurrency,
            pool=pool,
            loglevel=loglevel,
            extra_args=extra_args,
        )
        started.append(w)
        w.start()
        return w

    yield spawn
    for w in started:
        w.stop()


@pytest.fixture
def client_app(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The same app module as the workers, imported in the test process (to send and read)."""
    import importlib
    import sys

    for k, v in worker_env.items():
        monkeypatch.setenv(k, v)
    sys.modules.pop("tests.support.app", None)
    module = importlib.import_module("tests.support.app")
    yield module
    module.app.close()
    sys.modules.pop("tests.support.app", None)
