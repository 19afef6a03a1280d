"""``--memory``: one worker child's RSS over many fenced no-op tasks (default 100,000).

The worker runs with one prefork child (``-c 1``) so that every task passes through the process
being sampled. Messages are published in chunks while it consumes; the child's ``VmRSS`` is read
from ``/proc/<pid>/status`` every 2 s. Growth is measured from a baseline taken after the first
5,000 tasks (imports, pools and caches warmed up). At the end, the lease Redis must hold no lease.

The lease Redis (a private server) is sampled too: its key count (``DBSIZE``) and ``used_memory``,
before the first task and at every sample. Every distinct key leaves a generation counter that
expires ``fence_generation_ttl`` after its last claim (default 600 s), so the key count levels
off at about (tasks per second x that lifetime); counters without an expiry are counted apart
(``gen_without_ttl``: 0 unless counters never expire).
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

from bench.harness import BenchWorker, Services, pending, publish, rss_kib
from bench.servers import wait_for

CHUNK = 5000
WARM = 5000


def _child_rss(child: int) -> int:
    """The pool child's RSS, KiB; an error when it is gone (a replaced child would read 0)."""
    rss = rss_kib(child)
    if rss == 0:
        raise RuntimeError(f"pool child {child} is gone (replaced?): its RSS cannot be followed")
    return rss


def run(svc: Services, *, tasks: int, loglevel: str, out: Any) -> dict[str, Any]:
    control, broker = svc.control(), svc.broker()
    worker = BenchWorker(
        svc.worker_env(), queue=svc.queue, log_dir=svc.workdir, concurrency=1, loglevel=loglevel
    )
    worker.start_answering(control)
    samples: list[tuple[int, int]] = []  # (tasks done, RSS KiB)
    redis_samples: list[tuple[int, int, int]] = []  # (tasks done, keys, used_memory bytes)
    lease_client = svc.lease_redis.client()

    def redis_state() -> tuple[int, int]:
        return int(lease_client.dbsize()), int(lease_client.info("memory")["used_memory"])

    redis_before = redis_state()
    published = 0
    started = time.monotonic()
    try:
        children = worker.children()
        if len(children) != 1:
            raise RuntimeError(f"expected one pool child, found {children}")
        child = children[0]
        print(f"# worker: {' '.join(worker.command()[1:])}  (child pid {child})", file=out)
        print(f"{'tasks done':>11}{'RSS KiB':>10}{'redis keys':>12}{'used_memory':>14}", file=out)
        next_sample = 0.0
        while True:
            waiting = pending(broker, svc.queue)
            done = published - waiting
            if published < tasks and waiting < CHUNK:
                n = min(CHUNK, tasks - published)
                publish(
                    control,
                    "bench.fenced_pg",
                    [f"m{published + i}" for i in range(n)],
                    svc.queue,
                    0.0,
                )
                published += n
            if time.monotonic() >= next_sample:
                rss = _child_rss(child)
                samples.append((done, rss))
                redis_samples.append((done, *redis_state()))
                if len(samples) % 10 == 1:
                    keys, used = redis_samples[-1][1:]
                    print(f"{done:>11}{rss:>10}{keys:>12}{used:>14}", file=out, flush=True)
                next_sample = time.monotonic() + 2.0
            if published >= tasks and waiting == 0:
                break
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        time.sleep(1.0)  # the last releases
        samples.append((tasks, _child_rss(child)))
        redis_end = redis_state()
        redis_samples.append((tasks, *redis_end))
        print(f"{tasks:>11}{samples[-1][1]:>10}{redis_end[0]:>12}{redis_end[1]:>14}", file=out)
        gen_without_ttl = sum(
            1
            for k in lease_client.scan_iter(match="bench:*:gen", count=1000)
            if lease_client.pttl(k) == -1
        )
        wait_for(
            lambda: not any(True for _ in lease_client.scan_iter(match="bench:*:lease")),
            10,
            "every lease released",
        )
        engine = sa.create_engine(svc.pg_url, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            completed = conn.exec_driver_sql(
                "SELECT count(*) FROM fence_jobs WHERE status = 'completed' AND key LIKE 'm%%'"
            ).scalar_one()
        engine.dispose()
    finally:
        worker.stop()
    after_warm = [s for s in samples if s[0] >= WARM] or samples
    baseline = after_warm[0][1]
    half = [s for s in samples if s[0] >= tasks // 2] or samples
    result = {
        "tasks": tasks,
        "seconds": elapsed,
        "rss_baseline_kib": baseline,
        "rss_end_kib": samples[-1][1],
        "rss_max_kib": max(s[1] for s in after_warm),
        "growth_kib": samples[-1][1] - baseline,
        "growth_second_half_kib": samples[-1][1] - half[0][1],
        "completed_rows": completed,
        "leases_left": 0,
        "redis_keys_before": redis_before[0],
        "redis_used_memory_before": redis_before[1],
        "redis_keys_end": redis_end[0],
        "redis_used_memory_end": redis_end[1],
        "redis_keys_max": max(r[1] for r in redis_samples),
        "gen_without_ttl": gen_without_ttl,
        "samples": samples,
        "redis_samples": redis_samples,
    }
    print(
        f"\n## memory: {tasks} fenced no-op tasks in one worker child ({elapsed:.0f} s)\n"
        f"RSS after {WARM} tasks {baseline} KiB, max {result['rss_max_kib']} KiB, end "
        f"{result['rss_end_kib']} KiB: growth {result['growth_kib']} KiB "
        f"({result['growth_second_half_kib']} KiB over the second half); "
        f"{completed} jobs completed; leases left in Redis: 0\n"
        f"lease Redis: {redis_before[0]} keys / {redis_before[1]} B used before, "
        f"{redis_end[0]} keys / {redis_end[1]} B at the end (max {result['redis_keys_max']} keys); "
        f"generation counters without an expiry: {gen_without_ttl}",
        file=out,
    )
    return result
