"""Three real ``celery beat`` replicas and a worker: with ``-S celery_fence.beat:Scheduler`` every
tick of a 1-second entry runs exactly once, the ticks the broker lost before any worker took them
too, while the Redis restarts and one replica is SIGKILLed; with plain ``celery beat`` (the
control arm) each tick runs about three times.

The body appends its fence key to a ledger list on the shared test Redis. The broker (db 1) and
the lease store (db 0) are a private ``redis-server`` of the test's own, without persistence, so
its restart loses every queued message, lease and generation, and touches no other test.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_fence.store import Store
from celery_fence.testing.redis_server import RedisServer, redis_server_binary
from celery_fence.testing.workers import BeatReplica
from tests.support import ledger
from tests.support.env import REDIS_URL
from tests.support.worker import ROOT, Worker, app_worker, wait_until

APP = "tests.support.beat_app"
pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is missing")


def _beat(env: dict[str, str], log_dir: Path, name: str, *, fenced: bool) -> BeatReplica:
    environ = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    return BeatReplica(APP, env=environ, name=name, log_dir=log_dir, fenced=fenced, cwd=ROOT)


@pytest.fixture
def lease_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def beat_env(prefix: str, pg_url: str, lease_redis: RedisServer) -> dict[str, str]:
    return {
        "FENCE_T_PREFIX": prefix,
        "FENCE_T_QUEUE": f"{prefix}-beat",
        "FENCE_T_BROKER": lease_redis.url_for(1),
        "FENCE_T_REDIS": lease_redis.url_for(0),
        "FENCE_T_LEDGER": REDIS_URL,
        "FENCE_T_DB": pg_url,
        # the entry's name is the test's own, so its row in fence_beat_ticks is too
        "FENCE_T_BEAT_ENTRY": f"tick-{prefix}",
        # a tick all three replicas reach late (a starved machine) is caught up, not skipped
        "FENCE_T_BEAT_MISSED": "catch_up",
        # a tick's job whose message the broker lost is re-sent by the workers' recovery
        "FENCE_T_RECOVER_PENDING_AFTER": "1",
    }


def _runs(client: redis.Redis, prefix: str) -> list[str]:
    return ledger.entries(client, f"{prefix}:beat-runs")


def _queued_keys(server: RedisServer, queue: str) -> set[str]:
    """The ``fence_key`` header of every message waiting in ``queue`` on the broker (db 1)."""
    client = redis.Redis.from_url(server.url_for(1))
    try:
        return {json.loads(m)["headers"]["fence_key"] for m in client.lrange(queue, 0, -1)}
    finally:
        client.close()


def _tick_time(key: str) -> dt.datetime:
    """The scheduled time in ``beat:<entry>:<YYYY-MM-DDTHH:MM:SSZ>`` (naive UTC)."""
    return dt.datetime.strptime(key.split(":", 2)[2], "%Y-%m-%dT%H:%M:%SZ")


def _worker(env: dict[str, str], tmp_path: Path) -> Worker:
    worker = app_worker(
        APP,
        env=env,
        queue=env["FENCE_T_QUEUE"],
        name=f"beat-{uuid.uuid4().hex[:6]}",
        log_dir=tmp_path,
        concurrency=2,
    )
    worker.start()
    return worker


def _settle(client: redis.Redis, prefix: str) -> list[str]:
    """The ledger once no run was added for 3 s (the worker drained the queue)."""
    last: list[int] = [-1]
    stable_since = [time.monotonic()]

    def quiet() -> bool:
        n = len(_runs(client, prefix))
        if n != last[0]:
            last[0], stable_since[0] = n, time.monotonic()
        return time.monotonic() - stable_since[0] > 3.0

    wait_until(quiet, 30, interval=0.2, what="the worker to drain the ticks")
    return _runs(client, prefix)


def test_three_fenced_replicas_run_every_tick_once_through_lost_ticks_a_restart_and_a_kill(
    beat_env: dict[str, str],
    redis_client: redis.Redis,
    prefix: str,
    lease_redis: RedisServer,
    pg_url: str,
    tmp_path: Path,
) -> None:
    # Given three fenced replicas sending ticks, and no worker yet
    queue, entry = beat_env["FENCE_T_QUEUE"], beat_env["FENCE_T_BEAT_ENTRY"]
    beats = [_beat(beat_env, tmp_path, f"r{i}", fenced=True) for i in range(3)]
    worker = None
    try:
        wait_until(lambda: len(_queued_keys(lease_redis, queue)) >= 2, 60, what="2 ticks queued")
        lost = _queued_keys(lease_redis, queue)
        # When the Redis restarts empty before any worker took those ticks (every queued
        # message, lease and generation lost), a worker starts while the replicas go on ...
        lease_redis.restart()
        assert _queued_keys(lease_redis, queue) == set()
        worker = _worker(beat_env, tmp_path)
        wait_until(lambda: _runs(redis_client, prefix), 30, what="a tick to run")
        beats[0].kill()  # ... and one replica is SIGKILLed mid-run
        time.sleep(3)
    finally:
        for beat in beats:
            beat.stop()
    try:
        runs = _settle(redis_client, prefix)
    finally:
        if worker is not None:
            worker.stop()
    # Then every tick ran exactly once, the lost ones too (re-sent by recovery), none missing
    # (one key per scheduled second: a replica's copy under a key of its own would be an extra)
    counts = collections.Counter(run.split(" ")[1] for run in runs)
    assert all(n == 1 for n in counts.values()), {k: n for k, n in counts.items() if n > 1}
    assert lost <= set(counts), f"lost ticks never ran: {sorted(lost - set(counts))}"
    ticks = sorted(_tick_time(k) for k in counts)
    seconds = int((ticks[-1] - ticks[0]).total_seconds()) + 1
    assert len(ticks) == seconds >= 5, f"a tick was lost: {len(ticks)} ran in {seconds} s"
    assert all(k.startswith(f"beat:{entry}:") for k in counts)
    # And the store agrees: one completed job per tick, one execution each, the last recorded
    store = Store(pg_url)
    try:
        jobs = store.admin.list_jobs(task_name="beat_tests.tick", limit=1000)
        last = store.beat_ticks.last(entry)
    finally:
        store.dispose()
    mine = {j.key: j for j in jobs if j.key.startswith(f"beat:{entry}:")}
    assert set(mine) == set(counts)
    assert all(j.status == "completed" and j.attempts == 1 for j in mine.values())
    assert last is not None and last.replace(tzinfo=None) == ticks[-1]


def test_control_three_plain_beats_run_each_tick_about_three_times(
    beat_env: dict[str, str], redis_client: redis.Redis, prefix: str, tmp_path: Path
) -> None:
    worker = _worker(beat_env, tmp_path)
    beats = [_beat(beat_env, tmp_path, f"p{i}", fenced=False) for i in range(3)]
    try:
        wait_until(lambda: len(_runs(redis_client, prefix)) >= 3, 60, what="the first ticks")
        started = time.monotonic()
        start_runs = len(_runs(redis_client, prefix))
        time.sleep(4)
        window = time.monotonic() - started
    finally:
        for beat in beats:
            beat.stop()
    try:
        runs = _settle(redis_client, prefix)
    finally:
        worker.stop()
    assert len({run.split(" ")[1] for run in runs}) == len(runs)  # every message its own key
    ran = len(runs) - start_runs
    assert ran >= 2 * window, f"{ran} runs in {window:.1f} s of 1-second ticks from 3 beats"
