"""Unique jobs with real workers: the holder of a unique job dies (SIGKILL of the whole worker,
or a hard time limit that kills its pool process), and the job of that uniqueness key runs again
within one lease TTL — recovery (the beat task's ``recover``) or the message given back takes
it over — then ends and releases the key: nothing waits for a lock to expire.

The control arm is celery-once's own ``QueueOnce`` (a Redis lock with a TTL, the pattern of
celery-once #147 / #110 and celery-singleton #40 / #29): the same death leaves its lock behind,
and every later send of the key is silently discarded (``graceful``: an ``EagerResult`` in state
``REJECTED``) until the lock's TTL runs out, while nothing runs. (A hard time limit does not
strand celery-once's lock: the worker reports the killed task's failure and its ``after_return``
clears it; that exit has no control arm here.)
"""

from __future__ import annotations

import time
import uuid
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_fence import recover
from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.testing import faults
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

LEASE_TTL = 2.0  # tests/support/app.py's fence_lease_ttl
ONCE_TTL = 30  # the control arm's lock TTL (celery-once's default is an hour)
TIME_LIMIT = 1.5  # the hard time limit of the time_limit exit


def _die(
    exit: str, spawn_worker: SpawnWorker, task: Any, name: str, rc: redis.Redis, prefix: str
) -> tuple[Any, float]:
    """A worker starts the body of ``name`` (it hangs) and dies by ``exit``: the return is
    ``(the first send's result, the moment of the death)``."""
    faults.arm(rc, prefix, "hang", name)
    worker = spawn_worker("holder")
    first = task.apply_async((name,), time_limit=TIME_LIMIT if exit == "time_limit" else None)
    wait_until(lambda: ledger.run_count(rc, prefix, name) == 1, 30, what="the body started")
    if exit == "sigkill":
        worker.kill()
    else:  # the hard time limit kills the pool process 1.5 s in; the worker lives on
        time.sleep(TIME_LIMIT)
    return first, time.monotonic()


def _recover_until(app: Any, done: Any, timeout: float) -> None:
    """What the ``celery_fence.recover`` beat task (and a worker's own check) does, at its
    default thresholds, every half second, until ``done()``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and not done():
        recover(app)
        time.sleep(0.5)


@pytest.mark.parametrize("exit", ["sigkill", "time_limit"])
def test_a_dead_holder_of_a_unique_job_is_taken_over_within_one_lease_ttl(
    exit: str,
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    task = client_app.unique_work
    name = uuid.uuid4().hex[:10]
    # Given the holder of unique job `name`, dead (SIGKILL, or its pool process killed by a
    # hard time limit) while the body runs,
    first, died = _die(exit, spawn_worker, task, name, redis_client, prefix)
    if exit == "sigkill":
        spawn_worker("rescuer")
    # when the key is sent again: it returns the same job, unfinished (nothing is discarded:
    # that job is about to run again) ...
    again = task.delay(name)
    assert again.id == first.id
    # ... then the job runs again within one lease TTL (plus the recovery's and a worker's
    # pickup), far inside any lock TTL, and completes once.
    _recover_until(client_app.app, lambda: ledger.run_count(redis_client, prefix, name) >= 2, 20)
    took = time.monotonic() - died
    assert ledger.run_count(redis_client, prefix, name) == 2, "the job never ran again"
    assert took < LEASE_TTL + 10.0 < ONCE_TTL, f"taken over after {took:.1f}s"
    wait_until(
        lambda: getattr(fence_store.get(first.id), "status", None) == "completed",
        30,
        what="the job completed",
    )
    record = fence_store.get(first.id)
    assert record is not None and record.generation == 2
    assert ledger.effects(redis_client, prefix, name) == [f"{first.id}:2"]
    # and its end released the key: the next send is a new job, and runs.
    later = task.delay(name)
    assert later.id != first.id
    wait_until(lambda: ledger.run_count(redis_client, prefix, name) == 3, 30, what="a new run")


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_send_that_meets_a_killed_holder_whose_lease_is_gone_takes_the_job_over_at_once(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    task = client_app.unique_work
    name = uuid.uuid4().hex[:10]
    # Given the holder of unique job `name` SIGKILLed with its worker while the body runs (its
    # message unacked: the Redis broker gives it back after an hour), no recovery check running
    # (the test app's fence_recover_interval is 0), and its lease run out,
    first, _ = _die("sigkill", spawn_worker, task, name, redis_client, prefix)
    spawn_worker("rescuer")
    wait_until(lambda: leases.remaining(first.id)[0] is None, LEASE_TTL + 5, what="lease gone")
    assert getattr(fence_store.get(first.id), "status", None) == "running"
    # when the key is sent again,
    sent = time.monotonic()
    again = task.delay(name)
    # then that send took the job over before it returned: the same job, re-sent under its key
    # (a compare-and-set to pending, as recovery's), and it runs again at once and completes.
    assert again.id == first.id
    record = fence_store.get(first.id)
    assert record is not None and record.status in ("pending", "running", "completed")
    assert any(
        t.action == "recovered" and "met by a unique send" in (t.reason or "")
        for t in fence_store.transitions.history(first.id)
    )
    wait_until(lambda: ledger.run_count(redis_client, prefix, name) >= 2, 10, what="re-run")
    print(f"\nunique send takeover: ran again {time.monotonic() - sent:.2f}s after the send")
    wait_until(
        lambda: getattr(fence_store.get(first.id), "status", None) == "completed",
        30,
        what="the job completed",
    )
    done = fence_store.get(first.id)
    assert done is not None and done.generation == 2
    assert ledger.run_count(redis_client, prefix, name) == 2
    assert ledger.effects(redis_client, prefix, name) == [f"{first.id}:2"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # celery-once keeps no job row
def test_control_celery_once_discards_every_send_for_the_locks_ttl(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    task = client_app.once_control
    name = uuid.uuid4().hex[:10]
    lock = f"qo_{task.name}_name-{name}"
    try:
        # Given the same death of the holder, under celery-once's Redis TTL lock,
        _die("sigkill", spawn_worker, task, name, redis_client, prefix)
        spawn_worker("rescuer")
        # when the key is sent again, and again while the fenced arm's job has long run again,
        rejected = [task.delay(name).state]
        _recover_until(client_app.app, lambda: False, LEASE_TTL + 4.0)
        rejected.append(task.delay(name).state)
        # then every send was silently discarded (graceful), nothing ran again, and the
        # stranded lock holds the key for the rest of its TTL.
        assert rejected == ["REJECTED", "REJECTED"]
        assert ledger.run_count(redis_client, prefix, name) == 1
        remaining = redis_client.ttl(lock)
        assert ONCE_TTL - 12 < remaining <= ONCE_TTL, remaining
    finally:
        redis_client.delete(lock)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_replaced_jobs_message_is_acked_unrun(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    db_url: str,
) -> None:
    import sqlalchemy as sa

    from celery_fence import enqueue

    task, name = client_app.unique_work, uuid.uuid4().hex[:10]
    engine = sa.create_engine(db_url)
    # Given a pending unique job replaced by a newer one before any worker ran (both messages
    # queued),
    with engine.begin() as conn:
        old = enqueue(conn, task, args=(name,))
    with engine.begin() as conn:
        new = enqueue(conn, task, args=(name,), on_conflict="replace")
    engine.dispose()
    # when a worker takes both messages,
    spawn_worker("w")
    wait_until(
        lambda: getattr(fence_store.get(new.key), "status", None) == "completed",
        30,
        what="the new job completed",
    )
    # then only the new job ran; the old one stays dead (replaced), its message acked unrun.
    assert ledger.runs(redis_client, prefix, name) == [f"{new.task_id}:1"]
    replaced = fence_store.get(old.key)
    assert replaced is not None and (replaced.status, replaced.generation) == ("dead", 0)
    assert "claimed" not in [t.action for t in fence_store.transitions.history(old.key)]
