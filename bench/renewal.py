"""``--renewal``: renewal round trips with many leases held by one worker process.

One worker on the threads pool runs ``leases`` long tasks at once (default 50). Once every lease
is live, the lease Redis is watched for a window: its ``total_reads_processed`` (the server's
view of round trips) and ``evalsha`` calls, and the worker's own sends from background threads
(``BENCH_TRACE=1``). celery-fence renews every lease of the process in one pipelined round trip
per interval; python-redis-lock's ``Lock(auto_renewal=True)`` runs one thread, and one round trip,
per lock.
"""

from __future__ import annotations

import time
from typing import Any

from bench import trace
from bench.harness import BenchWorker, RedisCounter, Services, pending, publish
from bench.report import table
from bench.servers import wait_for

TTL = 3.0
RENEW = 0.5  # celery-fence's renewal interval in this mode
RLOCK_INTERVAL = TTL * 2 / 3  # python-redis-lock renews at 2/3 of its expiry
WINDOW = 8.0
HOLD = 14.0


def run(svc: Services, *, leases: int, loglevel: str, out: Any) -> dict[str, Any]:
    control, broker = svc.control(), svc.broker()
    lease_client = svc.lease_redis.client()
    counter = RedisCounter(lease_client)
    trace_dir = str(svc.workdir / "trace")
    worker = BenchWorker(
        svc.worker_env(BENCH_TRACE="1", BENCH_TTL=str(TTL), BENCH_RENEW=str(RENEW)),
        queue=svc.queue,
        log_dir=svc.workdir,
        pool="threads",
        concurrency=leases,
        loglevel=loglevel,
    )
    result: dict[str, Any] = {"leases": leases, "window_s": WINDOW, "worker_command": ""}
    result["worker_command"] = " ".join(worker.command()[1:])
    worker.start_answering(control)
    try:
        for name, task, pattern, interval in (
            ("celery-fence", "bench.fenced_pg", "bench:*:lease", RENEW),
            ("python-redis-lock", "bench.rlock", "lock:rlock:*", RLOCK_INTERVAL),
        ):
            run_id = f"{name}-{time.monotonic_ns()}"
            publish(control, task, [f"{run_id}:{i}" for i in range(leases)], svc.queue, HOLD)

            def held(pattern: str = pattern) -> bool:
                return sum(1 for _ in lease_client.scan_iter(match=pattern, count=1000)) >= leases

            wait_for(held, 60, f"{leases} live {name} leases")
            r0, t0 = counter.snapshot(), trace.read_all(trace_dir)
            time.sleep(WINDOW)
            r1, t1 = counter.snapshot(), trace.read_all(trace_dir)
            d = RedisCounter.delta(r0, r1)
            intervals = WINDOW / interval
            scripts = d["evalsha"] + d["eval"]
            sends = t1["redis:off"] - t0["redis:off"]
            result[name] = {
                "interval_s": interval,
                "intervals": intervals,
                "renewal_scripts": scripts,
                "renewals_per_lease": scripts / leases,
                "client_round_trips": sends,
                "round_trips_per_interval": sends / intervals,
                "round_trips_per_lease_renewal": sends / (scripts / leases) if scripts else 0.0,
                "server_reads_per_interval": d["_reads"] / intervals,
                "task_thread_sends_in_window": t1["redis:critical"] - t0["redis:critical"],
            }
            wait_for(lambda: not pending(broker, svc.queue), HOLD + 60, "long tasks to finish")
    finally:
        worker.stop()
    print(f"# worker: {result['worker_command']}", file=out)
    print(
        f"\n## renewal traffic: {leases} concurrent long tasks, one worker process (threads pool), "
        f"{WINDOW:g} s window",
        file=out,
    )
    rows = []
    for name in ("celery-fence", "python-redis-lock"):
        r = result[name]
        rows.append(
            [
                name,
                r["interval_s"],
                f"{r['renewals_per_lease']:.1f}",
                f"{r['client_round_trips']:.0f}",
                r["round_trips_per_interval"],
                r["round_trips_per_lease_renewal"],
                r["server_reads_per_interval"],
            ]
        )
    headers = [
        "library",
        "interval s",
        "renewals/lease",
        "round trips",
        "RTs/interval",
        "RTs per renewal of all leases",
        "server reads/interval",
    ]
    print(table(headers, rows), file=out)
    print(
        "round trips: sends to the lease Redis from the worker's background threads "
        "(BENCH_TRACE=1); renewals/lease: renewal scripts Redis ran in the window / leases held; "
        "server reads: total_reads_processed delta (a large pipeline may arrive in two reads).",
        file=out,
    )
    return result
