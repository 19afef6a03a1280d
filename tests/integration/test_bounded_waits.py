"""Every wait on the database has a bound (``fence_database_timeout``): a slow statement, and a
PostgreSQL that stops answering without closing the connection (a TCP proxy that stops
forwarding), end in an error within the timeout instead of blocking for the kernel's
retransmission time; and the generation counters expire in Redis."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.store.records import Completion
from celery_fence.testing.proxy import TcpProxy
from tests.support.worker import wait_until

TIMEOUT = 1.0
#: What a bounded call may take past the timeout: the watchdog's tick, scheduling on a busy box.
SLACK = 1.5


@pytest.fixture
def proxied_store(pg_url: str, proxy: TcpProxy) -> Iterator[Store]:
    url = sa.engine.make_url(pg_url).set(host="127.0.0.1", port=proxy.port)
    store = Store(url.render_as_string(hide_password=False), database_timeout=TIMEOUT)
    yield store
    store.dispose()


def _timed_failure(call: object) -> float:
    """Seconds until ``call()`` raised a database error; fails if it is still blocked after
    the bound plus 10 s (the call is left blocked on its daemon thread)."""
    assert callable(call)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT + SLACK + 10)
    assert outcome, "the call is still blocked: the wait has no bound"
    assert isinstance(outcome[0], sa.exc.DBAPIError), outcome[0]
    return time.monotonic() - started


def test_connections_carry_the_statement_timeout_and_a_slow_statement_ends(
    pg_url: str,
) -> None:
    store = Store(pg_url, database_timeout=TIMEOUT)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "1s"
        elapsed = _timed_failure(lambda: conn.exec_driver_sql("SELECT pg_sleep(30)"))
    assert elapsed < TIMEOUT + SLACK
    store.dispose()


def test_a_database_that_stops_answering_ends_each_call_within_the_timeout(
    proxied_store: Store, proxy: TcpProxy
) -> None:
    # Given a store whose connections work (one pooled connection in use) ...
    key = f"blackhole:{uuid.uuid4().hex[:8]}"
    attempt = uuid.uuid4().hex
    proxied_store.register(key, generation=1, attempt_id=attempt, task_name="t")
    assert proxied_store.get(key) is not None
    # ... when the path to PostgreSQL stops forwarding (nothing is closed, nothing answers),
    proxy.stall()
    # then the hot-path completion and a Core statement each fail within the timeout,
    hot = _timed_failure(
        lambda: proxied_store.end(key, Completion(generation=1, attempt_id=attempt, result=1))
    )
    core = _timed_failure(lambda: proxied_store.get(key))
    assert hot < TIMEOUT + SLACK and core < TIMEOUT + SLACK, (hot, core)
    # and once it answers again, the store works on fresh connections (the cut ones are gone).
    proxy.unstall()
    proxied_store.end(key, Completion(generation=1, attempt_id=attempt, result=1))
    record = proxied_store.get(key)
    assert record is not None and record.status == "completed"


def test_generation_counters_expire_and_one_that_came_back_low_is_raised(
    store: Store, redis_client: redis.Redis, prefix: str
) -> None:
    # Given counters that live half a second after their last claim ...
    leases = LeaseStore(redis_client, prefix=prefix, generation_ttl=0.5)
    key = f"gen:{uuid.uuid4().hex[:8]}"
    gen_key = leases.keys_for(key).generation
    for attempt, expected in (("a", 1), ("b", 2)):
        assert leases.claim(key, attempt, 5_000) == expected
        assert 0 < redis_client.pttl(gen_key) <= 500
        store.register(key, generation=expected, attempt_id=attempt, task_name="t")
        assert leases.release(leases.keys_for(key).lease, f"{attempt}:{expected}")
    # ... when the counter expired while the job is unfinished (generation 2 stored),
    wait_until(lambda: not redis_client.exists(gen_key), 5, what="counter expired")
    low = leases.claim(key, "c", 5_000)
    assert low == 1
    registration = store.register(key, generation=low, attempt_id="c", task_name="t")
    # then the store refuses the low generation, the counter is raised (with its lifetime) and
    # the next claim is above the store's.
    assert (registration.outcome, registration.stored_generation) == ("stale", 2)
    assert leases.release(leases.keys_for(key).lease, "c:1")
    assert leases.raise_generation(key, registration.stored_generation) == 2
    assert 0 < redis_client.pttl(gen_key) <= 500
    assert leases.claim(key, "d", 5_000) == 3
    assert store.register(key, generation=3, attempt_id="d", task_name="t").outcome == "registered"
    # and with a lifetime of 0 a counter never expires (what deferred first registration needs)
    forever = LeaseStore(redis_client, prefix=prefix, generation_ttl=0)
    other = f"gen:{uuid.uuid4().hex[:8]}"
    assert forever.claim(other, "e", 5_000) == 1
    assert redis_client.pttl(forever.keys_for(other).generation) == -1
