"""Retries that end, with real worker processes: backoff, dead, kill loops, the budget.

Assertions are on stored state (the job row and its transition history) and on the ledger of
what the workload really ran (``<prefix>:runs:<key>``).
"""

from __future__ import annotations

import re
import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.store import JobRecord, Store, Transition
from tests.support import ledger
from tests.support.broker import broker_queue_length
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

RETRY_IN = re.compile(r"retry in (\d+\.\d+)s")


def _status(store: Store, key: str) -> str | None:
    record = store.get(key)
    return None if record is None else record.status


def _wait_for(store: Store, key: str, status: str, timeout: float = 90.0) -> JobRecord:
    wait_until(lambda: _status(store, key) == status, timeout, interval=0.1, what=f"{key} {status}")
    record = store.get(key)
    assert record is not None
    return record


def _actions(history: list[Transition], action: str) -> list[Transition]:
    return [t for t in history if t.action == action]


def test_transient_errors_back_off_with_growing_jittered_delays_then_die(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a task that fails transiently every time, max 6 attempts, backoff 0.05 s doubling
    # (ceilings 0.05, 0.1, 0.2, 0.4, 0.8 s), and a budget too large to interfere ...
    spawn_worker(
        "w",
        FENCE_T_MAX_ATTEMPTS="6",
        FENCE_T_BACKOFF="0.05",
        FENCE_T_BACKOFF_MAX="1.6",
        FENCE_T_BUDGET_FLOOR="1000",
    )
    keys = [f"flaky:{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for key in keys:
        client_app.work.delay(key, fail="transient")
    delays: dict[int, list[float]] = {n: [] for n in range(1, 6)}
    for key in keys:
        # ... when it has run out of attempts, it is dead with attempts == max,
        record = _wait_for(fence_store, key, "dead")
        assert record.attempts == 6
        assert record.error_type == "builtins.ConnectionError"
        assert record.error_message == "simulated transient failure"
        assert record.finished_at is not None and record.retry_at is None
        runs = ledger.runs(redis_client, prefix, key)
        assert [int(r.split(":")[0]) for r in runs] == [1, 2, 3, 4, 5, 6]
        history = fence_store.transitions.history(key)
        claims = _actions(history, "claimed")
        retries = _actions(history, "retry_scheduled")
        assert len(claims) == 6 and len(retries) == 5
        assert [t.action for t in history][-1] == "dead"
        # each retry waited at least its countdown, which stayed under that attempt's ceiling.
        for n, (retry, next_claim) in enumerate(zip(retries, claims[1:], strict=True), start=1):
            assert retry.reason is not None
            match = RETRY_IN.search(retry.reason)
            assert match, retry.reason
            countdown = float(match.group(1))
            assert 0.0 <= countdown <= 0.05 * 2 ** (n - 1) + 0.001
            waited = (next_claim.at - retry.at).total_seconds()
            assert waited >= countdown - 0.05, (n, waited, countdown)
            delays[n].append(countdown)
    # Then the delays grow (later ones exceed what the first could ever be) and are jittered.
    assert max(delays[4] + delays[5]) > 0.05
    every = [d for n in delays for d in delays[n]]
    assert len(set(every)) > 1
    assert any(d < 0.9 * 0.05 * 2 ** (n - 1) for n in delays for d in delays[n])
    # And the loop has stopped: nothing of the queue is left in the broker, no run after dead.
    wait_until(lambda: broker_queue_length(client_app) == 0, 15, what="the broker to drain")
    assert all(len(ledger.runs(redis_client, prefix, k)) == 6 for k in keys)


def test_a_permanent_error_is_dead_after_one_attempt(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w", FENCE_T_MAX_ATTEMPTS="5")
    key = f"invalid:{uuid.uuid4().hex[:8]}"
    result = client_app.work.delay(key, fail="permanent")
    record = _wait_for(fence_store, key, "dead", timeout=60)
    assert record.attempts == 1
    assert record.error_type == "celery_fence.errors.PermanentError"
    assert record.error_message == "simulated permanent failure"
    history = fence_store.transitions.history(key)
    assert [t.action for t in history] == ["claimed", "dead"]
    assert history[-1].reason == "permanent error PermanentError"
    assert result.get(timeout=30, propagate=False) is not None and result.state == "FAILURE"
    # the message was acked (nothing left in the broker): nothing runs it again
    wait_until(lambda: broker_queue_length(client_app) == 0, 15, what="the broker to drain")
    assert len(ledger.runs(redis_client, prefix, key)) == 1


def test_a_delivery_of_a_dead_job_fails_with_a_requeue_hint_naming_the_worker_app(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a dead job, on a worker started as `celery -A tests.support.app worker` ...
    spawn_worker("w")
    key = f"dead-hint:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key, fail="permanent")
    _wait_for(fence_store, key, "dead", timeout=60)
    # ... when another message of its key is delivered,
    again = client_app.work.delay(key)
    # then it fails with JobDead, whose hint is the command the operator can run as it is.
    with pytest.raises(Exception) as failed:
        again.get(timeout=30)
    assert type(failed.value).__name__ == "JobDead"
    assert f"requeue it with: celery -A tests.support.app fence requeue {key}" in str(failed.value)
    assert len(ledger.runs(redis_client, prefix, key)) == 1


def test_success_after_two_transient_failures_completes_on_the_third_attempt(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w", FENCE_T_MAX_ATTEMPTS="5")
    key = f"flaky-then-ok:{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}:fail_times:{key}", 2)
    result = client_app.work.delay(key, fail="transient")
    value = result.get(timeout=60)
    record = _wait_for(fence_store, key, "completed")
    assert record.attempts == 3
    assert (record.error_type, record.error_message) == (None, None)
    assert record.result == value and value["generation"] == 3
    assert len(ledger.runs(redis_client, prefix, key)) == 3
    actions = [t.action for t in fence_store.transitions.history(key)]
    assert actions.count("retry_scheduled") == 2 and actions[-1] == "completed"


def test_a_task_that_kills_its_worker_every_time_ends_dead(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a message that SIGKILLs its worker process on every execution (OOM, segfault) ...
    worker = spawn_worker("w", FENCE_T_MAX_ATTEMPTS="2")
    key = f"poison:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key, fail="kill")
    # ... the redeliveries count as attempts: after 2 executions the next claim finds the
    # attempts spent and moves the job to dead instead of running it a third time.
    record = _wait_for(fence_store, key, "dead", timeout=120)
    runs = ledger.runs(redis_client, prefix, key)
    assert [int(r.split(":")[0]) for r in runs] == [1, 2]
    assert record.attempts == 2  # attempts means executions: the claim that stopped ran nothing
    assert record.error_type == "celery_fence.errors.JobDead"
    history = fence_store.transitions.history(key)
    assert [t.action for t in history].count("claimed") == 3
    assert history[-1].action == "dead" and history[-1].reason == "attempts exhausted"
    # The loop has stopped: the message was acked (nothing of the queue is left in the broker,
    # ready or delivered: no delivery is left to run or claim the key again).
    wait_until(lambda: broker_queue_length(client_app) == 0, 15, what="the broker to drain")
    assert len(ledger.runs(redis_client, prefix, key)) == 2
    assert len(fence_store.transitions.history(key)) == len(history)
    assert worker.proc is not None and worker.proc.poll() is None  # the worker itself lives on


def test_a_burst_of_failures_schedules_no_more_prompt_retries_than_the_budget(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a budget of 2 retries per (long) window and no traffic share, shared by the two
    # processes of a worker (per-process budgets would allow 4) ...
    spawn_worker(
        "w",
        concurrency=2,
        FENCE_T_MAX_ATTEMPTS="3",
        FENCE_T_BACKOFF="0.05",
        FENCE_T_BACKOFF_MAX="1.0",
        FENCE_T_BUDGET_FLOOR="2",
        FENCE_T_BUDGET_RATIO="0",
        FENCE_T_BUDGET_WINDOW="600",
    )
    # ... when a burst of 8 jobs each fails once,
    keys = [f"burst:{i}:{uuid.uuid4().hex[:6]}" for i in range(8)]
    for key in keys:
        redis_client.set(f"{prefix}:fail_times:{key}", 1)
    results = [client_app.work.delay(key, fail="transient") for key in keys]
    for result in results:
        result.get(timeout=90)
    # then every job still completes (spent budget delays, never drops) ...
    retries: list[Transition] = []
    for key in keys:
        record = _wait_for(fence_store, key, "completed")
        assert record.attempts == 2
        retries.extend(_actions(fence_store.transitions.history(key), "retry_scheduled"))
    assert len(retries) == 8
    # ... but only 2 retries were scheduled promptly; the other 6 were pushed out by the budget.
    prompt = [t for t in retries if "budget spent" not in (t.reason or "")]
    delayed = [t for t in retries if "budget spent" in (t.reason or "")]
    assert (len(prompt), len(delayed)) == (2, 6)
    for t in delayed:
        assert t.reason is not None
        match = RETRY_IN.search(t.reason)
        assert match and 1.0 <= float(match.group(1)) <= 1.05 + 0.001
