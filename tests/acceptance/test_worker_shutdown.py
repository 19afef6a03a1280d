"""A worker that stops cleanly sends the lease releases still waiting in it, on every pool: the
next delivery of the key is not busy for the rest of a TTL after a restart."""

from __future__ import annotations

import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("pool", ["threads", "solo", "gevent"])
def test_a_clean_stop_sends_the_pending_lease_releases(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    fence_store: Store,
    leases: LeaseStore,
    pool: str,
) -> None:
    # Given a worker whose finished attempts' releases wait in it (for the next claim to carry
    # them) for a minute, and leases that live 30 s
    worker = spawn_worker(
        "w", pool=pool, FENCE_T_TTL="30", FENCE_T_RENEW="5", FENCE_T_RELEASE_DELAY="60"
    )
    key = f"stop:{uuid.uuid4().hex[:8]}"
    client_app.work.delay(key)

    def completed() -> bool:
        record = fence_store.get(key)
        return record is not None and record.status == "completed"

    wait_until(completed, 20, interval=0.1, what=f"job {key} to complete")
    lease_key = leases.keys_for(key).lease
    assert redis_client.exists(lease_key)  # the release is still waiting in the worker
    # When the worker stops cleanly
    worker.stop()
    assert not worker.running
    # Then it sent the release on its way out: the key is free now, not in 30 s
    assert not redis_client.exists(lease_key)
