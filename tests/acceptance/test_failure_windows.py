"""The core failure windows (pause and takeover, kill, duplicate) with real workers and signals.

Every test asserts on stored state and on the ledger of what the workload really did.
"""

from __future__ import annotations

import time
import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.store import Store
from celery_fence.testing import faults
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance


@pytest.mark.parametrize("checks", [True, False], ids=["checks", "does-not-check"])
def test_pause_timeline_stale_attempt_loses(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    checks: bool,
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    store = Store(db_url)
    # Given worker A running the job (generation 1) ...
    a = spawn_worker("a")
    first = client_app.work.delay(key, sleep=4.0, check=checks)
    wait_until(
        lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 20, what="A starts the body"
    )
    # ... when A pauses past its TTL (2 s) and B takes a second message for the same key,
    a.pause()
    time.sleep(2.6)
    b = spawn_worker("b")
    second = client_app.work.delay(key)
    assert second.get(timeout=20)["generation"] == 2
    # then A resumes: its check() raises, or, if it never checks, the store rejects it.
    a.resume()
    assert first.get(timeout=30) == second.get(timeout=1)  # both callers converge
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation) == ("completed", 2)
    assert record.result["generation"] == 2
    runs = ledger.runs(redis_client, prefix, key)
    assert [r.split(":")[0] for r in runs[:2]] == ["1", "2"]
    effects = ledger.effects(redis_client, prefix, key)
    if checks:
        assert effects == [runs[1]]  # the stale attempt started no side effect
    else:
        assert runs[0] in effects  # it did (it never checked) ...
    actions = [(t.action, t.generation) for t in store.transitions.history(key)]
    assert ("stale", 1) in actions or ("lost", 1) in actions
    assert ("completed", 2) in actions and ("completed", 1) not in actions
    b.stop()


def test_sigkill_after_commit_before_ack_replays_without_rerunning_the_body(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    store = Store(db_url)
    # Given a worker whose pool process dies right after the completion commits (before the ack),
    faults.arm(redis_client, prefix, "kill", "after_commit", key)
    spawn_worker("w")
    # when the job runs,
    result = client_app.work.delay(key)
    # then the redelivered message returns the stored result and the body ran once.
    value = result.get(timeout=40)
    record = store.get(key)
    assert record is not None and record.status == "completed"
    assert value == record.result
    assert len(ledger.runs(redis_client, prefix, key)) == 1
    assert len(ledger.effects(redis_client, prefix, key)) == 1
    assert record.attempts == 1  # the replay is not a new attempt at the work
    assert not faults.armed(redis_client, prefix, "kill", "after_commit", key)  # the fault happened


def test_two_workers_given_the_same_key_at_once_one_body_run_no_message_lost(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    store = Store(db_url)
    spawn_worker("a")
    spawn_worker("b")
    # When the same logical job is sent four times at once (two workers take two each),
    results = [client_app.work.delay(key, sleep=0.8) for _ in range(4)]
    values = [r.get(timeout=60) for r in results]
    # then every message ends with the one stored result, from one body run and one completion.
    record = store.get(key)
    assert record is not None and record.status == "completed"
    assert all(v == record.result for v in values)
    assert len(ledger.runs(redis_client, prefix, key)) == 1
    assert len(ledger.effects(redis_client, prefix, key)) == 1
    actions = [t.action for t in store.transitions.history(key)]
    assert actions.count("completed") == 1


def test_busy_lease_reschedules_with_the_same_task_id(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    w = spawn_worker("w", concurrency=2)
    first = client_app.work.delay(key, sleep=1.0)
    wait_until(lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 20, what="first body")
    second = client_app.work.delay(key)
    # the second message meets a live lease and is re-sent: the worker receives its task id
    # twice, and its result (under that id) is the one stored result.
    assert second.get(timeout=40) == first.get(timeout=40)
    log = w.log()
    assert f"fence busy key={key}" in log
    assert log.count(f"[{second.id}] received") >= 2, "the re-sent message kept its task id"
    assert len(ledger.runs(redis_client, prefix, key)) == 1
    record = Store(db_url).get(key)
    assert record is not None and record.attempts == 1  # a busy reschedule is not an attempt


def test_a_fence_key_that_is_not_a_str_fails_clearly_and_loses_nothing(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    spawn_worker("w")
    result = client_app.badly_keyed.delay(7)
    with pytest.raises(Exception, match=r"fence_key of task .*badly_keyed returned a int"):
        result.get(timeout=30)
    assert redis_client.get(f"{prefix}:badly_keyed_runs") is None  # the body never ran
    record = Store(db_url).get(f"unkeyed:{client_app.badly_keyed.name}:{result.id}")
    assert record is not None and record.status == "dead"
    assert record.request is not None and record.request["args"] == [7]  # kept for a requeue
    assert record.error_type is not None and record.error_type.endswith("ConfigurationError")


@pytest.mark.parametrize(("pool", "concurrency"), [("prefork", 2), ("threads", 4), ("solo", 1)])
def test_renewal_keeps_long_tasks_alive_under_every_pool(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    pool: str,
    concurrency: int,
) -> None:
    # Given a 2 s TTL renewed every 0.5 s, bodies that run 3 s and check before their effect
    spawn_worker("w", pool=pool, concurrency=concurrency)
    keys = [f"long:{uuid.uuid4().hex[:8]}" for _ in range(concurrency)]
    results = [client_app.work.delay(k, sleep=3.0) for k in keys]
    # then every lease outlived its TTL: each job completed on its first generation, body once.
    for k, r in zip(keys, results, strict=True):
        assert r.get(timeout=60)["generation"] == 1
        record = Store(db_url).get(k)
        assert record is not None and (record.status, record.generation) == ("completed", 1)
        assert len(ledger.effects(redis_client, prefix, k)) == 1


def test_a_result_the_database_refuses_goes_dead_at_once_without_leaking_it(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    pg_url: str,
    worker_env: dict[str, str],
) -> None:
    # Given a PostgreSQL store and a task whose JSON result jsonb cannot hold ("\u0000"),
    key = f"nul:{uuid.uuid4().hex[:8]}"
    w = spawn_worker("w", FENCE_T_DB=pg_url, loglevel="DEBUG")
    # when it runs,
    result = client_app.nul_result.delay(key)
    with pytest.raises(Exception, match="database refused the task's return value"):
        result.get(timeout=30)
    # then the job is dead after one attempt (not retried, not left running), and the refused
    # value appears neither in the store nor in the worker's log.
    record = Store(pg_url).get(key)
    assert record is not None and (record.status, record.attempts) == ("dead", 1)
    assert record.error_type is not None and record.error_type.endswith("ResultNotSerializable")
    assert redis_client.get(f"{prefix}:nul_runs:{key}") == b"1"
    assert "before" not in (record.error_message or "")
    assert "before" not in w.log()
