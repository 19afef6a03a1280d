"""``python -m bench --enqueue``: what a durable enqueue costs the caller.

Three ways a request handler creates an order and its job, on the bench's PostgreSQL and broker,
each timed per job in the caller (no worker runs: only the caller's cost is measured):

- ``delay``: ``task.delay()`` alone (no data written; the floor);
- ``commit-then-delay``: insert the order, commit, then ``task.delay()`` — what most apps do,
  and the job is lost if the process dies between the two;
- ``enqueue``: insert the order and :func:`celery_fence.enqueue` the job in the same transaction;
  the message goes after the commit, and recovery sends it if it never left;
- ``enqueue-unique``: the same with ``unique=`` a key of its own (the job's row carries the
  uniqueness key, which the partial unique index checks): what a unique job costs per enqueue;
- ``unique-duplicate``: the same with ``unique=`` a key an unfinished job already holds: the
  enqueue returns that job (its row read back), nothing is published.

The variants alternate within each round; the table gives per-job latency percentiles over all
rounds and the ratio of medians to ``commit-then-delay``.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from celery import Celery

from bench.harness import Services
from bench.report import table
from celery_fence import FencedTask, enqueue

VARIANTS = ("delay", "commit-then-delay", "enqueue", "enqueue-unique", "unique-duplicate")


def _app(svc: Services) -> tuple[Celery, Any]:
    app = Celery("bench_enqueue", broker=svc.broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=f"{svc.queue}-enqueue",
        fence_redis_url=svc.lease_redis.url,
        fence_database_url=svc.pg_url,
    )

    @app.task(base=FencedTask, bind=True, shared=False, fence_key=lambda order: f"ship:{order}")
    def ship(self: Any, order: str) -> None:  # never run here: only sent
        return None

    return app, ship


def run(svc: Services, *, jobs: int, rounds: int, out: Any) -> dict[str, Any]:
    app, ship = _app(svc)
    engine = sa.create_engine(svc.pg_url, pool_size=2)
    orders = sa.Table(
        f"bench_orders_{uuid.uuid4().hex[:6]}",
        sa.MetaData(),
        sa.Column("id", sa.String(64), primary_key=True),
    )
    orders.create(engine)

    def order_then_delay(order: str) -> None:
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=order))
        ship.delay(order)

    def order_and_enqueue(order: str) -> None:
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=order))
            enqueue(conn, ship, args=(order,))

    def order_and_enqueue_unique(order: str) -> None:
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=order))
            enqueue(conn, ship, args=(order,), unique=f"ship-once:{order}")

    held = f"ship-held:{uuid.uuid4().hex}"  # one unfinished job holds it for the whole run
    with engine.begin() as conn:
        enqueue(conn, ship, args=(held,), unique=held)

    def order_and_duplicate(order: str) -> None:
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=order))
            enqueue(conn, ship, args=(order,), unique=held)

    calls: dict[str, Callable[[str], Any]] = {
        "delay": ship.delay,
        "commit-then-delay": order_then_delay,
        "enqueue": order_and_enqueue,
        "enqueue-unique": order_and_enqueue_unique,
        "unique-duplicate": order_and_duplicate,
    }
    for call in calls.values():  # warm the pools and caches
        for _ in range(20):
            call(uuid.uuid4().hex)
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            call = calls[name]
            for _ in range(jobs):
                order = uuid.uuid4().hex
                start = time.perf_counter()
                call(order)
                samples[name].append((time.perf_counter() - start) * 1e6)
    base = statistics.median(samples["commit-then-delay"])
    rows = []
    result: dict[str, Any] = {"jobs": jobs, "rounds": rounds, "variants": {}}
    for name in VARIANTS:
        values = sorted(samples[name])
        p50, p99 = values[len(values) // 2], values[int(len(values) * 0.99)]
        result["variants"][name] = {"p50_us": p50, "p99_us": p99, "ratio": p50 / base}
        rows.append((name, p50, p99, p50 / base))
    print(
        f"## Durable enqueue: caller latency per job ({jobs} jobs x {rounds} rounds, "
        "PostgreSQL, Redis broker)",
        file=out,
    )
    print(table(("variant", "p50 µs", "p99 µs", "p50 / commit-then-delay"), rows), file=out)
    orders.drop(engine)
    engine.dispose()
    app.close()
    return result
