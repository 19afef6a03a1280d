"""``python -m bench --steps``: what a fenced step and a checkpoint cost the task body.

One registered attempt on the bench's PostgreSQL (no worker runs: only the body's cost is
measured), each variant timed per call in the body's process:

- ``block``: ``with fence.transaction() as conn:`` one insert (the floor: a fenced block);
- ``step``: the same insert as ``fence.run_step()`` (the block, the boundary read, the step row);
- ``step-replay``: ``fence.run_step()`` of a step that completed (the read alone, nothing run);
- ``checkpoint``: ``fence.checkpoint()`` on its own (a block of its own with the upsert);
- ``block+checkpoint``: the insert and a checkpoint in one block (a batch and its progress).

The variants alternate within each round; the table gives per-call percentiles over all rounds
and the ratio of medians to ``block``.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from bench.report import table
from celery_fence.body.fence import Fence
from celery_fence.leases.lease import HeldLease
from celery_fence.store import Store

VARIANTS = ("block", "step", "step-replay", "checkpoint", "block+checkpoint")


def attempt(store: Store, key: str) -> Fence:
    """A registered attempt (generation 1) with a long local lease, as a worker builds it."""
    attempt_id = uuid.uuid4().hex
    store.register(key, generation=1, attempt_id=attempt_id, task_name="bench.steps")
    lease = HeldLease(
        key=key,
        lease_key=f"bench:{key}",
        token=attempt_id,
        generation=1,
        ttl=600.0,
        interval=200.0,
        margin=0.1,
        claimed_at=time.monotonic(),
    )
    return Fence(key=key, attempt_id=attempt_id, generation=1, attempts=1, lease=lease, store=store)


def measure(url: str, *, ops: int, rounds: int) -> dict[str, Any]:
    """The samples (µs per call) of each variant on the database at ``url``."""
    store = Store(url)
    store.create_schema()
    rows = sa.Table(
        f"bench_step_rows_{uuid.uuid4().hex[:6]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("n", sa.Integer, nullable=False),
    )
    rows.create(store.engine)
    fence = attempt(store, f"bench-steps-{uuid.uuid4().hex[:8]}")
    count = iter(range(10**9))
    fence.run_step("replayed", lambda: {"done": True})

    def insert() -> int:
        n = next(count)
        with fence.transaction() as conn:
            conn.execute(rows.insert().values(n=n))
        return n

    def block_and_checkpoint() -> None:
        n = next(count)
        with fence.transaction() as conn:
            conn.execute(rows.insert().values(n=n))
            fence.checkpoint({"next": n})

    calls: dict[str, Callable[[], Any]] = {
        "block": insert,
        "step": lambda: fence.run_step(f"s{next(count)}", insert),
        "step-replay": lambda: fence.run_step("replayed", insert),
        "checkpoint": lambda: fence.checkpoint({"next": next(count)}),
        "block+checkpoint": block_and_checkpoint,
    }
    for call in calls.values():  # warm the pool and the statement caches
        for _ in range(min(ops, 20)):
            call()
    samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name in VARIANTS:
            call = calls[name]
            for _ in range(ops):
                start = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - start) * 1e6)
    rows.drop(store.engine)
    store.dispose()
    return samples


def run(svc: Any, *, ops: int, rounds: int, out: Any) -> dict[str, Any]:
    return report(measure(svc.pg_url, ops=ops, rounds=rounds), ops=ops, rounds=rounds, out=out)


def report(
    samples: dict[str, list[float]],
    *,
    ops: int,
    rounds: int,
    out: Any,
    database: str = "PostgreSQL",
) -> dict[str, Any]:
    base = statistics.median(samples["block"])
    result: dict[str, Any] = {"ops": ops, "rounds": rounds, "variants": {}}
    lines = []
    for name in VARIANTS:
        values = sorted(samples[name])
        p50, p99 = values[len(values) // 2], values[int(len(values) * 0.99)]
        result["variants"][name] = {"p50_us": p50, "p99_us": p99, "ratio": p50 / base}
        lines.append((name, p50, p99, p50 / base))
    print(
        f"## Fenced steps and checkpoints: body latency per call ({ops} calls x {rounds} rounds, "
        f"{database})",
        file=out,
    )
    print(table(("variant", "p50 µs", "p99 µs", "p50 / block"), lines), file=out)
    return result
