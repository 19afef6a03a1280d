"""Workflows carried on by a re-send, with real workers: a chain whose first step's message was
lost goes on after ``fence recover``; a dead job requeued with ``fence requeue`` still calls its
``link``. The stored request keeps what Celery needs (chain, callbacks, errbacks, chord, group,
root/parent ids, time limits) and the re-send goes out with it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.testing import faults
from tests.acceptance.test_recover_windows import _lease_gone, _lose_unacked, _status
from tests.integration.test_cli import fence_cli, ok
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until


@pytest.fixture
def broker(worker_env: dict[str, str]) -> Iterator[redis.Redis]:
    from tests.support.env import BROKER_URL

    client = redis.Redis.from_url(BROKER_URL)
    yield client
    client.delete(worker_env["FENCE_T_QUEUE"])
    client.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_chain_whose_first_step_message_was_lost_goes_on_after_recover(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
    worker_env: dict[str, str],
) -> None:
    # Given a chain a | b whose first step's worker was killed mid-body and whose message was
    # lost (the queue purged, the unacked message gone) ...
    a, b = f"chain-a:{uuid.uuid4().hex[:8]}", f"chain-b:{uuid.uuid4().hex[:8]}"
    faults.arm(redis_client, prefix, "hang", a)
    doomed = spawn_worker("doomed")
    (client_app.work.s(a) | client_app.follow.s(b)).apply_async()
    wait_until(lambda: ledger.run_count(redis_client, prefix, a) == 1, 30, what="a started")
    doomed.kill()
    broker.delete(worker_env["FENCE_T_QUEUE"])
    assert _lose_unacked(broker, a) == 1
    wait_until(lambda: _lease_gone(leases, a), 10, what="lease expired")
    stored = fence_store.get(a)
    assert stored is not None and stored.request is not None
    assert [s["task"] for s in stored.request["execution"]["chain"]] == [client_app.follow.name]
    # ... when recover re-sends the first step,
    spawn_worker("rescuer")
    assert f"{a}: re-sent" in ok(fence_cli(worker_env, "recover", "--older-than", "1"))
    # then it completes once and the chain goes on: b runs on a's result and is stored.
    wait_until(lambda: _status(fence_store, b) == "completed", 30, what="b completed")
    first, second = fence_store.get(a), fence_store.get(b)
    assert first is not None and second is not None and first.status == "completed"
    assert second.result["after"] == first.attempt_id
    assert [t.action for t in fence_store.transitions.history(a)].count("completed") == 1
    assert ledger.run_count(redis_client, prefix, b) == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_requeue_of_a_dead_job_keeps_its_link_and_time_limits(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    # Given a job with a link callback and time limits that ended dead (its one attempt failed)
    a, b = f"link-a:{uuid.uuid4().hex[:8]}", f"link-b:{uuid.uuid4().hex[:8]}"
    spawn_worker("w", FENCE_T_MAX_ATTEMPTS="1")
    redis_client.set(f"{prefix}:fail_times:{a}", 1)
    client_app.work.apply_async(
        (a,),
        {"fail": "transient"},
        link=client_app.follow.s(b),
        time_limit=60,
        soft_time_limit=50,
    )
    wait_until(lambda: _status(fence_store, a) == "dead", 30, what="a dead")
    assert _status(fence_store, b) is None  # the callback did not run
    record = fence_store.get(a)
    assert record is not None and record.request is not None
    execution = record.request["execution"]
    assert (execution["time_limit"], execution["soft_time_limit"]) == (60, 50)
    # ... when it is requeued (the cause fixed),
    out = ok(fence_cli(worker_env, "requeue", a))
    assert out.startswith(f"requeued {a}:")
    # then it completes and its link runs on its result.
    wait_until(lambda: _status(fence_store, b) == "completed", 30, what="b completed")
    first, second = fence_store.get(a), fence_store.get(b)
    assert first is not None and second is not None and first.status == "completed"
    assert second.result["after"] == first.attempt_id
    history = json.dumps([t.action for t in fence_store.transitions.history(a)])
    assert "requeued" in history
