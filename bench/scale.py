"""``--scale``: the store's register + complete latency as ``fence_jobs`` grows to 10^6 rows.

For each size, completed jobs (and two transition rows each, as the hot path leaves them) are
bulk-inserted with ``INSERT ... SELECT generate_series`` and the tables analyzed; then
``samples`` fresh keys are registered and completed through :class:`~celery_fence.store.Store`
one after the other, each call timed. ``EXPLAIN`` shows the plans of the two statements as the
hot path sends them (with the transition-record CTE). Finally ``purge`` deletes the bulk rows
(finished two days ago) and the table is back to the fresh jobs only.
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.harness import Services
from bench.report import table
from celery_fence.actions import Action
from celery_fence.store import Store
from celery_fence.store import sql as statements


def _bulk(conn: sa.Connection, start: int, stop: int) -> None:
    conn.exec_driver_sql(
        "INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, "
        "result, created_at, updated_at, finished_at) "
        "SELECT 'bulk:' || g, 'bench.fenced_pg', 'completed', 1, md5(g::text), 1, 'null'::jsonb, "
        "now() - interval '2 days', now() - interval '2 days', now() - interval '2 days' "
        f"FROM generate_series({start}, {stop - 1}) AS g"
    )
    conn.exec_driver_sql(
        "INSERT INTO fence_transitions (key, generation, attempt_id, action, reason, at) "
        "SELECT 'bulk:' || g, 1, md5(g::text), a, NULL, now() - interval '2 days' "
        f"FROM generate_series({start}, {stop - 1}) AS g, "
        "unnest(ARRAY['claimed', 'completed']) AS a"
    )
    conn.exec_driver_sql("ANALYZE fence_jobs")
    conn.exec_driver_sql("ANALYZE fence_transitions")


def _explain(conn: sa.Connection, sql: str, params: dict[str, Any]) -> list[str]:
    """The executed plan (``EXPLAIN ANALYZE``) inside a transaction that is rolled back."""
    conn.exec_driver_sql("BEGIN")
    try:
        rows = conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY OFF) " + sql, params
        ).all()
    finally:
        conn.exec_driver_sql("ROLLBACK")
    return [r[0] for r in rows]


def _index(plan: list[str]) -> str:
    """The index the plan reads fence_jobs by (or the conflict arbiter of an upsert)."""
    for line in plan:
        text = line.strip()
        if text.startswith("Conflict Arbiter Indexes:"):
            return text.split(":", 1)[1].strip()
        if " using " in text and " on fence_jobs" in text:
            return text.split(" using ", 1)[1].split(" on ", 1)[0]
        if text.startswith("->  Seq Scan on fence_jobs") or text.startswith(
            "Seq Scan on fence_jobs"
        ):
            return "SEQ SCAN"
    return "?"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(svc: Services, *, sizes: list[int], samples: int, out: Any) -> dict[str, Any]:
    store = Store(svc.pg_url)
    engine = sa.create_engine(svc.pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    params = {
        "task_name": "bench.fenced_pg",
        "generation": 1,
        "request": None,
        "result": "null",
    }
    plans = {
        "register": statements.pg_with_records(
            statements.register_sql("postgresql"),
            actions=(Action.CLAIMED,),
            transitions=True,
            effects=False,
        ),
        "complete": statements.pg_with_records(
            statements.complete_sql("postgresql"),
            actions=(Action.COMPLETED,),
            transitions=True,
            effects=False,
        ),
    }
    result: dict[str, Any] = {"sizes": [], "samples": samples}
    print(
        f"## Store at scale: {samples} register+complete of fresh keys per size (PostgreSQL, "
        "one connection)",
        file=out,
    )
    current = 0
    for size in sizes:
        started = time.monotonic()
        with engine.connect() as conn:
            if size > current:
                _bulk(conn, current, size)
                current = size
        bulk_s = time.monotonic() - started
        # The plans as executed: register of a fresh key; complete of a registered running job.
        probe, attempt = f"probe:{uuid.uuid4().hex}", uuid.uuid4().hex
        now = dt.datetime.now(dt.timezone.utc)
        with engine.connect() as conn:
            explained = {
                "register": _explain(
                    conn,
                    plans["register"],
                    {**params, "key": probe, "attempt_id": attempt, "now": now},
                )
            }
            store.register(probe, generation=1, attempt_id=attempt, task_name="bench.fenced_pg")
            explained["complete"] = _explain(
                conn, plans["complete"], {**params, "key": probe, "attempt_id": attempt, "now": now}
            )
        reg, comp = [], []
        run_id = uuid.uuid4().hex[:8]
        for i in range(samples):
            key, attempt = f"fresh:{run_id}:{i}", uuid.uuid4().hex
            t0 = time.perf_counter()
            store.register(key, generation=1, attempt_id=attempt, task_name="bench.fenced_pg")
            t1 = time.perf_counter()
            store.complete(key, generation=1, attempt_id=attempt, result=None)
            t2 = time.perf_counter()
            reg.append((t1 - t0) * 1000)
            comp.append((t2 - t1) * 1000)
        indexes = {name: _index(plan) for name, plan in explained.items()}
        row = {
            "rows": size,
            "bulk_s": bulk_s,
            "register_ms_p50": statistics.median(reg),
            "register_ms_p99": _pct(reg, 0.99),
            "complete_ms_p50": statistics.median(comp),
            "complete_ms_p99": _pct(comp, 0.99),
            "indexes": indexes,
            "plans": explained,
        }
        result["sizes"].append(row)
        print(f"# {size} rows: bulk insert {bulk_s:.1f} s", file=out, flush=True)
    rows = [
        [
            f"{r['rows']:,}",
            r["register_ms_p50"],
            r["register_ms_p99"],
            r["complete_ms_p50"],
            r["complete_ms_p99"],
            f"{r['indexes']['register']} / {r['indexes']['complete']}",
        ]
        for r in result["sizes"]
    ]
    headers = [
        "rows in fence_jobs",
        "register p50 ms",
        "p99",
        "complete p50 ms",
        "p99",
        "index (register / complete)",
    ]
    print(table(headers, rows, digits=3), file=out)
    for name, plan in result["sizes"][-1]["plans"].items():
        print(f"\nEXPLAIN {name} (at {sizes[-1]} rows):", file=out)
        for line in plan:
            print(f"  {line}", file=out)

    def counts() -> tuple[int, int]:
        with engine.connect() as conn:
            jobs = conn.exec_driver_sql("SELECT count(*) FROM fence_jobs").scalar_one()
            history = conn.exec_driver_sql("SELECT count(*) FROM fence_transitions").scalar_one()
        return int(jobs), int(history)

    before = counts()
    started = time.monotonic()
    deleted = store.purge(finished_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=1))
    purge_s = time.monotonic() - started
    after = counts()
    result["purge"] = {
        "jobs_before": before[0],
        "transitions_before": before[1],
        "deleted": deleted,
        "seconds": purge_s,
        "jobs_after": after[0],
        "transitions_after": after[1],
    }
    print(
        f"\n## purge(finished_before=now - 1 day): fence_jobs {before[0]} -> {after[0]} rows, "
        f"fence_transitions {before[1]} -> {after[1]} rows, {deleted} jobs deleted in "
        f"{purge_s:.1f} s",
        file=out,
    )
    engine.dispose()
    store.dispose()
    return result
