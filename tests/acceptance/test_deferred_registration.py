"""The failure windows again, with ``fence_defer_first_registration=True``: a first claim writes
its row only with its outcome (one statement for a completion), and every invariant holds.

The scenarios are the ones of the default design, collected here a second time with the workers'
setting turned on (the module's ``worker_env`` below), so both designs face the same windows.
"""

from __future__ import annotations

import datetime as dt
import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.testing import faults
from tests.acceptance.test_celery_driven_exits import _broker_drained, _ended
from tests.acceptance.test_failure_windows import (  # noqa: F401 - collected again here
    test_pause_timeline_stale_attempt_loses,
    test_sigkill_after_commit_before_ack_replays_without_rerunning_the_body,
    test_two_workers_given_the_same_key_at_once_one_body_run_no_message_lost,
)
from tests.acceptance.test_retries import (  # noqa: F401 - collected again here
    test_success_after_two_transient_failures_completes_on_the_third_attempt,
)
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance


@pytest.fixture
def worker_env(worker_env: dict[str, str]) -> dict[str, str]:
    return {**worker_env, "FENCE_T_DEFER": "1"}


def test_a_first_completion_is_one_row_with_its_claim_and_completion(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    fence_store: Store,
) -> None:
    spawn_worker("w")
    key = f"defer:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key)
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.generation, record.attempts) == ("completed", 1, 1)
    assert [t.action for t in fence_store.history(key)] == ["claimed", "completed"]
    assert record.request is not None and record.request["args"] == [key]


def test_an_enqueued_job_s_first_attempt_completes_its_pending_row_in_one_statement(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    import sqlalchemy as sa

    from celery_fence import enqueue

    # Given a job enqueued in the caller's transaction (its pending row, never claimed) ...
    key = f"defer-enqueued:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        enqueue(conn, client_app.work, args=(key,))
    engine.dispose()
    spawn_worker("w")
    # then its deferred first attempt completes that row (nothing to fence out: no attempt
    # claimed it), in one statement, and its body ran once; the enqueued request is kept.
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.generation, record.attempts) == ("completed", 1, 1)
    assert ledger.run_count(redis_client, prefix, key) == 1
    history = fence_store.history(key)
    assert [t.action for t in history] == ["claimed", "completed"]
    assert history[0].at == history[1].at  # written by one statement, after the body
    assert record.request is not None and record.request["args"] == [key]
    # And a re-send of it (recovery, requeue) registers first as before: the operator's re-run
    # of the completed key runs once more and completes it again, in two statements.
    fence_store.admin.requeue(key, completed=True)
    from celery_fence.ops.recovery import recover

    # (the worker releases a finished attempt's lease on its renewer's next round trip, not in
    # the completing statement: until then recovery rightly sees a live lease and leaves the key)
    wait_until(lambda: leases.remaining(key)[0] is None, 10, what="the lease released")
    # (recover scans the whole store: only this key's re-sends are counted)
    assert recover(client_app.app, older_than=0).sent.count(key) == 1
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 2, 30, what="the re-run")
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.generation) == ("completed", 2)
    again = [t for t in fence_store.history(key) if t.generation == 2]
    assert [t.action for t in again][-2:] == ["claimed", "completed"]
    assert again[-2].at < again[-1].at


def test_a_first_attempt_that_kills_its_worker_is_counted_when_the_next_registers(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a message that SIGKILLs its worker on every run, two attempts allowed: the first
    # (generation 1) dies before writing any row
    spawn_worker("w", FENCE_T_MAX_ATTEMPTS="2")
    key = f"defer-poison:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key, fail="kill")
    # Then generation 2 registers counting both executions, dies too, and generation 3 finds
    # the attempts spent: dead, after two body runs, attempts == 2, the message acked
    record = _ended(fence_store, key, timeout=90)
    assert (record.status, record.attempts) == ("dead", 2)
    assert ledger.run_count(redis_client, prefix, key) == 2
    assert fence_store.history(key)[-1].reason == "attempts exhausted"
    _broker_drained(client_app)


def test_a_repeat_delivery_of_a_completed_job_replays_it_after_redis_lost_the_counter(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    spawn_worker("w")
    key = f"defer-lost:{uuid.uuid4().hex[:8]}"
    # Given a first attempt killed right after its deferred completion committed (before the
    # ack), so the broker delivers the message again
    faults.arm(redis_client, prefix, "kill", "after_commit", key)
    result = client_app.work.delay(key)
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.generation) == ("completed", 1)
    # ... and Redis loses the key's generation counter before that delivery claims (the killed
    # attempt's lease holds it off for a TTL): the next claim is handed generation 1 again
    redis_client.delete(leases.keys_for(key).generation)
    # Then the repeat delivery registers first, finds the job completed and replays its result:
    # the body ran once
    assert result.get(timeout=30) == record.result
    assert not faults.armed(redis_client, prefix, "kill", "after_commit", key)  # the kill happened
    assert ledger.run_count(redis_client, prefix, key) == 1
    after = fence_store.get(key)
    assert after is not None and (after.status, after.generation) == ("completed", 1)
    _broker_drained(client_app)


def test_a_duplicate_that_expires_while_a_deferred_first_attempt_runs_leaves_it_the_job(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w", concurrency=2)
    key = f"defer-expired:{uuid.uuid4().hex[:8]}"
    # Given a deferred first attempt running (no row written yet) ...
    faults.arm(redis_client, prefix, "hang", key)
    first = client_app.work.delay(key)
    wait_until(
        lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="the first body to start"
    )
    # ... when a duplicate message for the same key arrives already expired (never run)
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5)
    client_app.work.apply_async((key,), expires=past)

    def settled() -> bool:
        return any("expired" in (t.action, t.reason) for t in fence_store.history(key))

    wait_until(settled, 30, what="the expired duplicate to be settled")
    faults.arm(redis_client, prefix, "unhang", key)
    # Then the running attempt, the real first, completes the job: its result is kept
    value = first.get(timeout=30)
    record = fence_store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 1)
    assert value == record.result and value["generation"] == 1
    assert ledger.run_count(redis_client, prefix, key) == 1  # the duplicate never ran
    _broker_drained(client_app)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite stores NUL
def test_arguments_the_database_refuses_end_dead_without_a_deferred_run(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w")
    key = f"defer-nul-args:{uuid.uuid4().hex[:8]}"
    # Given a first message whose arguments hold NUL (PostgreSQL's jsonb refuses it)
    client_app.work.delay(key, marker="before\x00after")
    # Then it registers first and is dead at once: the body never ran, one attempt
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.attempts) == ("dead", 1)
    assert record.error_message is not None and "arguments" in record.error_message
    assert ledger.run_count(redis_client, prefix, key) == 0
    _broker_drained(client_app)


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_result_the_database_refuses_ends_a_deferred_first_attempt_dead_at_once(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn_worker("w")
    key = f"defer-nul-result:{uuid.uuid4().hex[:8]}"
    # Given a deferred first attempt whose return value holds NUL
    client_app.nul_result.delay(key)
    # Then its refused completion registers it and it is dead after that one run
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.generation, record.attempts) == ("dead", 1, 1)
    assert record.error_message is not None and "return value" in record.error_message
    assert redis_client.get(f"{prefix}:nul_runs:{key}") == b"1"
    _broker_drained(client_app)


def test_a_new_message_for_a_completed_key_does_not_run_the_body_again_after_redis_lost_it(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    spawn_worker("w")
    key = f"defer-loss-new:{uuid.uuid4().hex[:8]}"
    # Given a key completed by a deferred first claim (generation 1, one body run) ...
    first = client_app.work.delay(key)
    record = _ended(fence_store, key, timeout=30)
    assert (record.status, record.generation) == ("completed", 1)
    assert first.get(timeout=30) == record.result
    # ... when Redis loses the key's generation counter and lease (the chaos harness's
    # "redis-loss" window deletes both) and a new message for the same key arrives: its first
    # delivery, handed generation 1 again
    keys = leases.keys_for(key)
    wait_until(lambda: leases.remaining(key)[0] is None, 10, what="the lease released")
    redis_client.delete(keys.generation, keys.lease)
    second = client_app.work.delay(key)
    # Then it finds the completed job in the store and replays its result: the body ran once
    assert second.get(timeout=30) == record.result
    assert ledger.run_count(redis_client, prefix, key) == 1
    after = fence_store.get(key)
    assert after is not None and (after.status, after.generation) == ("completed", 1)
    assert after.result == record.result
    _broker_drained(client_app)
