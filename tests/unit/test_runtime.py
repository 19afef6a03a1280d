"""The per-process runtime: one object per identity, fresh after a fork, drained at shutdown.

Nothing here makes a connection: stores, clients and lease stores are built lazily, so identity
and fork behaviour are checked on the objects themselves.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_fence import FencedTask
from celery_fence.announce.events import EventSender
from celery_fence.app_state import app_state
from celery_fence.config import FenceConfig
from celery_fence.leases.redis_client import client_identity
from celery_fence.leases.renewer import Renewer
from celery_fence.pipeline import backends as b
from celery_fence.process.background import Background, BackgroundWriter
from celery_fence.process.runtime import Runtime, runtime
from celery_fence.store.watchdog import Watchdog, watchdog
from tests.support.memory import MemoryLeaseStore


@pytest.fixture
def rt() -> Iterator[Runtime]:
    """A fresh runtime for the test, stopped and replaced after it."""
    runtime().reset()
    current = runtime()
    yield current
    current.reset()


@pytest.fixture
def config(tmp_path: Path) -> FenceConfig:
    return FenceConfig(
        database_url=f"sqlite:///{tmp_path / 'fence.sqlite3'}", redis_url="redis://127.0.0.1:1/0"
    )


def test_the_same_identity_gets_the_same_objects(rt: Runtime, config: FenceConfig) -> None:
    # Given two equal configurations (different objects)
    twin = FenceConfig(database_url=config.database_url, redis_url=config.redis_url)

    # Then every process-wide object is made once
    assert b.store_for(config) is b.store_for(twin)
    assert b.redis_client(config) is b.redis_client(twin)
    assert b.lease_store(config) is b.lease_store(twin)
    assert b.renewer(config) is b.renewer(twin)
    assert b.renewer(config).leases is b.lease_store(config)
    assert b.retry_budget(config) is b.retry_budget(twin)
    assert rt.stores() == [b.store_for(config)]


def test_leases_and_the_retry_budget_share_one_client(rt: Runtime, config: FenceConfig) -> None:
    client = b.redis_client(config)
    assert b.lease_store(config).client is client
    backends = b.backends(config)
    assert backends.leases.client is client
    assert backends.policy.budget is b.retry_budget(config)
    assert backends.runtime is rt


def test_different_tls_settings_get_different_clients(rt: Runtime) -> None:
    # Given two configurations for the same URL that differ only in their TLS settings
    url = "rediss://127.0.0.1:1/0"
    verified = FenceConfig(redis_url=url, redis_ssl={"ssl_cert_reqs": "required"})
    unverified = FenceConfig(redis_url=url, redis_ssl={"ssl_cert_reqs": "none"})

    # Then they share neither the client, nor the lease store, nor the retry budget
    assert client_identity(verified.redis) != client_identity(unverified.redis)
    assert b.redis_client(verified) is not b.redis_client(unverified)
    assert b.lease_store(verified) is not b.lease_store(unverified)
    assert b.retry_budget(verified) is not b.retry_budget(unverified)
    transport = FenceConfig(redis_url=url, redis_transport_options={"socket_keepalive": True})
    assert b.redis_client(transport) is not b.redis_client(FenceConfig(redis_url=url))


def test_creation_is_thread_safe(rt: Runtime, config: FenceConfig) -> None:
    barrier = threading.Barrier(8)
    seen: list[object] = []

    def get() -> None:
        barrier.wait()
        seen.append(b.lease_store(config))

    threads = [threading.Thread(target=get) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert len(seen) == 8 and all(item is seen[0] for item in seen)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() with threads running
def test_a_forked_child_gets_a_fresh_runtime_and_the_parent_keeps_its_own(
    rt: Runtime, config: FenceConfig
) -> None:
    # Given a parent whose runtime made a store, a lease store and a renewer, and a fenced task
    # that resolved its backends
    store, leases, renewer = b.store_for(config), b.lease_store(config), b.renewer(config)
    app = Celery("runtime-fork", set_as_current=False)
    app.conf.update(fence_database_url=config.database_url, fence_redis_url=config.redis_url)

    @app.task(base=FencedTask, shared=False)
    def noop() -> None:
        pass

    assert noop.fence_backends().store is store
    read, write = os.pipe()

    # When the process forks
    pid = os.fork()
    if pid == 0:  # the child: report what it sees, then leave without running pytest's teardown
        try:
            child = runtime()
            facts = [
                child is not rt,
                rt.forked,
                not child.forked,
                b.store_for(config) is not store,
                b.lease_store(config) is not leases,
                b.renewer(config) is not renewer,
                store.engine is not None,  # the parent's store makes its own engine here
                noop.fence_backends().runtime is child,
                noop.fence_backends().store is b.store_for(config),
            ]
            os.write(write, ("ok" if all(facts) else f"bad {facts}").encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        report = pipe.read()
    os.waitpid(pid, 0)

    # Then the child had a fresh runtime, and the parent's is untouched
    assert report == "ok"
    assert runtime() is rt and not rt.forked
    assert b.store_for(config) is store and b.lease_store(config) is leases
    assert b.renewer(config) is renewer
    assert noop.fence_backends().store is store


def test_shutdown_drains_the_background_writer(rt: Runtime) -> None:
    done: list[int] = []

    def slow_write(n: int) -> None:
        time.sleep(0.02)
        done.append(n)

    writer = rt.get("writer", None, BackgroundWriter)
    for n in range(5):
        assert writer.submit(slow_write, n)
    rt.shutdown(timeout=5)
    assert done == [0, 1, 2, 3, 4]
    assert writer.submit(done.append, 5)  # usable again: the thread starts on demand
    writer.drain(5)
    assert done[-1] == 5


def test_the_writer_drops_instead_of_blocking_when_full() -> None:
    writer = BackgroundWriter(maxsize=1)
    release = threading.Event()
    started = threading.Event()

    def blocker() -> None:
        started.set()
        release.wait(5)

    assert writer.submit(blocker)
    assert started.wait(5)
    assert writer.submit(lambda: None)  # queued behind the blocker
    began = time.monotonic()
    assert not writer.submit(lambda: None)  # full: dropped at once, never waits
    assert time.monotonic() - began < 0.5 and writer.dropped == 1
    release.set()
    assert writer.drain(5)


def test_a_failing_write_does_not_stop_the_writer() -> None:
    writer = BackgroundWriter()
    done: list[str] = []
    writer.submit(lambda: 1 / 0)
    writer.submit(done.append, "after")
    assert writer.drain(5)
    assert done == ["after"]


def test_app_state_holds_the_settings_until_forgotten() -> None:
    app = Celery("runtime-test", set_as_current=False)
    app.conf.fence_lease_ttl = 12
    first = FenceConfig.from_app(app)
    assert app_state(app).slots["config"] is first and FenceConfig.from_app(app) is first
    app.conf.fence_lease_ttl = 13
    assert FenceConfig.from_app(app).lease_ttl == 12  # read once ...
    FenceConfig.forget(app)
    assert FenceConfig.from_app(app).lease_ttl == 13


def test_shutdown_stops_only_background_objects(rt: Runtime) -> None:
    # Given the registry holds an object with a shutdown() of its own that is no background
    # thread (a Redis client's shutdown() stops the Redis server), and a background one
    stopped: list[str] = []

    class Client:
        def shutdown(self, timeout: float) -> None:
            stopped.append("client")

    class Thread(Background):
        def shutdown(self, timeout: float) -> None:
            stopped.append("background")

    rt.get("redis", "x", Client)
    rt.get("renewer", "x", Thread)
    # When the process shuts its runtime down
    rt.shutdown(timeout=1)
    # Then only the background object was stopped
    assert stopped == ["background"]


def _use(kind: str, thing: Any) -> None:
    """The first use of a background object of ``kind``: what starts its thread."""
    if kind == "writer":
        thing.submit(lambda: None)
    elif kind == "watchdog":
        thing.disarm(thing.arm(-1, 60.0))
    elif kind == "events":
        thing.submit("task-fencetest", {})
    else:  # the renewer: a queued release
        thing.return_releases([("fence:lease:k", "token")], delay=60.0)


@pytest.mark.parametrize("kind", ["writer", "watchdog", "events", "renewer"])
def test_every_background_thread_has_one_lifecycle(rt: Runtime, kind: str) -> None:
    # Given one of the process's four background objects, made through the runtime
    app = Celery("lifecycle", broker="memory://", set_as_current=False)
    make: dict[str, Callable[[], Background]] = {
        "writer": BackgroundWriter,
        "watchdog": Watchdog,
        "events": lambda: EventSender(app, "lifecycle@test"),
        "renewer": lambda: Renewer(MemoryLeaseStore()),
    }
    thing = rt.get(kind, None, make[kind])
    # no thread before its first use,
    assert not thing.running
    # a named daemon thread once used,
    _use(kind, thing)
    assert thing.running and thing._thread is not None
    assert thing._thread.daemon and thing._thread.name == thing.thread_name
    assert thing.thread_name.startswith("celery-fence")
    # stopped (bounded) by the runtime's shutdown,
    began = time.monotonic()
    rt.shutdown(timeout=2.0)
    assert not thing.running and time.monotonic() - began < 3.0
    # and started again by its next use.
    _use(kind, thing)
    assert thing.running
    rt.shutdown(timeout=2.0)
    assert not thing.running


def test_the_watchdog_is_the_runtime_s(rt: Runtime) -> None:
    # Given this process's watchdog, its one per runtime
    assert watchdog() is watchdog() is rt.get("watchdog", None, Watchdog)
    # When the runtime is replaced (what a forked child gets)
    rt.reset()
    # Then the new runtime has a watchdog of its own
    assert watchdog() is not rt.get("watchdog", None, Watchdog)
