"""``--scale``: the store's hot path and the operator's verbs as ``fence_jobs`` grows (10^3 ..
10^6 rows by default; ``--scale-sizes ...,10000000`` for 10^7).

For each size, jobs are bulk-inserted with ``INSERT ... SELECT generate_series`` (in chunks of
10^6 rows, never through the API), three transition rows each, and the tables analyzed. The
jobs are ``completed`` but one in 1,000 ``dead`` and one in 10,000 left ``running`` (stranded),
finished (or last moved) 2 to 31 days ago, evenly by key. Then, at each size:

- ``samples`` fresh keys registered and completed through :class:`~celery_fence.store.Store`,
  one after the other, each call timed; ``EXPLAIN`` of both statements as the hot path sends them;
- the stranded scan (``Store.stranded``, what ``fence recover`` and ``fence ls --stuck`` run,
  1,000 rows at most) and ``fence ls --status dead`` (``Store.list_jobs``, 50 rows), each timed on
  its first run and as the best of five, with the index their plans use.

After the largest size, ``purge`` of the jobs finished more than 29.5 days ago (two thirtieths of
the bulk rows, ``completed`` and ``dead``), batch by batch (``Store.purge``'s progress callback
times each batch), then one pass of the retention beat task's work (:func:`~celery_fence.
retention.purge_expired`, ``fence_retention`` 28.5 days: the next thirtieth, ``completed`` only).
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.harness import Services
from bench.report import table
from celery_fence.store import Store, queries
from celery_fence.store import sql as statements
from celery_fence.store.records import Completion

#: Rows a bulk INSERT writes at most (one statement, one transaction).
BULK_CHUNK = 1_000_000
#: One job in DEAD_EVERY is dead, one in STRANDED_EVERY is left running; ages 2 .. 2 + AGES - 1.
DEAD_EVERY, STRANDED_EVERY, AGES = 1000, 10_000, 30
#: The purge and retention cutoffs, days: ages 30 and 31, then age 29.
PURGE_DAYS, RETENTION_DAYS = 29.5, 28.5
HISTORY = ("claimed", "retry_scheduled", "completed")
#: Secondary indexes dropped while a large bulk load runs and built again after it (faster).
BULK_INDEXES = {
    "ix_fence_jobs_finished": "fence_jobs (finished_at) WHERE status IN ('completed', 'dead')",
    "ix_fence_jobs_task_status": "fence_jobs (task_name, status)",
    "ix_fence_transitions_key_id": "fence_transitions (key, id)",
}
#: Indexes tried at the largest size (created if missing, the reads and the hot path timed
#: again with them): name -> definition.
CANDIDATES = {
    "ix_fence_jobs_unfinished": (
        "fence_jobs (updated_at) WHERE status IN ('running', 'retrying', 'pending')"
    ),
    "ix_fence_jobs_status_updated": "fence_jobs (status, updated_at)",
}


def _bulk(conn: sa.Connection, start: int, stop: int, out: Any) -> None:
    age = f"(now() - (2 + mod(g, {AGES})) * interval '1 day')"
    status = (
        f"CASE WHEN mod(g, {STRANDED_EVERY}) = 7 THEN 'running' "
        f"WHEN mod(g, {DEAD_EVERY}) = 3 THEN 'dead' ELSE 'completed' END"
    )
    large = stop - start > BULK_CHUNK
    existing = _existing_indexes(conn)
    rebuild = [name for name in BULK_INDEXES if name in existing] if large else []
    for name in rebuild:
        conn.exec_driver_sql(f"DROP INDEX {name}")
    conn.exec_driver_sql("SET synchronous_commit TO off")  # a bulk load, not the hot path
    for lo in range(start, stop, BULK_CHUNK):
        hi = min(stop, lo + BULK_CHUNK)
        started = time.monotonic()
        conn.exec_driver_sql(
            "INSERT INTO fence_jobs (key, task_name, status, generation, attempt_id, attempts, "
            "result, created_at, updated_at, finished_at) "
            f"SELECT 'bulk:' || g, 'bench.fenced_pg', {status}, 2, md5(g::text), 2, "
            f"'null'::jsonb, {age}, {age}, CASE WHEN mod(g, {STRANDED_EVERY}) = 7 THEN NULL "
            f"ELSE {age} END FROM generate_series({lo}, {hi - 1}) AS g"
        )
        history = ", ".join(f"'{a}'" for a in HISTORY)
        conn.exec_driver_sql(
            "INSERT INTO fence_transitions (key, generation, attempt_id, action, reason, at) "
            f"SELECT 'bulk:' || g, 2, md5(g::text), a, NULL, {age} "
            f"FROM generate_series({lo}, {hi - 1}) AS g, unnest(ARRAY[{history}]) AS a"
        )
        if stop - start > BULK_CHUNK:
            print(
                f"#   bulk rows {lo:,} .. {hi:,}: {time.monotonic() - started:.1f} s",
                file=out,
                flush=True,
            )
    conn.exec_driver_sql("SET maintenance_work_mem TO '256MB'")
    for name in rebuild:
        started = time.monotonic()
        conn.exec_driver_sql(f"CREATE INDEX {name} ON {BULK_INDEXES[name]}")
        print(f"#   index {name} built again: {time.monotonic() - started:.1f} s", file=out)
    conn.exec_driver_sql("RESET synchronous_commit")
    conn.exec_driver_sql("VACUUM ANALYZE fence_jobs")
    conn.exec_driver_sql("VACUUM ANALYZE fence_transitions")


def _existing_indexes(conn: sa.Connection) -> set[str]:
    return {
        r[0]
        for r in conn.exec_driver_sql(
            "SELECT indexname FROM pg_indexes WHERE tablename LIKE 'fence_%%'"
        ).all()
    }


def _timed(call: Any, repeat: int = 5) -> tuple[float, float]:
    """(ms of the first call, best ms of ``repeat`` more)."""
    times = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000)
    return times[0], min(times[1:])


def _plan_index(plan: list[str], table_name: str = "fence_jobs") -> str:
    """The index the plan reads ``table_name`` by, or ``SEQ SCAN``."""
    for line in plan:
        text = line.strip().lstrip("-> ").strip()
        if f" on {table_name}" in text and " using " in text:
            return text.split(" using ", 1)[1].split(" on ", 1)[0]
        if text.startswith("Bitmap Index Scan on "):
            return text.split(" on ", 1)[1].split()[0]
        if text.startswith(f"Seq Scan on {table_name}") or text.startswith(
            f"Parallel Seq Scan on {table_name}"
        ):
            return "SEQ SCAN"
    return "?"


def _compiled(engine: sa.Engine, query: Any) -> tuple[str, Any]:
    compiled = query.compile(dialect=engine.dialect, compile_kwargs={"render_postcompile": True})
    return str(compiled), dict(compiled.params)


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


def _hot_path(store: Store, samples: int) -> tuple[list[float], list[float], list[float]]:
    """``samples`` register + complete of fresh keys: ms of each register, complete, both."""
    reg, comp, both = [], [], []
    run_id = uuid.uuid4().hex[:8]
    for i in range(samples):
        key, attempt = f"fresh:{run_id}:{i}", uuid.uuid4().hex
        t0 = time.perf_counter()
        store.register(key, generation=1, attempt_id=attempt, task_name="bench.fenced_pg")
        t1 = time.perf_counter()
        store.end(key, Completion(generation=1, attempt_id=attempt, result=None))
        t2 = time.perf_counter()
        reg.append((t1 - t0) * 1000)
        comp.append((t2 - t1) * 1000)
        both.append((t2 - t0) * 1000)
    return reg, comp, both


def _candidates(store: Store, engine: sa.Engine, samples: int, out: Any) -> dict[str, Any]:
    """Each index of :data:`CANDIDATES` the schema lacks, alone: the hot path without it, then
    built, the hot path and the reads with it, then dropped again."""
    found: dict[str, Any] = {}
    with engine.connect() as conn:
        existing = _existing_indexes(conn)
        for name, definition in CANDIDATES.items():
            if name in existing:
                found[name] = {"in_schema": True}
                continue
            without = _hot_path(store, samples)[2]
            started = time.monotonic()
            conn.exec_driver_sql(f"CREATE INDEX {name} ON {definition}")
            build_s = time.monotonic() - started
            conn.exec_driver_sql("ANALYZE fence_jobs")
            scans = _scans(store, engine)
            with_it = _hot_path(store, samples)[2]
            conn.exec_driver_sql(f"DROP INDEX {name}")
            found[name] = {
                "in_schema": False,
                "build_s": build_s,
                "scans": scans,
                "hot_p50_without": statistics.median(without),
                "hot_p99_without": _pct(without, 0.99),
                "hot_p50_with": statistics.median(with_it),
                "hot_p99_with": _pct(with_it, 0.99),
            }
            print(f"# candidate {name}: built in {build_s:.1f} s", file=out, flush=True)
    return found


def _first_warm(scan: dict[str, Any]) -> str:
    return f"{scan['first_ms']:.1f} / {scan['warm_ms']:.1f}"


def _scans(store: Store, engine: sa.Engine) -> dict[str, Any]:
    """The stranded scan and ``ls --status dead``: first and warm times, and their plans."""
    stranded_q = statements.stranded(
        unfinished=("running", "retrying", "pending"),
        cutoff=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=90),
        limit=1000,
        task_name=None,
    )
    dead_q = statements.list_jobs(status="dead", task_name=None, limit=50)
    out: dict[str, Any] = {}
    for name, call, query in (
        ("stranded", lambda: store.admin.stranded(older_than=90, limit=1000), stranded_q),
        ("ls_dead", lambda: store.admin.list_jobs(status="dead", limit=50), dead_q),
    ):
        first, warm = _timed(call)
        sql, params = _compiled(engine, query)
        with engine.connect() as conn:
            plan = [
                r[0]
                for r in conn.exec_driver_sql(
                    "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF, SUMMARY OFF) " + sql, params
                ).all()
            ]
        out[name] = {
            "first_ms": first,
            "warm_ms": warm,
            "rows": len(call()),
            "index": _plan_index(plan),
            "plan": plan,
        }
    return out


def run(svc: Services, *, sizes: list[int], samples: int, out: Any) -> dict[str, Any]:
    store = Store(svc.pg_url)
    engine = sa.create_engine(svc.pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    params = {
        "task_name": "bench.fenced_pg",
        "generation": 1,
        "request": None,
        "result": "null",
        "action": "claimed",
        "reason": None,
    }
    pg = queries.STATEMENTS.rendered("postgresql")
    plans = {
        "register": pg.with_records(pg["register"], transition=True, effects=False),
        "complete": pg.with_records(pg["complete"], transition=True, effects=False),
    }
    result: dict[str, Any] = {"sizes": [], "samples": samples, "load_before": os.getloadavg()}
    print(
        f"## Store at scale: {samples} register+complete of fresh keys per size (PostgreSQL, "
        f"one connection); {len(HISTORY)} history rows a bulk job",
        file=out,
    )
    current = 0
    for size in sizes:
        started = time.monotonic()
        with engine.connect() as conn:
            if size > current:
                _bulk(conn, current, size, out)
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
        reg, comp, both = _hot_path(store, samples)
        indexes = {name: _index(plan) for name, plan in explained.items()}
        with engine.connect() as conn:
            history = conn.exec_driver_sql("SELECT count(*) FROM fence_transitions").scalar_one()
        row = {
            "rows": size,
            "history_rows": int(history),
            "bulk_s": bulk_s,
            "register_ms_p50": statistics.median(reg),
            "register_ms_p99": _pct(reg, 0.99),
            "complete_ms_p50": statistics.median(comp),
            "complete_ms_p99": _pct(comp, 0.99),
            "both_ms_p50": statistics.median(both),
            "both_ms_p99": _pct(both, 0.99),
            "indexes": indexes,
            "plans": explained,
            "scans": _scans(store, engine),
        }
        result["sizes"].append(row)
        print(
            f"# {size:,} jobs, {history:,} history rows: bulk insert {bulk_s:.1f} s",
            file=out,
            flush=True,
        )
    rows = [
        [
            f"{r['rows']:,}",
            f"{r['history_rows']:,}",
            r["register_ms_p50"],
            r["register_ms_p99"],
            r["complete_ms_p50"],
            r["complete_ms_p99"],
            r["both_ms_p50"],
            r["both_ms_p99"],
            f"{r['indexes']['register']} / {r['indexes']['complete']}",
        ]
        for r in result["sizes"]
    ]
    headers = [
        "jobs",
        "history rows",
        "register p50 ms",
        "p99",
        "complete p50 ms",
        "p99",
        "register+complete p50",
        "p99",
        "index (register / complete)",
    ]
    print(table(headers, rows, digits=3), file=out)
    rows = [
        [
            f"{r['rows']:,}",
            r["scans"]["stranded"]["first_ms"],
            r["scans"]["stranded"]["warm_ms"],
            r["scans"]["stranded"]["rows"],
            r["scans"]["stranded"]["index"],
            r["scans"]["ls_dead"]["first_ms"],
            r["scans"]["ls_dead"]["warm_ms"],
            r["scans"]["ls_dead"]["index"],
        ]
        for r in result["sizes"]
    ]
    headers = [
        "jobs",
        "stranded scan first ms",
        "warm",
        "found",
        "index",
        "ls --status dead first ms",
        "warm",
        "index",
    ]
    print(
        "\n## The operator's reads: the stranded scan (recover, ls --stuck), ls --status dead",
        file=out,
    )
    print(table(headers, rows, digits=1), file=out)
    result["candidates"] = _candidates(store, engine, samples, out)
    rows = []
    for name, c in result["candidates"].items():
        if c["in_schema"]:
            rows.append([name, "in the schema (figures above)", "-", "-", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                name,
                f"{c['build_s']:.1f} s",
                _first_warm(c["scans"]["stranded"]),
                c["scans"]["stranded"]["index"],
                _first_warm(c["scans"]["ls_dead"]),
                c["scans"]["ls_dead"]["index"],
                f"{c['hot_p50_without']:.2f} -> {c['hot_p50_with']:.2f}",
                f"{c['hot_p99_without']:.2f} -> {c['hot_p99_with']:.2f}",
            ]
        )
    print(
        f"\n## Candidate indexes at {sizes[-1]:,} jobs, each alone: the reads with it (first / "
        "warm ms), register+complete without -> with it (ms)",
        file=out,
    )
    headers = [
        "index",
        "build",
        "stranded scan",
        "plan",
        "ls --status dead",
        "plan",
        "register+complete p50",
        "p99",
    ]
    print(table(headers, rows), file=out)
    for name, plan in result["sizes"][-1]["plans"].items():
        print(f"\nEXPLAIN {name} (at {sizes[-1]:,} jobs):", file=out)
        for line in plan:
            print(f"  {line}", file=out)
    for name, scan in result["sizes"][-1]["scans"].items():
        print(f"\nEXPLAIN {name} (at {sizes[-1]:,} jobs):", file=out)
        for line in scan["plan"]:
            print(f"  {line}", file=out)

    def counts() -> tuple[int, int]:
        with engine.connect() as conn:
            jobs = conn.exec_driver_sql("SELECT count(*) FROM fence_jobs").scalar_one()
            history = conn.exec_driver_sql("SELECT count(*) FROM fence_transitions").scalar_one()
        return int(jobs), int(history)

    before = counts()
    batches: list[float] = []
    last = [time.monotonic()]

    def progress(total: int) -> None:
        now = time.monotonic()
        batches.append(now - last[0])
        last[0] = now

    started = time.monotonic()
    deleted = store.admin.purge(
        finished_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=PURGE_DAYS),
        progress=progress,
    )
    purge_s = time.monotonic() - started
    after = counts()
    result["purge"] = {
        "cutoff_days": PURGE_DAYS,
        "jobs_before": before[0],
        "transitions_before": before[1],
        "deleted": deleted,
        "history_deleted": before[1] - after[1],
        "seconds": purge_s,
        "batches": len(batches),
        "batch_s_p50": statistics.median(batches) if batches else 0.0,
        "batch_s_max": max(batches, default=0.0),
        "jobs_per_s": deleted / purge_s if purge_s else 0.0,
        "jobs_after": after[0],
        "transitions_after": after[1],
    }
    result["retention"] = _retention_pass(svc, counts)
    p, r = result["purge"], result["retention"]
    print(
        f"\n## purge(finished_before=now - {PURGE_DAYS} days), batches of 1,000 jobs: "
        f"{p['deleted']:,} jobs and {p['history_deleted']:,} history rows deleted in "
        f"{p['seconds']:.1f} s ({p['jobs_per_s']:,.0f} jobs/s, "
        f"{(p['deleted'] + p['history_deleted']) / max(p['seconds'], 1e-9):,.0f} rows/s); "
        f"{p['batches']} batches, each p50 {1000 * p['batch_s_p50']:.0f} ms, max "
        f"{1000 * p['batch_s_max']:.0f} ms; fence_jobs {p['jobs_before']:,} -> "
        f"{p['jobs_after']:,} rows",
        file=out,
    )
    print(
        f"## retention pass (celery_fence.purge's work, fence_retention {RETENTION_DAYS} days): "
        f"{r['deleted']:,} completed jobs and {r['history_deleted']:,} history rows in "
        f"{r['seconds']:.1f} s ({r['deleted'] / max(r['seconds'], 1e-9):,.0f} jobs/s)",
        file=out,
    )
    result["load_after"] = os.getloadavg()
    print(
        "# load average (1/5/15 min): "
        + "/".join(f"{x:.2f}" for x in result["load_before"])
        + " before, "
        + "/".join(f"{x:.2f}" for x in result["load_after"])
        + " after",
        file=out,
    )
    engine.dispose()
    store.dispose()
    return result


def _retention_pass(svc: Services, counts: Any) -> dict[str, Any]:
    """One run of the retention beat task's work on an app with ``fence_retention`` set."""
    from celery import Celery

    from celery_fence.ops.retention import purge_expired

    app = Celery("fence_bench_retention", set_as_current=False)
    app.conf.update(
        fence_redis_url=svc.lease_redis.url,
        fence_database_url=svc.pg_url,
        fence_retention=RETENTION_DAYS * 86400,
    )
    before = counts()
    started = time.monotonic()
    deleted = purge_expired(app)
    seconds = time.monotonic() - started
    after = counts()
    return {
        "retention_days": RETENTION_DAYS,
        "deleted": deleted,
        "history_deleted": before[1] - after[1],
        "seconds": seconds,
    }
