"""Messages that come back after the settle step answered them, or whose re-send the broker
refused, with real workers: a message the database refuses, redelivered after its job ended, is
answered from the stored state once; a body's own ``self.retry()`` that the broker refuses to
publish gives the message back instead of burying the job.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store, decode_request
from celery_fence.testing import faults
from tests.acceptance.test_celery_driven_exits import (  # noqa: F401 - the broker fixtures
    BOTH_BROKERS,
    _broker_drained,
    _ended,
    broker,
    worker_env,
)
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

NUL_ARGUMENT = "before\x00after"  # valid JSON; PostgreSQL's jsonb refuses \u0000


def _claims_stop(client_app: ModuleType, leases: LeaseStore, key: str) -> int:
    """The key's generation counter, once nothing of the queue is left in the broker (ready or
    delivered and unacked): no delivery is left to claim it again, so the loop, if any, ended."""
    _broker_drained(client_app)
    return int(leases.client.get(leases.keys_for(key).generation) or 0)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite stores NUL
def test_a_refused_message_redelivered_after_its_job_went_dead_is_acked_once(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    spawn_worker("w")
    key = f"nul-dead:{uuid.uuid4().hex[:8]}"
    # Given a message whose arguments the database refuses, and a worker killed right after it
    # recorded the job dead, before the ack: the broker redelivers the message
    faults.arm(redis_client, prefix, "kill", "after_dead", key)
    client_app.echo.delay(key, NUL_ARGUMENT)
    # Then the redelivery finds the job dead and is acked as such, without writing again
    record = _ended(fence_store, key, timeout=30)
    assert record.status == "dead" and record.attempts == 1
    _broker_drained(client_app, timeout=30)
    assert not faults.armed(redis_client, prefix, "kill", "after_dead", key)  # the kill happened
    # the first delivery and the redelivery, no loop
    assert _claims_stop(client_app, leases, key) == 2
    after = fence_store.get(key)
    assert after is not None and (after.status, after.generation) == ("dead", 1)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_refused_message_for_a_completed_job_returns_the_stored_result(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    spawn_worker("w")
    key = f"nul-done:{uuid.uuid4().hex[:8]}"
    # Given a job that completed
    stored = client_app.echo.delay(key, "fine").get(timeout=30)
    # When a message for the same key arrives with arguments the database refuses
    again = client_app.echo.delay(key, NUL_ARGUMENT)
    # Then it is answered with the stored result, acked once, and the job stays as it was
    assert again.get(timeout=30) == stored
    _broker_drained(client_app)
    assert _claims_stop(client_app, leases, key) == 2
    record = fence_store.get(key)
    assert record is not None and (record.status, record.result) == ("completed", stored)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_an_expired_message_the_database_refuses_ends_dead_and_is_acked(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w")
    key = f"nul-expired:{uuid.uuid4().hex[:8]}"
    # Given a message that arrives expired, with arguments the database refuses as they are
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)
    client_app.echo.apply_async((key, NUL_ARGUMENT), expires=past)
    # Then its job is recorded dead with its request kept encoded, and the message is acked
    record = _ended(fence_store, key, timeout=30)
    assert record.status == "dead" and record.attempts == 0
    request = decode_request(record.request)
    assert request is not None and request["args"] == [key, NUL_ARGUMENT]
    _broker_drained(client_app)
    assert ledger.run_count(redis_client, prefix, key) == 0


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_key_the_database_refuses_is_kept_dead_under_the_unkeyed_name(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    spawn_worker("w")
    key = f"nul-key:{uuid.uuid4().hex[:8]}\x00"
    # Given a message whose fence_key holds NUL (no database column takes it)
    sent = client_app.echo.delay(key)
    # Then it is kept dead under unkeyed:<task>:<id> with its request, once: no re-send loop
    unkeyed = f"unkeyed:{client_app.echo.name}:{sent.id}"
    record = _ended(fence_store, unkeyed, timeout=30)
    assert record.error_message is not None and "NUL" in record.error_message
    request = decode_request(record.request)
    assert request is not None and request["args"] == [key]
    _broker_drained(client_app)
    assert leases.client.get(leases.keys_for(key).generation) is None  # never claimed


@BOTH_BROKERS
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # not a store matter
def test_a_retry_the_broker_refuses_to_publish_gives_the_message_back(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a body that calls self.retry() on its first run, and a broker that refuses that
    # retry message's publish once
    spawn_worker("w", FENCE_T_FAIL_PUBLISH="1")
    faults.arm(redis_client, prefix, "fail_publish")
    key = f"retry-refused:{uuid.uuid4().hex[:8]}"
    client_app.control.delay(key, kind="retry")
    # Then the message goes back to the broker and a later attempt completes the job
    record = _ended(fence_store, key, timeout=30)
    assert record.status == "completed", record
    assert not faults.armed(redis_client, prefix, "fail_publish")  # the publish was refused
    assert ledger.run_count(redis_client, prefix, key) == 2
    assert record.attempts == 2
    reasons = [t.reason for t in fence_store.transitions.history(key)]
    assert "the task's retry could not be sent; the message goes back" in reasons
    _broker_drained(client_app)


@BOTH_BROKERS
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # not a store matter
def test_a_busy_reschedule_the_broker_refuses_does_not_spin_and_loses_nothing(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    # Given a job held by a running attempt (its lease renewed, 30 s TTL) ...
    spawn_worker("w", concurrency=2, FENCE_T_FAIL_PUBLISH="1", FENCE_T_TTL="30", FENCE_T_RENEW="5")
    key = f"busy-refused:{uuid.uuid4().hex[:8]}"
    faults.arm(redis_client, prefix, "hang", key)
    client_app.work.delay(key)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="the holder runs")
    # ... and a broker that refuses every re-send,
    faults.arm(redis_client, prefix, "refuse_publish")
    # when a second message of the key arrives (busy: its re-send is refused, again and again),
    duplicate = client_app.work.delay(key)
    wait_until(
        lambda: redis_client.llen(f"{prefix}:refused_publish") >= 1, 30, what="a refused re-send"
    )
    time.sleep(6.0)
    # then the worker does not spin: a few re-sends tried in 6 s, not one per round trip,
    refused = [float(t) for t in redis_client.lrange(f"{prefix}:refused_publish", 0, -1)]
    assert len(refused) <= 6, f"{len(refused)} refused re-sends in {refused[-1] - refused[0]:.1f}s"
    # and once the broker takes publishes again and the holder ends, nothing was lost: the
    # job completes once, the duplicate answers with its result, the broker drains.
    faults.disarm(redis_client, prefix, "refuse_publish")
    faults.arm(redis_client, prefix, "unhang", key)
    record = _ended(fence_store, key, timeout=60)
    assert record.status == "completed", record
    assert duplicate.get(timeout=60) == record.result
    assert ledger.run_count(redis_client, prefix, key) == 1
    _broker_drained(client_app)
