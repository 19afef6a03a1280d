"""Real workers on a store reached through psycopg 3 (``postgresql+psycopg://``): a task's
registration, retry and completion go through, and a paused attempt's completion is refused by
the store once a newer attempt took the key over."""

from __future__ import annotations

import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.parametrize("db_url", ["psycopg3"], indirect=True),
]


def test_on_psycopg_3_tasks_complete_retry_and_a_paused_attempt_is_refused(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    leases: LeaseStore,
    prefix: str,
    db_url: str,
) -> None:
    assert db_url.startswith("postgresql+psycopg://")
    store = Store(db_url)
    key, flaky = f"report:{uuid.uuid4().hex[:8]}", f"flaky:{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}:fail_times:{flaky}", 1)
    # Given worker A running a job (generation 1) that never checks its fence ...
    a = spawn_worker("a")
    first = client_app.work.delay(key, sleep=4.0, check=False)
    wait_until(
        lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 20, what="A starts the body"
    )
    # ... when A pauses until its lease is gone and worker B takes a second message for the key,
    a.pause()
    wait_until(lambda: leases.remaining(key)[0] is None, 10, what="A's lease expires")
    spawn_worker("b")
    second = client_app.work.delay(key)
    assert second.get(timeout=30)["generation"] == 2
    # (and B runs a job that fails once and is retried)
    assert client_app.work.delay(flaky, fail="transient").get(timeout=30)["key"] == flaky
    # then A resumes, its completion is refused by the store, and both callers get B's result.
    a.resume()
    assert first.get(timeout=30) == second.get(timeout=1)
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation, record.result["generation"]) == ("completed", 2, 2)
    history = [(t.action, t.generation) for t in store.transitions.history(key)]
    assert ("stale", 1) in history and ("completed", 2) in history
    assert ("completed", 1) not in history
    retried = store.get(flaky)
    assert retried is not None and (retried.status, retried.attempts) == ("completed", 2)
    assert [t.action for t in store.transitions.history(flaky)] == [
        "claimed",
        "retry_scheduled",
        "claimed",
        "completed",
    ]
    store.dispose()
