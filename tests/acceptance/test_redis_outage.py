"""The fence Redis stops while a task runs, with real workers and a real redis-server.

Each test starts its own loopback ``redis-server`` as the workers' fence Redis (the broker, the
result backend and the workload's ledger stay on the suite's Redis), kills it mid-task, and
asserts on the stored job and on the ledger of what the workload really did: the running
attempt loses its lease at its deadline, the message is retried (never lost) while Redis is
unreachable, and a result is stored as completed only by the generation that owns the row.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis

from celery_fence.store import Store
from tests.support import ledger
from tests.support.redis_servers import RedisServer, missing_binaries, topology_worker
from tests.support.worker import Worker, wait_until

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(
        bool(missing_binaries("redis-server")), reason=missing_binaries("redis-server") or ""
    ),
]


@pytest.fixture
def fence_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "fence-redis").start()
    yield server
    server.stop()


@pytest.fixture
def outage_worker(
    tmp_path: Path, worker_env: dict[str, str], fence_redis: RedisServer
) -> Iterator[Worker]:
    worker = topology_worker(
        tmp_path, worker_env, "outage", concurrency=2, FENCE_T_FENCE_REDIS=f"{fence_redis.url}/0"
    )
    worker.start()
    yield worker
    worker.stop()


def _restart_empty(server: RedisServer) -> RedisServer:
    """A fresh, empty redis-server on the same port: every lease and counter is gone."""
    return RedisServer(server.dir.parent / "restarted", port=server.port).start()


def test_redis_killed_mid_task_lease_lost_at_deadline_then_retried(
    outage_worker: Worker,
    fence_redis: RedisServer,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    store = Store(db_url)
    key = f"outage:{uuid.uuid4().hex[:8]}"
    # Given a task running generation 1 (TTL 2 s), which checks its fence before its effect,
    result = client_app.work.delay(key, sleep=4.0)
    wait_until(lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 30, what="the body starts")
    # when its fence Redis dies,
    fence_redis.kill()
    # then renewals fail, the lease is lost at its deadline, check() raises before the effect,
    # and the job is recorded for retry by the generation that still owns the row;
    wait_until(
        lambda: (r := store.get(key)) is not None and r.status == "retrying",
        30,
        what="the lost attempt records its retry",
    )
    actions = [(t.action, t.generation) for t in store.transitions.history(key)]
    assert ("lost", 1) in actions
    assert ledger.effects(redis_client, prefix, key) == []
    # while Redis is unreachable the message is rescheduled (not acked as a failure), and no
    # attempt runs unfenced ...
    assert not result.ready()
    assert len(ledger.runs(redis_client, prefix, key)) == 1
    # ... and once Redis is back (empty: its counter lost), the retry claims a generation above
    # the store's, runs once and completes.
    restarted = _restart_empty(fence_redis)
    try:
        value = result.get(timeout=120)
    finally:
        restarted.stop()
    assert value["generation"] >= 2
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation) == ("completed", value["generation"])
    assert ledger.effects(redis_client, prefix, key) == [
        f"{value['generation']}:{value['attempt_id']}"
    ]
    assert ("completed", 1) not in [
        (t.action, t.generation) for t in store.transitions.history(key)
    ]


def test_redis_killed_an_unchecking_task_still_owning_the_row_completes(
    outage_worker: Worker,
    fence_redis: RedisServer,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    store = Store(db_url)
    key = f"owner:{uuid.uuid4().hex[:8]}"
    # Given a body that never checks its fence,
    result = client_app.work.delay(key, sleep=4.0, check=False)
    wait_until(lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 30, what="the body starts")
    # when its fence Redis dies and nobody else can claim the job meanwhile,
    fence_redis.kill()
    # then its lease is lost, but no newer generation exists: the store accepts its result.
    value = result.get(timeout=60)
    assert value["generation"] == 1
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation, record.result) == ("completed", 1, value)
    wait_until(
        lambda: ("lost", 1) in [(t.action, t.generation) for t in store.transitions.history(key)],
        10,
        what="the renewer records the lease loss",
    )


def test_redis_killed_and_restarted_a_newer_generation_wins_the_row(
    outage_worker: Worker,
    fence_redis: RedisServer,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    store = Store(db_url)
    key = f"takeover:{uuid.uuid4().hex[:8]}"
    # Given attempt A (generation 1) in a long body that never checks its fence,
    first = client_app.work.delay(key, sleep=10.0, check=False)
    wait_until(lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 30, what="A starts")
    # when its fence Redis dies and comes back empty (counter and lease lost),
    fence_redis.kill()
    restarted = _restart_empty(fence_redis)
    try:
        # and a second message for the same key is claimed: Redis re-issues generation 1, the
        # store refuses it, the counter is raised above the store's, and B completes;
        second = client_app.work.delay(key)
        b = second.get(timeout=90)
        assert b["generation"] >= 2
        # then A's late completion is rejected (its generation no longer owns the row) and
        # both callers converge on B's result.
        assert first.get(timeout=90) == b
    finally:
        restarted.stop()
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation, record.result) == ("completed", b["generation"], b)
    actions = [(t.action, t.generation) for t in store.transitions.history(key)]
    assert ("completed", 1) not in actions
    assert ("stale", 1) in actions
    assert ledger.runs(redis_client, prefix, key)[0].startswith("1:")  # A did run (and its effect)
    assert f"{b['generation']}:{b['attempt_id']}" in ledger.effects(redis_client, prefix, key)
