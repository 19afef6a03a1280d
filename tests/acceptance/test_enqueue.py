"""``enqueue()``: a job written in the caller's transaction, sent after its commit, with real
workers on SQLite and PostgreSQL — commit runs it once, rollback leaves nothing, the same key is
one job, and a job whose message never left (a crash after the commit) or was lost with the
broker's queue is found and sent by recovery."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import ModuleType

import pytest
import redis
import sqlalchemy as sa

from celery_fence import ConfigurationError, enqueue, recover
from celery_fence.store import Store
from tests.support import ledger
from tests.support.env import BROKER_URL
from tests.support.worker import ROOT, SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance


def _queued(queue: str) -> int:
    """Messages waiting in the Redis broker's queue (its list)."""
    return int(redis.Redis.from_url(BROKER_URL).llen(queue))


def _orders(engine: sa.Engine, prefix: str) -> sa.Table:
    table = sa.Table(
        f"orders_{prefix}", sa.MetaData(), sa.Column("id", sa.String(64), primary_key=True)
    )
    table.create(engine)
    return table


def _status(store: Store, key: str) -> str | None:
    record = store.get(key)
    return None if record is None else record.status


def test_commit_sends_once_rollback_sends_nothing_and_a_key_is_one_job(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    engine = sa.create_engine(db_url)
    orders = _orders(engine, prefix)
    queue = worker_env["FENCE_T_QUEUE"]
    committed, rolled_back, in_savepoint = (f"ship:{uuid.uuid4().hex[:8]}" for _ in range(3))

    # Given no worker yet: a rolled-back transaction leaves no row and no message ...
    with pytest.raises(RuntimeError), engine.begin() as conn:
        conn.execute(orders.insert().values(id=rolled_back))
        assert enqueue(conn, client_app.work, args=(rolled_back,)).created
        raise RuntimeError("the request failed")
    assert _status(fence_store, rolled_back) is None and _queued(queue) == 0
    # ... a savepoint is refused, and a commit sends exactly its own job
    with engine.begin() as conn:
        conn.execute(orders.insert().values(id=committed))
        with conn.begin_nested(), pytest.raises(ConfigurationError, match="savepoint"):
            enqueue(conn, client_app.work, args=(in_savepoint,))  # its commit is not the send
        job = enqueue(conn, client_app.work, args=(committed,))
        assert _queued(queue) == 0  # nothing is sent before the commit
    assert _queued(queue) == 1
    assert _status(fence_store, in_savepoint) is None
    record = fence_store.get(committed)
    assert record is not None and (record.status, record.generation) == ("pending", 0)
    assert record.request is not None and record.request["id"] == job.task_id

    # When a worker runs
    spawn_worker("w")
    # Then the committed job runs once and completes under its key and task id
    wait_until(lambda: _status(fence_store, committed) == "completed", 30, what="completed")
    assert ledger.run_count(redis_client, prefix, committed) == 1
    assert job.async_result.get(timeout=10)["generation"] == 1

    # And the same key enqueued again is the same job: nothing written, nothing sent
    with engine.begin() as conn:
        again = enqueue(conn, client_app.work, args=(committed,))
    assert (again.created, again.status, again.task_id) == (False, "completed", job.task_id)
    assert _queued(queue) == 0 and ledger.run_count(redis_client, prefix, committed) == 1


def test_a_crash_after_the_commit_and_a_lost_queue_are_recovered(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    # Given a process killed (SIGKILL) between its commit and its publish ...
    crashed = [f"crash:{uuid.uuid4().hex[:8]}" for _ in range(3)]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.enqueue_and_die", *crashed],
        cwd=ROOT,
        env={**os.environ, **worker_env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    # ... and jobs enqueued and sent whose queue the broker then lost
    engine = sa.create_engine(db_url)
    lost = [f"lost:{uuid.uuid4().hex[:8]}" for _ in range(5)]
    with engine.begin() as conn:
        for key in lost:
            enqueue(conn, client_app.work, args=(key,))
    assert _queued(queue) == len(lost)
    redis.Redis.from_url(BROKER_URL).delete(queue)
    keys = crashed + lost
    assert all(_status(fence_store, k) == "pending" for k in keys)  # the rows are the record
    assert _queued(queue) == 0

    # When a worker runs and recovery passes
    spawn_worker("w", concurrency=2)
    report = recover(client_app.app, older_than=0)
    # Then every job is sent once more and completes once
    assert set(keys) <= set(report.sent)  # (asserted for this test's keys only)
    wait_until(
        lambda: all(_status(fence_store, k) == "completed" for k in keys), 60, what="completed"
    )
    assert [ledger.run_count(redis_client, prefix, k) for k in keys] == [1] * len(keys)


def test_a_connection_on_another_database_or_outside_a_transaction_is_refused(
    client_app: ModuleType, tmp_path: Path
) -> None:
    other = sa.create_engine(f"sqlite:///{tmp_path / 'other.sqlite3'}")
    with other.begin() as conn, pytest.raises(ConfigurationError, match="fence_database_url"):
        enqueue(conn, client_app.work, args=("k",))
    with other.connect() as conn, pytest.raises(ConfigurationError, match=r"engine\.begin"):
        enqueue(conn, client_app.work, args=("k",))


def test_an_orm_session_sends_after_its_commit_and_nothing_after_a_rollback(
    client_app: ModuleType, db_url: str, fence_store: Store, worker_env: dict[str, str]
) -> None:
    from sqlalchemy.orm import scoped_session, sessionmaker

    queue = worker_env["FENCE_T_QUEUE"]
    scoped = scoped_session(sessionmaker(bind=sa.create_engine(db_url)))  # db.session's kind
    kept, dropped = (f"orm:{uuid.uuid4().hex[:8]}" for _ in range(2))
    enqueue(scoped, client_app.work, args=(dropped,))
    scoped.rollback()
    assert _queued(queue) == 0 and _status(fence_store, dropped) is None
    job = enqueue(scoped, client_app.work, args=(kept,), countdown=0)
    assert _queued(queue) == 0
    scoped.commit()
    scoped.remove()
    assert _queued(queue) == 1 and _status(fence_store, kept) == "pending"
    assert job.created and _status(fence_store, dropped) is None


def test_an_enqueued_job_whose_message_expires_unrun_ends_dead_not_recovered(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    db_url: str,
    fence_store: Store,
) -> None:
    # Given a job enqueued with expires, whose message expires before any worker takes it
    key = f"expires:{uuid.uuid4().hex[:8]}"
    with sa.create_engine(db_url).begin() as conn:
        enqueue(conn, client_app.work, args=(key,), expires=0.5)
    time.sleep(1.0)  # past its expiry: expiry is a clock, there is no event to wait on
    # When a worker receives it
    spawn_worker("w")
    # Then Celery does not run it, and the job is dead with reason expired, where you see it
    wait_until(lambda: _status(fence_store, key) == "dead", 30, what="dead")
    record = fence_store.get(key)
    assert record is not None and record.error_message is not None
    assert "expired" in record.error_message
    # and recovery leaves it alone
    assert key not in recover(client_app.app, older_than=0).sent
