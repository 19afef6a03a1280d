"""The outbox's bounds: claims expire on the database's clock (not each sender's), and a row
whose handler kills its sender still runs out of attempts and goes ``dead``."""

from __future__ import annotations

import datetime as dt
import multiprocessing
import time
import uuid
from typing import Any

import pytest
import redis
from celery import Celery

from celery_fence.ops.outbox import Outbox
from celery_fence.store import Store
from celery_fence.store import outbox as outbox_store
from tests.integration.test_outbox import _completed_job, _effect
from tests.support.env import REDIS_URL


def test_a_sender_with_a_fast_clock_cannot_take_a_live_claim(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(pg_url)
    key = f"clock:{uuid.uuid4().hex[:8]}"
    _completed_job(store, key, _effect(key, "e", None))
    # Given sender A's claim for 30 s ...
    (claimed,) = store.outbox_rows.claim(claimer="A", claim_ttl=30, key=key)
    # ... when sender B's clock runs an hour ahead (its utcnow() says the claim expired),
    real = outbox_store.utcnow
    monkeypatch.setattr(outbox_store, "utcnow", lambda: real() + dt.timedelta(hours=1))
    # then B still cannot claim the row: expiry is decided on the database's clock.
    assert store.outbox_rows.claim(claimer="B", claim_ttl=30, key=key) == []
    # A failure's next due time is the database's too: B's clock does not postpone it.
    assert store.outbox_rows.fail(claimed.id, claimer="A", error=OSError("x"), retry_in=0.0)
    monkeypatch.setattr(outbox_store, "utcnow", real)
    (row,) = store.outbox_rows.rows(key=key)
    assert row.available_at <= real() + dt.timedelta(seconds=5)
    store.dispose()


def crashing_sender() -> Any:
    import importlib

    return importlib.import_module("tests.support.outbox_app").crashing_sender


def test_a_handler_that_kills_its_sender_goes_dead_after_the_maximum(
    db_url: str, redis_client: redis.Redis, prefix: str
) -> None:
    store = Store(db_url)
    key = f"crash:{prefix}"
    _completed_job(store, key, _effect(key, "crash", {"n": 1}))
    ledger = f"{prefix}:crash:ledger"
    # Given a handler that SIGKILLs its sender process, run by 3 senders one after the other
    # (each after the previous claim expired) ...
    ctx = multiprocessing.get_context("spawn")
    for attempt in range(1, 4):
        sender = ctx.Process(target=crashing_sender(), args=(db_url, REDIS_URL, ledger, key))
        sender.start()
        sender.join(timeout=60)
        assert sender.exitcode == -9, sender.exitcode
        (row,) = store.outbox_rows.rows(key=key)
        assert (row.status, row.attempts) == ("pending", attempt)
        time.sleep(0.35)  # the 0.3 s claim expires
    assert redis_client.llen(ledger) == 3
    # when the next sender comes (the sweep), the row is not claimed a 4th time but goes dead.
    app = Celery(f"crash-{prefix}", set_as_current=False)
    app.conf.update(fence_database_url=db_url, fence_redis_url=REDIS_URL)
    calls: list[str] = []
    outbox = Outbox(app, claim_ttl=0.3, max_attempts=3)
    outbox.register("crash", lambda payload, *, idempotency_key: calls.append(idempotency_key))
    report = outbox.deliver(key=key)
    assert report.dead == 1 and report.delivered == 0 and calls == []
    (row,) = store.outbox_rows.rows(key=key)
    assert (row.status, row.attempts) == ("dead", 3)
    assert row.last_error is not None and "claimed 3 time(s)" in row.last_error
    app.close()
    store.dispose()
