"""Unique jobs against the real stores (PostgreSQL, SQLite) and the Redis broker, without
workers: each ``on_conflict`` policy, the unique states and period, a rolled-back transaction
that leaves no lock behind, the job's own end releasing its key, and the publish-side check of a
unique task's ``delay()``. The messages are counted in the broker's queue.

(The worker side — a SIGKILLed holder, a hard time limit — is
``tests/acceptance/test_unique_jobs.py``.)
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from celery_fence import AlreadyEnqueued, ConfigurationError, enqueue
from celery_fence.adapters.unique import default_unique_key
from celery_fence.store import Store
from celery_fence.store.records import TAKEOVER_HEADER, Completion
from tests.support.env import BROKER_URL


def _queued(queue: str) -> int:
    return int(redis.Redis.from_url(BROKER_URL).llen(queue))


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db_url)
    yield engine
    engine.dispose()


def _name() -> str:
    return uuid.uuid4().hex[:10]


def _claim(store: Store, key: str, task: Any) -> None:
    """What a worker's claim does: a live lease in Redis (30 s), then its generation registered
    in the row, ``running``."""
    generation = task.fence_backends().leases.claim(key, uuid.uuid4().hex, 30_000)
    outcome = store.register(key, generation=generation, attempt_id="a1", task_name=task.name)
    assert outcome.outcome == "registered"


def test_return_gives_the_unfinished_job_and_sends_nothing(
    client_app: ModuleType, store: Store, engine: sa.Engine, worker_env: dict[str, str]
) -> None:
    queue, name, task = worker_env["FENCE_T_QUEUE"], _name(), client_app.unique_work
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(name,))
    with engine.begin() as conn:
        second = enqueue(conn, task, args=(name,))
    assert first.created and not second.created
    assert (second.key, second.task_id, second.status) == (first.key, first.task_id, "pending")
    assert _queued(queue) == 1
    record = store.get(first.key)
    assert record is not None and record.unique_key == f"unique:{name}"

    # while it runs too (a worker's claim), and a different name is its own job
    _claim(store, first.key, task)
    with engine.begin() as conn:
        third = enqueue(conn, task, args=(name,))
        other = enqueue(conn, task, args=(_name(),))
    assert (third.created, third.key, third.status) == (False, first.key, "running")
    assert other.created and _queued(queue) == 2


def test_the_jobs_own_end_releases_its_key(
    client_app: ModuleType, store: Store, engine: sa.Engine
) -> None:
    name, task = _name(), client_app.unique_work
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(name,))
    _claim(store, first.key, task)
    assert store.end(first.key, Completion(generation=1, attempt_id="a1", result={}))
    with engine.begin() as conn:
        again = enqueue(conn, task, args=(name,))
    assert again.created and again.key != first.key
    finished = store.get(first.key)
    assert finished is not None and finished.status == "completed"  # its result is kept


def test_raise_names_the_holder(client_app: ModuleType, store: Store, engine: sa.Engine) -> None:
    name, task = _name(), client_app.unique_work
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(name,))
    with pytest.raises(AlreadyEnqueued) as caught, engine.begin() as conn:
        enqueue(conn, task, args=(name,), on_conflict="raise")
    error = caught.value
    assert (error.key, error.status, error.task_id) == (first.key, "pending", first.task_id)
    assert error.unique_key == f"unique:{name}"
    assert "already pending" in str(error)


def test_replace_ends_an_unclaimed_job_and_refuses_a_started_one(
    client_app: ModuleType, store: Store, engine: sa.Engine, worker_env: dict[str, str]
) -> None:
    queue, name, task = worker_env["FENCE_T_QUEUE"], _name(), client_app.unique_work
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(name,))
    with engine.begin() as conn:
        second = enqueue(conn, task, args=(name,), on_conflict="replace")
    assert second.created and second.key != first.key
    old = store.get(first.key)
    assert old is not None and (old.status, old.error_type, old.unique_key) == (
        "dead",
        "Replaced",
        None,
    )
    assert [t.reason for t in store.transitions.history(first.key)][-1] == "replaced"
    assert _queued(queue) == 2  # the old message finds its job dead and is acked unrun

    _claim(store, second.key, task)
    with pytest.raises(AlreadyEnqueued, match="cannot be replaced"), engine.begin() as conn:
        enqueue(conn, task, args=(name,), on_conflict="replace")
    running = store.get(second.key)
    assert running is not None and running.status == "running"


def test_unique_states_while_queued_only(
    client_app: ModuleType, store: Store, engine: sa.Engine
) -> None:
    name, task = _name(), client_app.unique_while_queued
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(name,))
        assert not enqueue(conn, task, args=(name,)).created  # pending: held
    _claim(store, first.key, task)
    with engine.begin() as conn:
        second = enqueue(conn, task, args=(name,))  # started: its key is given up
    assert second.created and second.key != first.key
    started = store.get(first.key)
    assert started is not None and started.status == "running" and started.unique_key is None


def test_unique_period_bounds_the_hold(client_app: ModuleType, engine: sa.Engine) -> None:
    name, task = _name(), client_app.unique_brief
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(name,))
    with engine.begin() as conn:
        assert not enqueue(conn, task, args=(name,)).created
    time.sleep(0.6)
    with engine.begin() as conn:
        later = enqueue(conn, task, args=(name,))
    assert later.created and later.key != first.key


def test_a_rolled_back_transaction_leaves_no_lock(
    client_app: ModuleType, store: Store, engine: sa.Engine, worker_env: dict[str, str]
) -> None:
    queue, name, task = worker_env["FENCE_T_QUEUE"], _name(), client_app.unique_work
    with pytest.raises(RuntimeError), engine.begin() as conn:
        dropped = enqueue(conn, task, args=(name,))
        raise RuntimeError("the caller's transaction fails")
    assert store.get(dropped.key) is None and _queued(queue) == 0
    with engine.begin() as conn:
        kept = enqueue(conn, task, args=(name,))
    assert kept.created and _queued(queue) == 1


def test_unique_per_call_on_a_task_that_declares_none(
    client_app: ModuleType, engine: sa.Engine
) -> None:
    task = client_app.work  # fence_key=key: each key its own job
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(_name(),), unique="report:daily")
        second = enqueue(conn, task, args=(_name(),), unique="report:daily")
        plain = enqueue(conn, task, args=(_name(),))
    assert first.created and not second.created and second.key == first.key
    assert plain.created
    with pytest.raises(ConfigurationError, match="without a uniqueness key"), engine.begin() as c:
        enqueue(c, task, args=(_name(),), on_conflict="raise")
    with pytest.raises(ConfigurationError, match="return, replace, raise"), engine.begin() as c:
        enqueue(c, task, args=(_name(),), unique=True, on_conflict="skip")


def test_delay_of_a_unique_task_returns_the_unfinished_jobs_result(
    client_app: ModuleType, store: Store, worker_env: dict[str, str]
) -> None:
    queue, name, task = worker_env["FENCE_T_QUEUE"], _name(), client_app.unique_work
    first = task.delay(name)
    second = task.apply_async((name,))
    assert second.id == first.id and _queued(queue) == 1
    record = store.get(first.id)  # no fence_key: the job's key is its task id
    assert record is not None and record.status == "pending"
    assert record.unique_key == f"unique:{name}"
    assert task.delay(_name()).id != first.id and _queued(queue) == 2
    with pytest.raises(AlreadyEnqueued):
        client_app.unique_or_raise.delay(name) and client_app.unique_or_raise.delay(name)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_concurrent_send_waits_for_the_first_transaction(
    client_app: ModuleType, engine: sa.Engine
) -> None:
    """PostgreSQL: the second transaction's insert waits on the first's uncommitted row, then
    finds it (committed) or takes the key (rolled back): never two holders."""
    name, task = _name(), client_app.unique_work
    results: dict[str, Any] = {}
    import threading

    with engine.connect() as conn:
        tx = conn.begin()
        first = enqueue(conn, task, args=(name,))

        def second() -> None:
            with engine.begin() as other:
                results["second"] = enqueue(other, task, args=(name,))

        thread = threading.Thread(target=second)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting on the first transaction's row
        tx.commit()
        thread.join(10)
    assert not results["second"].created and results["second"].key == first.key


# -- the celery-once and celery-singleton shims ---------------------------------------------------


def test_queue_once_raises_already_queued_or_returns_rejected_when_graceful(
    client_app: ModuleType, store: Store, worker_env: dict[str, str]
) -> None:
    from celery_fence.compat import AlreadyQueued

    queue = worker_env["FENCE_T_QUEUE"]
    a = int(uuid.uuid4().int % 10**9)
    first = client_app.once_add.delay(a, 1)
    with pytest.raises(AlreadyQueued) as caught:
        client_app.once_add.delay(a, 2)  # keys=["a"]: b does not count
    assert caught.value.task_id == first.id and caught.value.countdown is None
    assert client_app.once_add.delay(a + 1, 1).id != first.id
    assert client_app.once_add.apply_async((a, 3), once={"graceful": True}).result is None
    assert _queued(queue) == 2
    record = store.get(first.id)
    assert record is not None and record.unique_key == default_unique_key(
        client_app.once_add.name, (), {"a": a}, keys=["a"]
    )
    assert str(a) not in record.unique_key  # the arguments never reach the key

    graceful = client_app.once_graceful
    assert graceful.delay(a).id and graceful.delay(a).state == "REJECTED"
    with pytest.raises(ConfigurationError, match="not lock"):
        client_app.once_add.apply_async((a, 1), once={"lock": True})


def test_singleton_returns_the_existing_async_result_or_raises(
    client_app: ModuleType, store: Store, worker_env: dict[str, str]
) -> None:
    from celery_fence.compat import DuplicateTaskError

    a = int(uuid.uuid4().int % 10**9)
    first = client_app.singleton_add.delay(a, 1)
    assert client_app.singleton_add.delay(a, 2).id == first.id  # unique_on=["a"]
    assert client_app.singleton_add.delay(a=a, b=5).id == first.id  # by name too
    assert client_app.singleton_add.delay(a + 1, 1).id != first.id
    strict = client_app.singleton_strict
    held = strict.delay(a)
    with pytest.raises(DuplicateTaskError) as caught:
        strict.delay(a)
    assert caught.value.task_id == held.id
    strict.release_lock(task_args=[a])  # celery-singleton's manual unlock
    assert strict.delay(a).id != held.id
    released = store.get(held.id)
    assert released is not None and released.unique_key is None


def test_the_shims_take_over_a_running_holder_whose_lease_is_gone(
    client_app: ModuleType, store: Store, worker_env: dict[str, str]
) -> None:
    from celery_fence.compat import AlreadyQueued

    queue, broker = worker_env["FENCE_T_QUEUE"], redis.Redis.from_url(BROKER_URL)
    a = int(uuid.uuid4().int % 10**9)
    # Given a celery-singleton job and a celery-once job whose attempts registered and whose
    # leases are gone (their worker died holding the messages),
    single = client_app.singleton_add.delay(a, 1)
    once = client_app.once_add.delay(a, 1)
    broker.delete(queue)
    for task, first in ((client_app.singleton_add, single), (client_app.once_add, once)):
        registered = store.register(first.id, generation=1, attempt_id="a1", task_name=task.name)
        assert registered.outcome == "registered"
    # when each key is sent again (a duplicate: returned, or AlreadyQueued),
    assert client_app.singleton_add.delay(a, 2).id == single.id
    with pytest.raises(AlreadyQueued) as caught:
        client_app.once_add.delay(a, 2)
    assert caught.value.task_id == once.id
    # then each send re-sent its holder first, under its key and task id.
    for first in (single, once):
        assert getattr(store.get(first.id), "status", None) == "pending"
    sent = sorted(json.loads(raw)["headers"]["id"] for raw in broker.lrange(queue, 0, -1))
    assert sent == sorted([single.id, once.id])


def test_fence_show_names_the_uniqueness_key(
    client_app: ModuleType, engine: sa.Engine, worker_env: dict[str, str]
) -> None:
    import json

    from tests.integration.test_cli import fence_cli, ok

    name = _name()
    with engine.begin() as conn:
        job = enqueue(conn, client_app.unique_work, args=(name,))
    assert f"unique:{name}" in ok(fence_cli(worker_env, "show", job.key))
    shown = json.loads(ok(fence_cli(worker_env, "show", job.key, "--json")))
    assert shown["unique_key"] == f"unique:{name}"


def test_a_running_holder_whose_lease_is_gone_is_taken_over_by_the_next_send(
    client_app: ModuleType, store: Store, engine: sa.Engine, worker_env: dict[str, str]
) -> None:
    # Given a unique job whose attempt registered and whose lease is gone (its worker died
    # holding the message)
    queue, name, task = worker_env["FENCE_T_QUEUE"], _name(), client_app.unique_work
    broker = redis.Redis.from_url(BROKER_URL)
    with engine.begin() as conn:
        first = enqueue(conn, task, args=(name,))
    broker.delete(queue)
    assert store.register(first.key, generation=1, attempt_id="a1", task_name=task.name).outcome
    # When the uniqueness key is sent again (the task's own send)
    result = task.apply_async((name,))
    # Then that send re-sent the holder at once, under its key and task id, and returned it
    assert result.id == first.task_id
    record = store.get(first.key)
    assert record is not None and (record.status, record.generation) == ("pending", 1)
    assert [t.action for t in store.transitions.history(first.key)][-1] == "recovered"
    (message,) = [json.loads(raw) for raw in broker.lrange(queue, 0, -1)]
    headers = message["headers"]
    assert (headers["id"], headers["fence_key"]) == (first.task_id, first.key)
    assert headers[TAKEOVER_HEADER]["generation"] == 1
    # and a send that meets the re-sent (pending) job returns it and sends nothing
    assert task.apply_async((name,)).id == first.task_id and _queued(queue) == 1

    # When its next attempt dies too and enqueue() meets it inside the caller's transaction
    assert store.register(first.key, generation=2, attempt_id="a2", task_name=task.name).outcome
    with engine.begin() as conn:
        again = enqueue(conn, task, args=(name,))
    # Then PostgreSQL takes it over at once; SQLite, whose write lock the caller's transaction
    # holds, leaves it to the workers' recovery check
    taken = store.dialect == "postgresql"
    assert (again.key, again.created) == (first.key, False)
    assert again.status == ("pending" if taken else "running")
    assert _queued(queue) == (2 if taken else 1)
