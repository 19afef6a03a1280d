"""The limit scenarios: a concurrency group (``group``) and a global rate limit (``rate``) across
real worker processes, with SIGKILLs of the processes running them. Their tasks are
:mod:`celery_fence.chaos.workload_limits`'; :mod:`celery_fence.chaos.checker_limits` checks
what they measured.

- ``group``: two workers of 4 pool processes each (8 processes) and :data:`GROUP_JOBS` jobs of
  one group with ``fence_group_limit=3``, each body 0.4-0.8 s. While they run, the harness
  SIGKILLs the pool process of a running attempt (it holds a slot) twice, and after each kill
  polls that slot's key until it is free: the seconds from the SIGKILL are the slot's way back
  (at most one TTL: its last renewal was at most one renewal interval before the kill). A
  sampler thread counts the attempts running (the ledger's running set, the killed ones
  removed at their kill) every :data:`SAMPLE_EVERY` s; the checker also counts the most body
  spans open at once in the ledger. Expected: never more than 3, each slot back within one TTL,
  every job completed once (the killed ones on a later attempt). Faults: the kills (2 a run).
  Control arm ``--no-group-limit``: the same group with no ``fence_group_limit``, only Celery's
  per-worker concurrency (8 processes): more than 3 at once, reported as ``limits broken``.
- ``rate``: three workers (``-c 1``), ``fence_rate_limit="2/s"`` shared by all of them, and more
  jobs queued than the window can take (bodies of 0.2 s); at the middle of the window the pool
  process of a running attempt is SIGKILLed. The checker counts the body starts in
  ``--duration`` seconds (default 60) from the first: within +/-10 % of the target. Faults: the
  kill (1 a run). Control arm ``--celery-rate-limit``: Celery's own ``rate_limit="2/s"``,
  which each worker applies on its own: about 3 times the rate, reported as ``limits broken``.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from typing import Any

from celery_fence.chaos.checker import Job
from celery_fence.chaos.scenario import Scenario
from celery_fence.chaos.workload_limits import GROUP, GROUPED_TASK, RATED_TASK, running_key
from celery_fence.leases.limits import slot_keys
from celery_fence.testing.workers import Worker

#: The group scenario's limit, jobs a run, worker processes (workers x pool size), kills a run.
GROUP_LIMIT = 3
GROUP_JOBS = 24
GROUP_WORKERS, GROUP_CONCURRENCY = 2, 4
GROUP_KILLS = 2
#: The rate scenario's limit (tasks a second), its workers, and its bodies' length.
RATE, RATE_PER_S = "2/s", 2.0
RATE_WORKERS = 3
RATE_BODY_S = 0.2
#: Seconds between two samples of the running set.
SAMPLE_EVERY = 0.02


def _send(s: Scenario, task: str, job: Job, **kwargs: Any) -> None:
    result = s.client.send_task(task, args=[job.key], kwargs=kwargs, queue=s.queue)
    job.task_ids.append(str(result.id))
    if not any(j is job for j in s.sent):
        s.sent.append(job)


def _workers(s: Scenario, count: int, concurrency: int, **env: str) -> list[Worker]:
    """This scenario's workers: started in its first run, kept for the next ones."""
    live = [w for w in s.workers if not w.exited]
    if len(live) >= count:
        return live
    started = [
        s.start_worker(f"{s.name}-{n}", concurrency=concurrency, **env)
        for n in range(len(live), count)
    ]
    for w in started:
        w.wait_ready()
    return live + started


def _running(s: Scenario) -> dict[str, int]:
    """The limited bodies running now: attempt id -> pid (the ledger's running set)."""
    raw = s.ledger.hgetall(running_key(s.ledger_prefix))
    return {_text(k): int(v) for k, v in raw.items()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _first_start(s: Scenario, keys: set[str], timeout: float) -> float:
    """The wall-clock time of the first body start of ``keys`` (waiting at most ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [float(e["t"]) for e in s.events() if e["ev"] == "start" and e["key"] in keys]
        if found:
            return min(found)
        time.sleep(0.05)
    raise TimeoutError(f"{s.name}: no body started in {timeout}s")


def _key_of(s: Scenario, attempt: str) -> str:
    found = [e for e in s.events() if e["ev"] == "start" and e.get("attempt") == attempt]
    return str(found[0]["key"]) if found else ""


class Sampler:
    """Counts the running set every :data:`SAMPLE_EVERY` seconds on a thread of its own."""

    def __init__(self, s: Scenario) -> None:
        self.s = s
        self.samples = 0
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-sampler", daemon=True)

    def _run(self) -> None:
        key = running_key(self.s.ledger_prefix)
        while not self._stop.wait(SAMPLE_EVERY):
            count = int(self.s.ledger.hlen(key))
            self.samples += 1
            self.most = max(self.most, count)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _kill_running(
    s: Scenario, rng: random.Random, keys: set[str], *, slots: list[str] | None, timeout: float
) -> dict[str, Any]:
    """SIGKILL the pool process of one running attempt of ``keys`` (wait for one, at most
    ``timeout`` s); with ``slots`` (the group's slot keys), poll the slot it held until it is
    free. The kill is written to the ledger (``killed``) and the attempt leaves the running
    set."""
    deadline = time.monotonic() + timeout
    while True:
        candidates = [(a, pid) for a, pid in _running(s).items() if _key_of(s, a) in keys]
        if candidates:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{s.name}: no attempt of this run was running in {timeout}s")
        time.sleep(0.01)
    attempt, pid = rng.choice(sorted(candidates))
    key = _key_of(s, attempt)
    held = None
    if slots:
        values = s.leases.mget(slots)
        held = next(
            (
                (k, v)
                for k, v in zip(slots, values, strict=True)
                if v and _text(v).startswith(f"{attempt}/slot:")
            ),
            None,
        )
    os.kill(pid, signal.SIGKILL)
    killed_at, killed_mono = time.time(), time.monotonic()
    s.ledger.hdel(running_key(s.ledger_prefix), attempt)
    entry = {"ev": "killed", "key": key, "gen": None, "attempt": attempt, "pid": pid}
    s.ledger.rpush(f"{s.ledger_prefix}:events", json.dumps({**entry, "t": killed_at}))
    back = None
    if held is not None:
        slot_key, value = held
        limit = time.monotonic() + s.opts.ttl * 4
        while s.leases.get(slot_key) == value and time.monotonic() < limit:
            time.sleep(0.01)
        back = time.monotonic() - killed_mono
    return {"attempt": attempt, "key": key, "t": killed_at, "slot_back_s": back}


def run_group(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    enforced = not s.opts.no_group_limit
    _workers(
        s,
        GROUP_WORKERS,
        GROUP_CONCURRENCY,
        CHAOS_GROUP_LIMIT=str(GROUP_LIMIT if enforced else 0),
    )
    jobs = [Job(s.key(i, str(n))) for n in range(GROUP_JOBS)]
    keys = {j.key for j in jobs}
    slots = slot_keys(s.prefix, GROUP, GROUP_LIMIT) if enforced else None
    kills = []
    with Sampler(s) as sampler:
        started = time.monotonic()
        for job in jobs:
            _send(s, GROUPED_TASK, job, sleep=rng.uniform(0.4, 0.8))
        for _ in range(GROUP_KILLS):
            time.sleep(rng.uniform(0.2, 0.6))
            kills.append(_kill_running(s, rng, keys, slots=slots, timeout=30))
        elapsed = s.converge(jobs, started)
    s.measures.setdefault("group", []).append(
        {
            "run": i,
            "limit": GROUP_LIMIT,
            "enforced": enforced,
            "ttl": s.opts.ttl,
            "keys": sorted(keys),
            "samples": sampler.samples,
            "samples_max": sampler.most,
            "kills": kills,
        }
    )
    return len(kills), elapsed


def run_rate(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    celery_rate = s.opts.celery_rate_limit
    workers = _workers(
        s,
        RATE_WORKERS,
        1,
        CHAOS_RATE=RATE,
        CHAOS_CELERY_RATE="1" if celery_rate else "0",
    )
    duration = s.opts.duration
    # more than the window can take: the fence's rate, or Celery's per worker times the workers
    ceiling = RATE_PER_S * (len(workers) if celery_rate else 1)
    jobs = [Job(s.key(i, str(n))) for n in range(math.ceil(ceiling * duration * 1.15) + 6)]
    keys = {j.key for j in jobs}
    started = time.monotonic()
    for job in jobs:
        _send(s, RATED_TASK, job, sleep=RATE_BODY_S)
    t0 = _first_start(s, keys, timeout=60)
    time.sleep(max(0.0, t0 + duration * rng.uniform(0.4, 0.6) - time.time()))
    kills = [_kill_running(s, rng, keys, slots=None, timeout=30)]
    time.sleep(max(0.0, t0 + duration - time.time()))
    elapsed = s.converge(jobs, started)
    s.measures.setdefault("rate", []).append(
        {
            "run": i,
            "rate": RATE,
            "target_per_s": RATE_PER_S,
            "duration": duration,
            "workers": len(workers),
            "celery_rate_limit": celery_rate,
            "keys": sorted(keys),
            "kills": kills,
        }
    )
    return len(kills), elapsed


RUNS = {"group": run_group, "rate": run_rate}
