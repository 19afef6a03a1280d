"""The benchmark (``python -m bench``) still runs, at a tiny size, and still measures the bound.

No timing is asserted: only that every variant was run and reported (the alternatives a user would
pick instead doing what they stand for), and that the round trips the servers and the worker
counted for a fenced task are within the documented bound (claim, register, complete: at most 3
blocking round trips; the release rides along or goes out in the background).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = (
    "plain",
    "fenced-pg",
    "fenced-pg-redisresult",
    "fenced-pg-group",
    "fenced-pg-ratelimit",
    "fenced-pg-metrics",
    "plain-dbresult",
    "fenced-sqlite",
    "redis-lock",
    "celery-once",
    "plain-50ms",
    "fenced-pg-50ms",
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
]


def _run(tmp_path: Path, *args: str, module: str = "bench", **env: str) -> Any:
    return subprocess.run(
        [sys.executable, "-m", module, *args, "--json", str(tmp_path / "result.json")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=540,
    )


def _bench(tmp_path: Path, *args: str, module: str = "bench") -> tuple[str, Any]:
    proc = _run(tmp_path, *args, module=module)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((tmp_path / "result.json").read_text())


@pytest.mark.timeout(300)
def test_before_after_runs_the_revision_in_the_same_rounds_in_both_orders(tmp_path: Path) -> None:
    # Given a tiny before/after of the working tree against HEAD itself: 20 tasks, 2 rounds
    stdout, result = _bench(
        tmp_path,
        "--rev",
        "HEAD",
        "--variants",
        "fenced-pg",
        "--rounds",
        "2",
        "--tasks",
        "20",
        "--trace-tasks",
        "0",
    )

    # Then the revision's copy ran in the same rounds, once in each order
    assert result["rev"] == "HEAD"
    assert result["orders"] == ["forward", "reversed"]
    assert "(forward order)" in stdout and "(reversed order)" in stdout
    for row in result["rounds"]:
        assert row["fenced-pg"] > 0 and row["fenced-pg@old"] > 0
    # And every task of every run was counted as succeeded, from the store's completed rows for
    # the fenced ones and from the workers' success counter for plain Celery
    assert result["succeeded"] == {
        "plain": "40 of 40",
        "fenced-pg": "40 of 40",
        "fenced-pg@old": "40 of 40",
    }
    # And new/old is taken within each round: throughput and worker CPU a task, with the spread
    pair = result["before_after"]["fenced-pg"]
    assert pair["old"] == "fenced-pg@old"
    ratios = [row["fenced-pg"] / row["fenced-pg@old"] for row in result["rounds"]]
    assert pair["ratio"]["per_round"] == pytest.approx(ratios)
    assert pair["ratio"]["min"] == pytest.approx(min(ratios))
    assert pair["ratio"]["max"] == pytest.approx(max(ratios))
    assert set(pair["by_order"]) == {"forward", "reversed"}
    for row in result["worker_cpu_rounds"]:
        assert row["fenced-pg"] > 0 and row["fenced-pg@old"] > 0
    assert len(pair["cpu_ratio"]["per_round"]) == 2
    spread = result["spread"]["fenced-pg@old"]
    assert spread["tasks_per_s"]["min"] <= spread["tasks_per_s"]["median"]
    assert spread["tasks_per_s"]["median"] <= spread["tasks_per_s"]["max"]
    assert "## Before/after: working tree (new) vs celery_fence as of HEAD (old)" in stdout
    assert "| fenced-pg / fenced-pg@old " in stdout
    assert "forward, reversed" in stdout


@pytest.mark.slow(35)
@pytest.mark.timeout(300)
def test_the_bench_refuses_to_report_a_variant_whose_tasks_failed(tmp_path: Path) -> None:
    # Given a worker whose fenced-pg and redis-lock bodies raise (BENCH_FAIL_TASKS)
    proc = _run(
        tmp_path,
        "--no-rev",
        "--variants",
        "fenced-pg,redis-lock",
        "--rounds",
        "1",
        "--tasks",
        "3",
        "--trace-tasks",
        "0",
        BENCH_FAIL_TASKS="bench.fenced_pg,bench.rlock",
    )

    # Then the run fails loudly: non-zero exit, naming each variant and how many of N succeeded
    # (fenced-pg from the store's completed rows, redis-lock from the workers' counter), and
    # no report or result file is written
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "fenced-pg: 0 of 3 tasks succeeded in round 1" in proc.stderr
    assert "redis-lock: 0 of 3 tasks succeeded in round 1" in proc.stderr
    assert "plain:" not in proc.stderr  # the tasks that did succeed are not blamed
    assert "## Throughput" not in proc.stdout
    assert not (tmp_path / "result.json").exists()


@pytest.mark.slow(70)
@pytest.mark.timeout(600)
def test_throughput_mode_reports_every_variant_and_counts_at_most_three_round_trips(
    tmp_path: Path,
) -> None:
    # Given a tiny benchmark: one round, a few hundred no-op tasks per variant
    stdout, result = _bench(
        tmp_path,
        *("--no-rev", "--rounds", "1", "--tasks", "200", "--sleep-tasks", "20"),
        *("--trace-tasks", "40"),
    )

    # Then every variant ran and has a row in each table, with a ratio against plain Celery
    assert len(result["rounds"]) == 1
    for name in VARIANTS:
        assert result["rounds"][0][name] > 0
        assert stdout.count(f"| {name} ") >= 4, f"{name} missing from a table:\n{stdout}"
    assert set(result["ratios"]) == set(VARIANTS) - {"plain", "plain-50ms"}
    assert result["ratios"]["fenced-pg"]["baseline"] == "plain"
    assert result["ratios"]["fenced-pg-50ms"]["baseline"] == "plain-50ms"
    for name in VARIANTS:
        assert result["worker_cpu_ms_per_task"][name] > 0

    # And the headline compares fenced-pg with Celery's own database result backend, per round
    headline = result["headlines"]["fenced-pg / plain-dbresult"]
    fenced, db = result["rounds"][0]["fenced-pg"], result["rounds"][0]["plain-dbresult"]
    assert headline["median"] == pytest.approx(fenced / db)
    assert "# fenced-pg runs " in stdout and " the tasks/s of plain-dbresult" in stdout

    # And the servers counted, per fenced task: one register and one complete statement, no
    # BEGIN/COMMIT (AUTOCOMMIT), and one or two Lua scripts (the claim, which on a single Redis
    # also carries the previous attempts' releases; a leftover release goes in the renewer's
    # trip) in at most two round trips
    for name in ("fenced-pg", "fenced-pg-50ms"):
        counts = result["counts"][name]
        assert counts["sql_by_kind"].get("register") == pytest.approx(1.0)
        assert counts["sql_by_kind"].get("complete") == pytest.approx(1.0)
        assert "tx-control" not in counts["sql_by_kind"]
        assert 0.99 <= counts["redis_scripts"] <= 2.01
        assert counts["redis_reads"] <= 2.0
    # a group slot is taken in the claim's own script (one round trip; its release rides in a
    # later claim, as a lease's does), a rate token is one more script a task; no more SQL
    # than fenced-pg
    group = result["counts"]["fenced-pg-group"]
    assert 0.99 <= group["redis_scripts"] <= 2.01  # a leftover release may go on its own
    assert 1.99 <= result["counts"]["fenced-pg-ratelimit"]["redis_scripts"] <= 3.51
    for name in ("fenced-pg-group", "fenced-pg-ratelimit"):
        counts = result["counts"][name]
        assert counts["sql_by_kind"].get("register") == pytest.approx(1.0)
    # plain Celery does not touch the lease Redis or the store: the counting is per variant
    assert result["counts"]["plain"]["redis_scripts"] == 0
    assert result["counts"]["plain"]["sql_statements"] == 0

    # And the variants a user would pick instead did what they stand for, counted by the servers:
    # Celery's database backend wrote one row a task in one transaction on the same PostgreSQL
    dbresult = result["counts"]["plain-dbresult"]
    assert dbresult["sql_by_kind"].get("celery insert") == pytest.approx(1.0)
    assert dbresult["sql_by_kind"].get("tx-control") == pytest.approx(2.0)  # BEGIN, COMMIT
    assert "register" not in dbresult["sql_by_kind"]
    assert dbresult["redis_commands"] == 0
    # celery_once locked each key when it was sent (SET) and unlocked it in the worker (DEL)
    once = result["counts"]["celery-once"]["redis_by_command"]
    assert once.get("set") == pytest.approx(1.0)
    assert once.get("del") == pytest.approx(1.0)
    assert result["counts"]["celery-once"]["sql_statements"] == 0
    # a fenced task in an app with a Redis result backend: the result is written twice, fenced in
    # PostgreSQL (one register, one complete) and once more to Redis (SETEX, PUBLISH)
    twice = result["counts"]["fenced-pg-redisresult"]
    assert twice["sql_by_kind"].get("register") == pytest.approx(1.0)
    assert twice["sql_by_kind"].get("complete") == pytest.approx(1.0)
    assert twice["redis_by_command"].get("setex") == pytest.approx(1.0)
    assert twice["redis_by_command"].get("publish") == pytest.approx(1.0)
    assert "setex" not in result["counts"]["fenced-pg"]["redis_by_command"]

    # And the worker itself counted at most 3 blocking round trips on a fenced task's own thread
    # (1 lease-Redis round trip + 2 PostgreSQL statements), the rest in the background
    for name in ("fenced-pg", "fenced-pg-50ms"):
        traced = result["trace"][name]
        assert traced["blocking_round_trips"] <= 3.0
        assert traced["redis_critical"] == pytest.approx(1.0)
        assert traced["pg_critical"] == pytest.approx(2.0)
    assert result["trace"]["fenced-sqlite"]["redis_critical"] == pytest.approx(1.0)

    # And the alternatives' blocking round trips were counted on the task's thread too: Celery's
    # database backend (pre-ping, BEGIN, statements, COMMIT), celery_once's unlock, and the
    # Redis result write on top of the fenced task's own three
    assert result["trace"]["plain-dbresult"]["pg_critical"] >= 4.0
    assert result["trace"]["celery-once"]["redis_critical"] == pytest.approx(1.0)
    twice_traced = result["trace"]["fenced-pg-redisresult"]
    assert twice_traced["pg_critical"] == pytest.approx(2.0)
    assert twice_traced["redis_critical"] >= 2.0


@pytest.mark.timeout(300)
def test_scale_mode_explains_the_statements_and_purges_by_age(tmp_path: Path) -> None:
    # Given the store-at-scale mode at a tiny size: 1,000 bulk jobs, finished 2 to 31 days ago
    # by key (key g: 2 + g % 30 days), one in 1,000 dead, one in 10,000 left running
    stdout, result = _bench(tmp_path, "--scale", "--scale-sizes", "1000", "--scale-samples", "20")

    # Then the upsert is arbitrated by the primary key and the completion uses an index
    (size,) = result["sizes"]
    assert size["rows"] == 1000
    assert size["history_rows"] >= 3000
    assert size["indexes"]["register"] == "fence_jobs_pkey"
    assert size["indexes"]["complete"] not in ("SEQ SCAN", "?")
    assert "EXPLAIN complete" in stdout
    # And the stranded scan found the one job left running
    assert size["scans"]["stranded"]["rows"] == 1
    assert size["scans"]["ls_dead"]["rows"] == 1

    # And purge deleted exactly the jobs finished more than 29.5 days ago (ages 30 and 31) with
    # their three history rows each; the retention pass the completed ones of age 29
    def finished(g: int) -> bool:
        return g % 10_000 != 7

    purge = result["purge"]
    expected = sum(1 for g in range(1000) if finished(g) and 2 + g % 30 >= 30)
    assert purge["deleted"] == expected
    assert purge["jobs_after"] == purge["jobs_before"] - expected
    assert purge["history_deleted"] == 3 * expected
    retention = result["retention"]
    dead = {g for g in range(1000) if g % 1000 == 3}
    expected = sum(1 for g in range(1000) if finished(g) and g not in dead and 2 + g % 30 == 29)
    assert retention["deleted"] == expected
    assert retention["history_deleted"] == 3 * expected


@pytest.mark.timeout(600)
def test_latency_mode_times_every_variant_from_publish_to_stored_result(tmp_path: Path) -> None:
    # Given a tiny latency run: one round, 12 tasks of 50 ms a variant at 20 a second
    stdout, result = _bench(
        tmp_path, "--latency", "--rounds", "1", "--latency-tasks", "12", "--latency-rate", "20"
    )

    # Then every variant has its percentiles, none below the body's 50 ms, and a row in the
    # percentile table; the added latency is taken against plain Celery with a result backend
    for name in ("plain", "fenced-pg", "fenced-sqlite", "redis-lock"):
        entry = result["variants"][name]
        assert entry["n"] == 12
        assert 50.0 <= entry["p50_ms"] <= entry["p90_ms"] <= entry["p99_ms"] <= entry["max_ms"]
        assert entry["runtime_p50_ms"] >= 50.0
        assert entry["added_p50_ms"] == pytest.approx(
            entry["p50_ms"] - result["variants"]["plain"]["p50_ms"]
        )
        assert stdout.count(f"| {name} ") == 2, f"{name} missing from a table:\n{stdout}"
    assert "## Latency, publish -> result stored" in stdout


@pytest.mark.timeout(180)
def test_the_happy_path_count_follows_one_task_from_the_message_to_the_ack(tmp_path: Path) -> None:
    # Given the happy-path count of the working tree (a solo worker, SQLite store, local Redis)
    stdout, result = _bench(tmp_path, module="bench.happy_path")
    files = result["working tree"]
    # Then its window held the whole attempt: the adapter, the execution, the claim, the store's
    # fenced completion and the settle step, and nothing of the operator's side
    for name in ("adapters/task.py", "pipeline/execution.py", "leases/lease.py", "store/jobs.py"):
        assert f"celery_fence/{name}" in files
    assert "celery_fence/pipeline/settle.py" in files
    assert not [f for f in files if f.startswith("celery_fence/ops/")]
    assert f"working tree: {len(files)} celery_fence files" in stdout


@pytest.mark.timeout(120)
def test_takeover_mode_measures_a_fault_on_a_broker(tmp_path: Path) -> None:
    # Given one cell: the whole worker killed inside the body, on the Redis broker, TTL 1 s
    stdout, result = _bench(
        tmp_path,
        "--takeover",
        "--takeover-faults",
        "kill-worker",
        "--takeover-brokers",
        "redis",
        "--takeover-ttl",
        "1",
    )
    # Then another worker's own recovery check took the job over within a few TTLs, and the
    # table says so
    seconds = result["seconds"]["kill-worker"]["redis"]
    assert seconds is not None and 0 < seconds <= 5.0
    assert "| kill-worker |" in stdout and "TTLs" in stdout


@pytest.mark.timeout(300)
def test_enqueue_mode_times_every_variant_with_unique_jobs_beside_plain_enqueue(
    tmp_path: Path,
) -> None:
    # Given a tiny enqueue run: one round of 20 jobs a variant, alternating in the round
    stdout, result = _bench(tmp_path, "--enqueue", "--rounds", "1", "--enqueue-jobs", "20")
    # Then every variant (unique jobs, new key and held key, beside plain enqueue) has its
    # percentiles and its row, against commit-then-delay
    variants = ("delay", "commit-then-delay", "enqueue", "enqueue-unique", "unique-duplicate")
    assert set(result["variants"]) == set(variants)
    for name in variants:
        entry = result["variants"][name]
        assert 0 < entry["p50_us"] <= entry["p99_us"], (name, entry)
        assert f"| {name} " in stdout, f"{name} missing from the table:\n{stdout}"
        assert entry["ratio"] > 0, (name, entry)
