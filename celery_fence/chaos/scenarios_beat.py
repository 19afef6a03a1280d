"""The ``beat`` scenario: three ``celery beat -S celery_fence.beat:Scheduler`` replicas of one
1-second entry (:data:`~celery_fence.chaos.workload_unique.TICK_TASK`), one replica SIGKILLed
right as a tick's body starts, then the lease Redis (a ``redis-server`` the scenario starts for
itself, the worker's lease store) SIGKILLed and restarted empty, while ticks go on.

Checked: every scheduled second between the first tick that ran and the last one has its tick's
job (``beat:<entry>:<time>``), completed exactly once (the store's history, the ledger's
witness); a scheduled second without one is a lost job (the entry's policy is ``catch_up``:
nothing may be skipped). Ticks that ran in the same second under keys of their own are counted
as duplicate completions. Faults: the replica killed and the Redis restart (2 a run).

``--stock-beat`` (the control arm): the same three replicas run Celery's stock
``PersistentScheduler`` (each its own schedule file): each sends every tick, each copy a job of
its own, so each second's tick completes about three times: duplicate completions.
"""

from __future__ import annotations

import collections
import datetime as dt
import os
import random
import time
from typing import Any

from celery_fence.chaos.checker import Job
from celery_fence.chaos.scenario import WORKLOAD_APP, Scenario
from celery_fence.store.beat import tick_key
from celery_fence.testing.groups import register_closer
from celery_fence.testing.redis_server import RedisServer
from celery_fence.testing.waiting import poll_until
from celery_fence.testing.workers import BeatReplica, Worker

#: Beat replicas a run starts.
REPLICAS = 3
#: Seconds the ticks go on after the lease Redis restarted.
AFTER_RESTART = 4.0
#: Seconds without a new tick after which the worker has drained what the replicas sent.
QUIET = 3.0
#: The scenario's own lease Redis and its worker, per scenario run id (started by the first run).
_WORLDS: dict[str, tuple[RedisServer, Worker]] = {}


def _world(s: Scenario) -> tuple[RedisServer, Worker]:
    """The scenario's lease Redis and its worker (started once, kept for every run)."""
    if s.run_id not in _WORLDS:
        lease_redis = RedisServer(s.workdir).start()
        register_closer(lease_redis.stop)
        worker = s.start_worker("beat", concurrency=2, CHAOS_REDIS_URL=lease_redis.url)
        _WORLDS[s.run_id] = (lease_redis, worker.wait_ready())
    return _WORLDS[s.run_id]


def run_beat(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Three replicas; one SIGKILLed as a tick starts; the lease Redis restarted; ticks go on."""
    lease_redis, _ = _world(s)
    entry = f"tick-{s.run_id}-{i}"
    env = {**os.environ, **s.env(), "CHAOS_REDIS_URL": lease_redis.url, "CHAOS_BEAT_ENTRY": entry}
    replicas = [
        BeatReplica(
            WORKLOAD_APP,
            env=env,
            name=f"{entry}-r{n}",
            log_dir=s.workdir,
            fenced=not s.opts.stock_beat,
            cwd=s.workdir,
        )
        for n in range(REPLICAS)
    ]
    try:
        if not poll_until(lambda: len(_starts(s, entry)) >= 2, 60, interval=0.1):
            raise RuntimeError(f"beat: no two ticks of {entry} ran within 60s")
        seen = len(_starts(s, entry))
        poll_until(lambda: len(_starts(s, entry)) > seen, 10, interval=0.01)
        rng.choice(replicas).kill()  # as a tick's body starts (and its sends are recorded)
        time.sleep(rng.uniform(1.0, 2.0))
        lease_redis.restart()  # every lease and generation counter lost
        time.sleep(AFTER_RESTART)
    finally:
        for replica in replicas:
            replica.stop()
    stopped = time.monotonic()
    _drain(s, entry)
    ran = _starts(s, entry)
    keys = list(dict.fromkeys(e["key"] for e in ran))
    jobs = [Job(key) for key in keys]
    elapsed = s.converge(jobs, stopped)
    if s.opts.stock_beat:
        _count_copies(jobs, ran)
    else:
        _check_ticks(s, entry, jobs)
    if not s.opts.quiet:
        seconds = len({int(e["t"]) for e in ran})
        print(f"  beat run {i + 1}: {len(ran)} tick bodies ran, {len(keys)} jobs, {seconds} s")
    return 2, elapsed


def _starts(s: Scenario, entry: str) -> list[dict[str, Any]]:
    return [e for e in s.events() if e["ev"] == "start" and e.get("entry") == entry]


def _drain(s: Scenario, entry: str) -> None:
    """Wait (bounded by the converge timeout) until no tick of ``entry`` started for
    :data:`QUIET` seconds: the worker ran what the replicas sent."""
    last = [-1, time.monotonic()]

    def quiet() -> bool:
        n = len(_starts(s, entry))
        if n != last[0]:
            last[0], last[1] = n, time.monotonic()
        return time.monotonic() - last[1] > QUIET

    poll_until(quiet, s.opts.converge_timeout, interval=0.2)


def _scheduled(entry: str, key: str) -> dt.datetime | None:
    prefix = f"beat:{entry}:"
    if not key.startswith(prefix):
        return None
    return dt.datetime.strptime(key[len(prefix) :], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=dt.timezone.utc
    )


def _check_ticks(s: Scenario, entry: str, jobs: list[Job]) -> None:
    """Every tick's job under its tick key; every scheduled second between the first and the
    last one present (a missing one: a lost job, never converged)."""
    times = {}
    for job in jobs:
        when = _scheduled(entry, job.key)
        if when is None:
            job.observed.append(f"a tick of {entry} ran under a key that is not a tick's")
        else:
            times[when] = job
    if not times:
        return
    first, last = min(times), max(times)
    when = first
    while when <= last:
        if when not in times:
            lost = Job(tick_key(entry, when))
            lost.observed.append("no replica's tick of this scheduled time ran")
            s.sent.append(lost)
            s.jobs.append(lost)
        when += dt.timedelta(seconds=1)


def _count_copies(jobs: list[Job], ran: list[dict[str, Any]]) -> None:
    """The stock scheduler's copies: the jobs whose bodies started in the same second are one
    tick's copies; the first of each second carries the others as extra completions."""
    by_second: dict[int, list[str]] = collections.defaultdict(list)
    for e in ran:
        if e["key"] not in by_second[int(e["t"])]:
            by_second[int(e["t"])].append(e["key"])
    by_key = {job.key: job for job in jobs}
    for keys in by_second.values():
        by_key[keys[0]].extra_completions += len(keys) - 1


RUNS = {"beat": run_beat}
