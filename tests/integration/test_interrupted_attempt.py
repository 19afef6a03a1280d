"""An exit that is not an Exception (here KeyboardInterrupt and SystemExit) raised anywhere in a
fenced call — while the claim waits for Redis, or in the body — still releases the attempt's
lease and leaves the job in a state that says what happened; the exit goes on to the caller."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_fence import FencedTask
from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from tests.support.env import REDIS_URL
from tests.support.worker import wait_until


@pytest.fixture
def app(db_url: str, prefix: str) -> Iterator[Celery]:
    app = Celery(f"interrupted-{prefix}", set_as_current=False)
    app.conf.update(
        fence_database_url=db_url,
        fence_redis_url=REDIS_URL,
        fence_key_prefix=prefix,
        fence_lease_ttl=30.0,  # a lease left behind would hold the key far past the test
        fence_renew_interval=5.0,
    )
    yield app
    app.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("where", ["claim", "body"])
def test_an_exit_anywhere_in_the_fenced_call_releases_the_lease(
    app: Celery,
    store: Store,
    redis_client: redis.Redis,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    exits = {"n": 1}

    @app.task(base=FencedTask, bind=True, shared=False, fence_key=lambda key: key)
    def job(self: Any, key: str) -> str:
        if where == "body" and exits["n"]:
            exits["n"] -= 1
            raise SystemExit(3)
        return key

    real_claim = LeaseStore.claim

    def claim_interrupted(self: LeaseStore, *args: Any, **kwargs: Any) -> int:
        generation = real_claim(self, *args, **kwargs)
        if exits["n"]:
            exits["n"] -= 1
            raise KeyboardInterrupt  # the claim ran in Redis; its reply never arrived
        return generation

    if where == "claim":
        monkeypatch.setattr(LeaseStore, "claim", claim_interrupted)
    key = f"exit-{where}:{uuid.uuid4().hex[:8]}"
    lease_key = LeaseStore(redis_client, prefix=prefix).keys_for(key).lease
    # Given a fenced call that an exit interrupts (in the claim, or in the body)
    with pytest.raises(KeyboardInterrupt if where == "claim" else SystemExit):
        job(key)
    # Then the exit went on to the caller, the lease is released at once (not in 30 s) ...
    wait_until(lambda: not redis_client.exists(lease_key), 3, what="the lease to be released")
    # ... the job is not left running (a registered attempt of a direct call is failed: its
    # caller got the exit, and recovery never re-sends it; a claim never registered)
    record = store.get(key)
    if where == "body":
        assert record is not None and record.status == "failed", record
    else:
        assert record is None
    # ... and the next call is not busy: it completes
    assert job(key) == key
    record = store.get(key)
    assert record is not None and record.status == "completed"
