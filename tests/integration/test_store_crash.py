"""A registration's commit does not wait for its WAL flush (PostgreSQL); a completion's and a
fenced block's do, and flush every earlier commit with them. Checked against a cluster of the
test's own, crashed with ``pg_ctl stop -m immediate`` (its WAL writer asleep for 10 s, so what
only an asynchronous commit wrote is still in the WAL buffers when the crash comes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from celery_fence.errors import StaleGeneration
from celery_fence.store import Store
from celery_fence.store.records import Completion
from celery_fence.testing.postgres_server import PostgresCluster

DRIVERS = ("psycopg2", "psycopg")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresCluster]:
    pg = PostgresCluster().start()
    try:
        schema = Store(pg.url())
        schema.create_schema()
        schema.dispose()
        yield pg
    finally:
        pg.remove()


def crash_and_restart(pg: PostgresCluster, *stores: Store) -> None:
    for store in stores:
        store.dispose()  # its connections die with the server
    pg.crash()
    pg.start()


def register(store: Store, key: str, generation: int = 1, attempt: str = "a1") -> None:
    outcome = store.register(
        key, generation=generation, attempt_id=attempt, task_name="t", request={}
    ).outcome
    assert outcome == "registered"


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_registration_alone_is_lost_in_a_crash_a_completion_is_not(
    cluster: PostgresCluster, driver: str
) -> None:
    store = Store(cluster.url(driver))
    flushed, completed, alone = (f"{name}-{driver}" for name in ("flushed", "completed", "alone"))
    register(store, flushed)  # before the completion's commit: flushed with it
    register(store, completed, attempt="c1")
    store.end(completed, Completion(1, "c1", {"ok": True}, ()))
    register(store, alone)  # nothing commits after it: only in the WAL buffers
    assert store.get(alone) is not None  # visible at once, as any commit
    crash_and_restart(cluster, store)
    row = store.get(completed)
    assert row is not None and row.status == "completed" and row.result == {"ok": True}
    row = store.get(flushed)
    assert row is not None and (row.status, row.generation) == ("running", 1)
    assert store.get(alone) is None  # the asynchronous registration was lost
    # the attempt whose registration was lost cannot complete: its completion matches no row
    with pytest.raises(StaleGeneration):
        store.end(alone, Completion(1, "a1", {"ok": True}, ()))
    assert store.get(alone) is None
    register(store, alone, generation=2, attempt="a2")  # the re-sent message's new claim
    store.end(alone, Completion(2, "a2", {"ok": 2}, ()))
    row = store.get(alone)
    assert row is not None and (row.status, row.generation, row.attempts) == ("completed", 2, 1)
    store.dispose()


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_block_that_commits_makes_its_registration_durable(
    cluster: PostgresCluster, driver: str
) -> None:
    """A fenced block's ownership check reads the registration; its commit (synchronous) comes
    later in the WAL, so it flushes the registration: a crash after the block keeps both."""
    store = Store(cluster.url(driver))
    key = f"block-{driver}"
    app = sa.create_engine(cluster.url(driver))
    rows = sa.table("crash_app_rows", sa.column("key"))
    with app.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS crash_app_rows (key text)")
    register(store, key)
    with app.begin() as conn:
        conn.execute(rows.insert().values(key=key))
        assert store.blocks.commit_check(conn, key, generation=1, attempt_id="a1")
    app.dispose()
    crash_and_restart(cluster, store)
    row = store.get(key)
    assert row is not None and (row.status, row.generation, row.attempt_id) == ("running", 1, "a1")
    app = sa.create_engine(cluster.url(driver))
    with app.connect() as conn:
        count = conn.execute(
            sa.select(sa.func.count()).select_from(rows).where(rows.c.key == key)
        ).scalar()
    assert count == 1
    # and a block whose registration was lost checks nothing into the table: it is refused
    lost = f"block-lost-{driver}"
    register(store, lost)
    app.dispose()
    crash_and_restart(cluster, store)
    app = sa.create_engine(cluster.url(driver))
    with app.begin() as conn:
        conn.execute(rows.insert().values(key=lost))
        assert not store.blocks.commit_check(conn, lost, generation=1, attempt_id="a1")
        conn.rollback()  # what the block does when the check fails
    with app.connect() as conn:
        count = conn.execute(
            sa.select(sa.func.count()).select_from(rows).where(rows.c.key == lost)
        ).scalar()
    assert count == 0
    app.dispose()
    store.dispose()


@pytest.mark.parametrize("driver", DRIVERS)
def test_an_ending_is_durable_where_synchronous_commit_was_turned_off(
    cluster: PostgresCluster, driver: str
) -> None:
    """A database whose ``synchronous_commit`` an operator turned off (a common speed-up): the
    store's endings still wait for their flush, so a completion the worker acks survives."""
    name = f"async_default_{driver}"
    admin = sa.create_engine(cluster.url(), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
        conn.exec_driver_sql(f"ALTER DATABASE {name} SET synchronous_commit = off")
    admin.dispose()
    store = Store(cluster.url(driver, database=name))
    store.create_schema()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
    key = f"ended-{driver}"
    register(store, key)
    store.end(key, Completion(1, "a1", {"ok": True}, ()))
    crash_and_restart(cluster, store)
    row = store.get(key)
    assert row is not None and (row.status, row.result) == ("completed", {"ok": True})
    store.dispose()
