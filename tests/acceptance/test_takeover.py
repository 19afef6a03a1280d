"""Time-to-takeover with real workers: a worker frozen (SIGSTOP) inside a body holds its message
and its key; its lease runs out, and another worker's own recovery check re-sends the job
within one TTL of the lease's end (a running job whose lease is gone is stranded at once) — no
beat, no operator. On the Redis broker and on RabbitMQ: the new attempt claims a
newer generation and completes, ``job_taken_over`` fires with the generation taken over and the
seconds, and the frozen attempt, resumed, is refused.

Settings are the defaults but the TTL (2 s; renewals every 0.5 s): the check runs every
``RECOVER_INTERVAL_TTLS`` (half a) TTL, jittered.
"""

from __future__ import annotations

import importlib
import json
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import kombu
import psutil
import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.settings import RECOVER_INTERVAL_TTLS
from celery_fence.store import Store
from celery_fence.testing import faults
from tests.support import ledger
from tests.support.env import AMQP_URL, BROKER_URL
from tests.support.worker import SpawnWorker, wait_until

TTL = 2.0
#: The bound: the lease's end (at most one TTL after the freeze), then one check interval (half
#: a TTL) and a worker's pickup, with half a TTL of slack for a loaded machine.
BOUND = 2.5 * TTL


def _status(store: Store, key: str) -> str | None:
    record = store.get(key)
    return None if record is None else record.status


def _signals(redis_client: redis.Redis, prefix: str, name: str, key: str) -> list[dict[str, Any]]:
    entries = [json.loads(raw) for raw in redis_client.lrange(f"{prefix}:signals", 0, -1)]
    return [e for e in entries if e["signal"] == name and e.get("key") == key]


@pytest.fixture(params=["redis", "amqp"])
def broker_env(
    request: pytest.FixtureRequest,
    worker_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[dict[str, str], ModuleType]]:
    """The workers' environment on one broker (recovery checks on, signals recorded), and the
    app module imported with it in the test process."""
    env = {
        **worker_env,
        "FENCE_T_TTL": str(TTL),
        "FENCE_T_RECOVER_INTERVAL": "default",  # (the test app's own default is 0: none)
        "FENCE_T_SIGNALS": "1",
    }
    if request.param == "amqp":
        env.update(FENCE_T_BROKER=AMQP_URL, FENCE_T_BACKEND=BROKER_URL)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("tests.support.app", None)
    client = importlib.import_module("tests.support.app")
    try:
        yield env, client
    finally:
        client.app.close()
        sys.modules.pop("tests.support.app", None)
        if request.param == "amqp":
            with kombu.Connection(AMQP_URL) as conn:
                conn.default_channel.queue_delete(worker_env["FENCE_T_QUEUE"])
            kombu.pools.reset()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_frozen_workers_job_is_taken_over_within_a_ttl_of_its_lease_s_end(
    broker_env: tuple[dict[str, str], ModuleType],
    spawn_worker: SpawnWorker,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
) -> None:
    env, client = broker_env
    assert RECOVER_INTERVAL_TTLS <= 0.5
    # Given two workers, one of which has its pool process frozen (SIGSTOP) inside the body,
    # holding the key and the unacked message (its main process runs on) ...
    key = f"frozen:{uuid.uuid4().hex[:8]}"
    faults.arm(redis_client, prefix, "hang", key)
    workers = [spawn_worker("one", **env), spawn_worker("two", **env)]
    client.work.apply_async((key,), kwargs={"check": False}, queue=env["FENCE_T_QUEUE"])
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    claimed = _signals(redis_client, prefix, "lease_claimed", key)
    child = psutil.Process(claimed[0]["pid"])
    assert any(child.pid in {c.pid for c in psutil.Process(w.pid).children()} for w in workers)
    child.send_signal(signal.SIGSTOP)
    stopped_at = time.time()
    try:
        # ... when nobody runs `fence recover` and no beat is scheduled,
        wait_until(lambda: _status(fence_store, key) == "completed", BOUND + 20, what="taken over")
        # then a worker's own recovery check re-sent it, a newer generation completed it within
        # a TTL of the lease's end,
        taken = _signals(redis_client, prefix, "job_taken_over", key)
        assert len(taken) == 1, taken
        assert taken[0]["previous_generation"] == 1 and taken[0]["generation"] == 2
        assert 0 < taken[0]["seconds"] <= BOUND
        measured = taken[0]["at"] - stopped_at
        assert measured <= BOUND, f"taken over {measured:.1f}s after the freeze (TTL {TTL})"
        done = fence_store.get(key)
        assert done is not None and done.generation == 2
        assert "recovered" in [t.action for t in fence_store.transitions.history(key)]
        # and the frozen attempt, resumed, performs its effect (it never checks) but cannot
        # complete: one completion, the newer generation's.
        faults.arm(redis_client, prefix, "unhang", key)
    finally:
        child.send_signal(signal.SIGCONT)
    wait_until(
        lambda: "stale" in [t.action for t in fence_store.transitions.history(key)],
        30,
        what="stale refused",
    )
    after = fence_store.get(key)
    assert after is not None and (after.attempt_id, after.result) == (done.attempt_id, done.result)
    assert sum(1 for t in fence_store.transitions.history(key) if t.action == "completed") == 1
    broker = env["FENCE_T_BROKER"].split(":")[0]
    print(f"\ntakeover {broker}: {measured:.1f}s = {measured / TTL:.1f} TTLs")
