"""Every exit settles: the exits Celery drives itself, with real workers.

Each scenario asserts on the stored state, the number of body runs (the Redis ledger) and what is
left in the broker for the test's queue once the job has ended.
"""

from __future__ import annotations

import time
import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import JobRecord, Store, decode_request
from celery_fence.testing import faults
from tests.support import ledger
from tests.support.broker import broker_queue_length
from tests.support.env import AMQP_URL, BROKER_URL
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance


@pytest.fixture(params=["redis"])
def broker(request: pytest.FixtureRequest) -> str:
    """The broker of this test's workers: ``redis`` by default; tests of exits whose handling
    differs by transport run on ``amqp`` (RabbitMQ) too."""
    return str(request.param)


@pytest.fixture
def worker_env(worker_env: dict[str, str], broker: str) -> dict[str, str]:
    if broker == "amqp":  # results stay on Redis: Celery has no AMQP result backend any more
        return {**worker_env, "FENCE_T_BROKER": AMQP_URL, "FENCE_T_BACKEND": BROKER_URL}
    return worker_env


BOTH_BROKERS = pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)


def _ended(store: Store, key: str, timeout: float = 60.0) -> JobRecord:
    """Wait (bounded) until the job is completed or dead; return it."""
    found: list[JobRecord] = []

    def ended() -> bool:
        record = store.get(key)
        if record is not None and record.status in ("completed", "dead"):
            found.append(record)
            return True
        return False

    wait_until(ended, timeout, interval=0.1, what=f"job {key} to end")
    return found[0]


def _broker_drained(client_app: ModuleType, timeout: float = 15.0) -> None:
    """The message was acked: nothing of this test's queue is left in the broker."""
    wait_until(lambda: broker_queue_length(client_app) == 0, timeout, what="the broker to drain")


@BOTH_BROKERS
def test_hard_time_limit_gives_the_message_back_and_a_later_attempt_completes(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a prefork worker and a job whose first run overruns its hard time limit
    spawn_worker("w", concurrency=2)
    key = f"tl:{uuid.uuid4().hex[:8]}"
    client_app.overrun.apply_async((key,), {"sleep": 6.0}, time_limit=1.5)
    # When the pool kills the first attempt, the message comes back instead of being acked
    record = _ended(fence_store, key, timeout=60)
    # Then a later attempt completes it: two body runs, one result, nothing left in the broker
    assert record.status == "completed", record
    assert ledger.run_count(redis_client, prefix, key) == 2
    assert record.attempts == 2 and record.result["generation"] == record.generation
    assert "time_limit" in [t.action for t in fence_store.transitions.history(key)]
    _broker_drained(client_app)


def test_hard_time_limit_on_every_attempt_ends_dead_with_reason_time_limit(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a job that overruns its hard time limit on every run, and two attempts allowed
    spawn_worker("w", concurrency=2, FENCE_T_MAX_ATTEMPTS="2")
    key = f"tl:{uuid.uuid4().hex[:8]}"
    client_app.overrun.apply_async((key,), {"sleep": 6.0, "runs_overrunning": 99}, time_limit=1.0)
    # Then it ends dead, reason "time limit", after exactly two executions, its message acked
    record = _ended(fence_store, key, timeout=90)
    assert record.status == "dead", record
    assert ledger.run_count(redis_client, prefix, key) == 2
    assert record.attempts == 2
    assert fence_store.transitions.history(key)[-1].reason == "time limit"
    _broker_drained(client_app)


def test_soft_time_limit_goes_through_the_retry_policy(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w")
    key = f"soft:{uuid.uuid4().hex[:8]}"
    # Given a first run that overruns its soft time limit (SoftTimeLimitExceeded in the body)
    client_app.overrun.apply_async((key,), {"sleep": 5.0}, soft_time_limit=0.8)
    # Then the retry policy re-sends it as a transient error and the second run completes
    record = _ended(fence_store, key)
    assert record.status == "completed", record
    assert ledger.run_count(redis_client, prefix, key) == 2
    assert "retry_scheduled" in [t.action for t in fence_store.transitions.history(key)]
    _broker_drained(client_app)


@BOTH_BROKERS
def test_expires_is_not_carried_onto_a_retry(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w")
    label = f"exp-retry-{uuid.uuid4().hex[:8]}"
    # Given a message with expires=1 whose first run fails transiently after 1.5 s
    result = client_app.default_keyed.apply_async(
        (label,), {"fail_first": True, "sleep": 1.5}, expires=1
    )
    # Then the fence's retry arrives (expires is not copied) and completes the job
    record = _ended(fence_store, result.id)
    assert record.status == "completed", record
    assert record.result == label
    assert ledger.run_count(redis_client, prefix, label) == 2
    _broker_drained(client_app)


def test_expires_is_not_carried_onto_a_busy_reschedule(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    spawn_worker("w")
    key = f"exp-busy:{uuid.uuid4().hex[:8]}"
    # Given a live lease on the key held elsewhere for 1.5 s, and a message with expires=1
    leases.claim(key, "someone-else", 1500)
    client_app.work.apply_async((key,), expires=1)
    # Then the busy reschedule arrives after the holder's lease although expires passed
    record = _ended(fence_store, key)
    assert record.status == "completed", record
    assert ledger.run_count(redis_client, prefix, key) == 1
    _broker_drained(client_app)


@BOTH_BROKERS
def test_a_message_that_expired_before_it_ran_ends_its_job_dead(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    broker: str,
) -> None:
    label = f"expired-{uuid.uuid4().hex[:8]}"
    # Given a message that expires before any worker takes it
    result = client_app.default_keyed.apply_async((label,), expires=0.3)
    time.sleep(0.8)
    spawn_worker("w")
    if broker == "amqp":
        # RabbitMQ drops it itself (Celery sets the AMQP expiration): no worker ever sees it, so
        # there is no job to record; the body never ran and nothing is left in the queue (ready,
        # or held by the worker: a delivered message is recorded before it is acked).
        _broker_drained(client_app)
        assert fence_store.get(result.id) is None
        assert ledger.run_count(redis_client, prefix, label) == 0
        return
    # Then the job is recorded dead, reason "expired", with its request to requeue it by
    record = _ended(fence_store, result.id, timeout=30)
    assert record.status == "dead" and record.attempts == 0
    assert fence_store.transitions.history(result.id)[-1].reason == "expired"
    request = decode_request(record.request)
    assert request is not None and request["args"] == [label]
    assert ledger.run_count(redis_client, prefix, label) == 0
    _broker_drained(client_app)


@pytest.mark.parametrize(
    ("pool", "broker"),
    [("prefork", "redis"), ("solo", "redis"), ("prefork", "amqp")],
    indirect=["broker"],
)
def test_a_misconfigured_worker_refuses_to_start_and_consumes_nothing(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    pool: str,
) -> None:
    # Given three jobs waiting in the queue
    keys = [f"cfg:{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for key in keys:
        client_app.work.delay(key)
    # When a worker starts with a renew interval that leaves no room before the local deadline
    # (TTL 2 s, margin 10 %: the interval must be below 1.8 s)
    with pytest.raises(RuntimeError, match="exited at start") as refused:
        spawn_worker("bad", pool=pool, FENCE_T_TTL="2.0", FENCE_T_RENEW="1.9")
    # Then it says which setting and what to do, and took nothing
    assert "fence_renew_interval=1.9" in str(refused.value)
    assert "fence_lease_ttl x (1 - fence_lease_margin)" in str(refused.value)
    assert broker_queue_length(client_app) == 3
    assert all(fence_store.get(key) is None for key in keys)
    # And a correctly configured worker started afterwards completes every job
    spawn_worker("good", pool=pool)
    for key in keys:
        assert _ended(fence_store, key).status == "completed"
        assert ledger.run_count(redis_client, prefix, key) == 1
    _broker_drained(client_app)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite stores NUL
def test_arguments_the_database_refuses_end_dead_at_once_and_stay_requeueable(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    assert fence_store.url.startswith("postgresql")
    spawn_worker("w")
    key = f"nul-args:{uuid.uuid4().hex[:8]}"
    # Given a call whose arguments hold a NUL character (valid JSON; jsonb refuses it)
    client_app.echo.delay(key, "before\x00after")
    # Then one claim, and the job is dead at once with an error naming the cause and the fix
    record = _ended(fence_store, key, timeout=30)
    assert record.status == "dead" and record.attempts == 1
    assert record.error_message is not None and "\\u0000" in record.error_message
    # ... the request is kept in a form the database accepts, and decodes to what was sent
    request = decode_request(record.request)
    assert request is not None and request["args"] == [key, "before\x00after"]
    # ... and there is no loop: nothing of the queue left in the broker (ready or delivered: no
    # delivery is left to claim again), and one claim was made
    _broker_drained(client_app)
    assert leases.client.get(leases.keys_for(key).generation) == b"1"


@pytest.mark.parametrize(
    ("kind", "status", "runs"),
    [
        ("ignore", "dead", 1),
        ("reject", "dead", 1),
        ("requeue", "completed", 2),
        ("retry", "completed", 2),
    ],
)
def test_celery_control_flow_from_a_body_leaves_no_running_row(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    kind: str,
    status: str,
    runs: int,
) -> None:
    spawn_worker("w", pool="solo" if kind in ("ignore", "retry") else "prefork")
    key = f"ctl-{kind}:{uuid.uuid4().hex[:8]}"
    # Given a body that raises Ignore / Reject / Reject(requeue) / self.retry() on its first run
    client_app.control.delay(key, kind=kind)
    # Then the job ends in a defined state, never left running
    record = _ended(fence_store, key, timeout=30)
    assert record.status == status, record
    assert ledger.run_count(redis_client, prefix, key) == runs
    if status == "dead":
        reason = "ignored by the task" if kind == "ignore" else "rejected by the task"
        assert fence_store.transitions.history(key)[-1].reason == reason
    _broker_drained(client_app)


def test_an_exception_in_the_regression_branch_re_sends_and_converges(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    key = f"regress:{uuid.uuid4().hex[:8]}"
    # Given a store that already saw generation 5 for the key (Redis lost its counter) ...
    fence_store.register(key, generation=5, attempt_id="earlier", task_name="t", request=None)
    # ... and raising the Redis counter fails once (a failover in the middle of it)
    faults.arm(redis_client, prefix, "fail_raise", key)
    spawn_worker("w", FENCE_T_FAIL_RAISE="1")
    client_app.work.delay(key)
    # Then the message is re-sent rather than acked as a failure, and the job completes once
    record = _ended(fence_store, key)
    assert record.status == "completed", record
    assert record.generation > 5
    assert ledger.run_count(redis_client, prefix, key) == 1
    assert not faults.armed(redis_client, prefix, "fail_raise", key)  # the fault did fire
    _broker_drained(client_app)


def test_a_body_hung_past_max_runtime_frees_its_key_and_its_late_completion_is_rejected(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a threads-pool worker (no hard time limit is enforced there) and fence_max_runtime=1.5
    spawn_worker("w", pool="threads", concurrency=2, FENCE_T_MAX_RUNTIME="1.5")
    key = f"hung:{uuid.uuid4().hex[:8]}"
    # When a body hangs for 8 s without checking its lease ...
    first = client_app.overrun.delay(key, sleep=8.0)
    wait_until(
        lambda: ledger.run_count(redis_client, prefix, key) == 1, 20, what="the hung body to start"
    )
    # ... the renewal stops at 1.5 s, the key frees itself a TTL (2 s) later, and a second
    # message for the same key is claimed and completes while the first body still hangs
    second = client_app.overrun.delay(key, sleep=0.0)
    result = second.get(timeout=30)
    assert result["generation"] == 2
    assert ledger.run_count(redis_client, prefix, key) == 2
    # Then the hung attempt's late completion is rejected: both callers get generation 2's result
    assert first.get(timeout=30) == result
    record = fence_store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 2)
    assert ("stale", 1) in [(t.action, t.generation) for t in fence_store.transitions.history(key)]
