"""A body ended by a BaseException that is not an Exception (SystemExit, asyncio.CancelledError,
the gevent pool's hard time limit) settles like any other exit, with real workers on the threads,
solo and gevent pools: the job is never left ``running``, its lease is released (the next
delivery is not busy for a TTL) and the message is not lost."""

from __future__ import annotations

import uuid
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from tests.support import ledger
from tests.support.broker import broker_queue_length
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

#: A lease TTL far beyond the test's bound: a lease left behind would show as a timeout.
LONG_TTL = {"FENCE_T_TTL": "30", "FENCE_T_RENEW": "5"}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize(
    ("pool", "kind", "error"),
    [
        ("threads", "cancelled", "CancelledError"),
        ("threads", "exit", "SystemExit"),
        ("solo", "exit", "SystemExit"),
        ("gevent", "sleep", "Timeout"),
    ],
)
def test_an_interrupted_body_settles_releases_its_lease_and_runs_again(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
    pool: str,
    kind: str,
    error: str,
) -> None:
    # Given a worker whose leases live 30 s, and a body whose first run is interrupted
    first = spawn_worker("w", pool=pool, concurrency=2, **LONG_TTL)
    key = f"int-{kind}:{uuid.uuid4().hex[:8]}"
    options = {"time_limit": 1.0} if pool == "gevent" else {}  # gevent: its Timeout cuts it
    client_app.interrupted.apply_async((key,), {"kind": kind, "sleep": 8.0}, **options)
    if pool == "solo" and kind == "exit":
        # SystemExit goes on after the settle step: the solo worker exits, Celery gives the
        # message back, and the next worker takes it at once (the key is not busy)
        wait_until(lambda: not first.running, 20, what="the worker to exit")
        spawn_worker("w2", pool=pool, **LONG_TTL)
    # When the interruption settles, the job is retried at once, not after the lease's TTL
    found: list[Any] = []

    def completed() -> bool:
        record = fence_store.get(key)
        found.append(record)
        return record is not None and record.status == "completed"

    wait_until(completed, 20, interval=0.1, what=f"job {key} to complete")
    # Then the interruption was recorded, two body runs, no busy redelivery, and the message
    # acked with nothing left behind: no lease, nothing in the broker
    history = [(t.action, t.reason) for t in fence_store.transitions.history(key)]
    assert ("retry_scheduled", f"interrupted by {error}") in history, history
    assert "busy" not in [action for action, _ in history]
    assert ledger.run_count(redis_client, prefix, key) == 2
    wait_until(
        lambda: not redis_client.exists(leases.keys_for(key).lease), 5, what="the lease to go"
    )
    wait_until(lambda: broker_queue_length(client_app) == 0, 15, what="the broker to drain")
