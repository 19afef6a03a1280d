"""The default mode: plain Celery vs fenced vs what a user would pick instead, alternately, one
worker, one run.

Each round runs every variant once, in the same order (A B C D E F, A B C D E F, ...), against
the same worker (prefork, concurrency 4). Throughput ratios are taken within a round, so slow
drift of the machine (other processes, thermal) hits both sides of a ratio alike. Then a second
worker, started with the same command plus ``BENCH_TRACE=1``, runs every variant once more to
count round trips on the client side, split into the task's critical path and background threads.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import trace
from bench.harness import (
    MACHINE,
    BenchWorker,
    CpuCounter,
    PgCounter,
    RedisCounter,
    Services,
    set_consuming,
    timed_run,
)
from bench.report import table


@dataclass(frozen=True)
class Variant:
    name: str
    task: str
    sleep: float
    baseline: str | None  # the plain variant its ratio is taken against
    store: str  # "postgresql", "sqlite" or "-"
    experimental: bool = False  # run by the BENCH_EXPERIMENT=1 worker (see bench.experiments)


VARIANTS = (
    Variant("plain", "bench.plain", 0.0, None, "-"),
    Variant("fenced-pg", "bench.fenced_pg", 0.0, "plain", "postgresql"),
    Variant("fenced-pg-defer", "bench.fenced_pg_defer", 0.0, "plain", "postgresql"),
    Variant("fenced-pg-redisresult", "bench.fenced_pg_redisresult", 0.0, "plain", "postgresql"),
    Variant("plain-dbresult", "bench.plain_dbresult", 0.0, "plain", "postgresql"),
    Variant("fenced-sqlite", "bench.fenced_sqlite", 0.0, "plain", "sqlite"),
    Variant("redis-lock", "bench.rlock", 0.0, "plain", "-"),
    Variant("celery-once", "bench.once", 0.0, "plain", "-"),
    Variant("plain-50ms", "bench.plain", 0.05, None, "-"),
    Variant("fenced-pg-50ms", "bench.fenced_pg", 0.05, "plain-50ms", "postgresql"),
    Variant("fenced-pg-defer-50ms", "bench.fenced_pg_defer", 0.05, "plain-50ms", "postgresql"),
)
#: With ``--experiment``: the same tasks on the second worker, each right after its reference.
EXPERIMENTS = {
    "fenced-pg": Variant("fenced-pg-exp", "bench.fenced_pg", 0.0, "plain", "postgresql", True),
    "fenced-sqlite": Variant(
        "fenced-sqlite-exp", "bench.fenced_sqlite", 0.0, "plain", "sqlite", True
    ),
}

#: Throughput ratios printed as the headline, each within a round: (numerator, denominator).
#: fenced-pg / plain-dbresult: a fenced task with its result in PostgreSQL against plain Celery
#: with its own database result backend on the same PostgreSQL (the like-for-like durable
#: result); fenced-pg-redisresult / fenced-pg: the cost of also writing the result to Redis.
HEADLINES = (
    ("fenced-pg", "plain-dbresult"),
    ("fenced-pg-defer", "plain-dbresult"),
    ("fenced-pg-defer", "fenced-pg"),
    ("fenced-pg-redisresult", "fenced-pg"),
)
#: The worker tree's processes in the CPU counts (the rest: the servers and the machine).
WORKER_TREE = ("worker main", "worker children")


def select(only: frozenset[str] | None, *, experiment: bool) -> tuple[Variant, ...]:
    """The variants to run, in order: ``only`` (with the baselines their ratios need) or all;
    with ``experiment``, each reference in :data:`EXPERIMENTS` then its second-worker copy."""
    if only is not None:
        unknown = only - {v.name for v in VARIANTS}
        if unknown:
            raise SystemExit(
                f"--variants: unknown {', '.join(sorted(unknown))}; "
                f"known: {', '.join(v.name for v in VARIANTS)}"
            )
        wanted = only | {v.baseline for v in VARIANTS if v.name in only and v.baseline}
    chosen: list[Variant] = []
    for v in VARIANTS:
        if only is None or v.name in wanted:
            chosen.append(v)
            if experiment and v.name in EXPERIMENTS:
                chosen.append(EXPERIMENTS[v.name])
    return tuple(chosen)


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }


def run(
    svc: Services,
    *,
    rounds: int,
    tasks: int,
    sleep_tasks: int,
    trace_tasks: int,
    concurrency: int,
    loglevel: str,
    out: Any,
    experiment: bool = False,
    experiment_fence_path: str | None = None,
    only: frozenset[str] | None = None,
) -> dict[str, Any]:
    variants = select(only, experiment=experiment)
    control, broker = svc.control(), svc.broker()
    lease_counter = RedisCounter(svc.lease_redis.client())
    pg_counter = PgCounter(svc.pg_admin_url, svc.database)
    sizes = {v.name: (sleep_tasks if v.sleep else tasks) for v in variants}
    result: dict[str, Any] = {
        "machine": machine(),
        "load_before": os.getloadavg(),
        "rounds": [],
        "sql_source": pg_counter.source,
        "sizes": sizes,
    }
    worker = BenchWorker(
        svc.worker_env(),
        queue=svc.queue,
        log_dir=svc.workdir,
        concurrency=concurrency,
        loglevel=loglevel,
    )
    result["worker_command"] = " ".join(worker.command()[1:])
    redis_totals: dict[str, Counter[str]] = {v.name: Counter() for v in variants}
    sql_totals: dict[str, Counter[str]] = {v.name: Counter() for v in variants}
    cpu_totals: dict[str, Counter[str]] = {v.name: Counter() for v in variants}
    workers = {False: worker}
    if experiment:
        workers[True] = BenchWorker(
            svc.worker_env(
                BENCH_EXPERIMENT="1",
                **({"BENCH_FENCE_PATH": experiment_fence_path} if experiment_fence_path else {}),
            ),
            queue=f"{svc.queue}-exp",
            log_dir=svc.workdir,
            concurrency=concurrency,
            loglevel=loglevel,
        )
    cpu_counters = {exp: CpuCounter(svc, w) for exp, w in workers.items()}
    try:
        for w in workers.values():
            w.start_answering(control)
            set_consuming(control, w, False)
        for v in variants:  # warm-up: connections, scripts, SQLite schema, imports
            w = workers[v.experimental]
            timed_run(svc, control, broker, w, v.task, min(200, sizes[v.name]), sleep=v.sleep)
        print(f"# worker: {result['worker_command']}", file=out)
        if experiment_fence_path:
            print(f"# *-exp: celery_fence from {experiment_fence_path}", file=out)
        print(
            f"# {'round':>5} " + " ".join(f"{v.name:>15}" for v in variants) + "   tasks/s",
            file=out,
        )
        for r in range(rounds):
            row: dict[str, float] = {}
            for v in variants:
                r0, p0 = lease_counter.snapshot(), pg_counter.snapshot()
                w, cpu_counter = workers[v.experimental], cpu_counters[v.experimental]
                c0: Counter[str] = Counter()  # taken once the messages are published
                seconds = timed_run(
                    *(svc, control, broker, w, v.task, sizes[v.name]),
                    sleep=v.sleep,
                    on_start=functools.partial(_snapshot_into, c0, cpu_counter),
                )
                time.sleep(0.3)  # releases left to the renewer thread go out within 20 ms
                c1 = cpu_counter.snapshot()
                r1, p1 = lease_counter.snapshot(), pg_counter.snapshot()
                cpu_totals[v.name] += Counter({k: c1[k] - c0.get(k, 0.0) for k in c1})
                redis_totals[v.name] += RedisCounter.delta(r0, r1)
                sql_totals[v.name] += PgCounter.delta(p0, p1)
                row[v.name] = sizes[v.name] / seconds
            result["rounds"].append(row)
            print(
                f"  {r + 1:>5} " + " ".join(f"{row[v.name]:>15.1f}" for v in variants),
                file=out,
                flush=True,
            )
        # a consumed message is not a success: the redis-lock body must not have raised
        failed = [line for line in worker.log().splitlines() if "bench.rlock[" in line]
        failed = [line for line in failed if " raised " in line]
        if failed:
            raise RuntimeError(f"redis-lock: {len(failed)} tasks raised, e.g. {failed[0]}")
    finally:
        for w in workers.values():
            w.stop()
    result["variants"] = [v.name for v in variants]
    result["ratios"] = ratios(variants, result["rounds"])
    result["headlines"] = headlines(result["rounds"])
    result["counts"] = per_task_counts(variants, redis_totals, sql_totals, sizes, rounds)
    result["cpu_ms_per_task"] = {
        v.name: {k: 1000 * c / (sizes[v.name] * rounds) for k, c in cpu_totals[v.name].items()}
        for v in variants
    }
    result["worker_cpu_ms_per_task"] = {
        name: sum(c.get(k, 0.0) for k in WORKER_TREE)
        for name, c in result["cpu_ms_per_task"].items()
    }
    result["trace"] = traced_pass(svc, control, broker, trace_tasks, concurrency, loglevel)
    result["load_after"] = os.getloadavg()
    pg_counter.dispose()
    print_report(variants, result, out)
    return result


def ratios(
    variants: tuple[Variant, ...], rounds: list[dict[str, float]]
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        if v.baseline is None:
            continue
        values = [row[v.name] / row[v.baseline] for row in rounds]
        out[v.name] = {
            "baseline": v.baseline,
            "per_round": values,
            "min": min(values),
            "median": statistics.median(values),
            "max": max(values),
        }
    return out


def headlines(rounds: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """The :data:`HEADLINES` throughput ratios, each taken within a round."""
    out: dict[str, dict[str, Any]] = {}
    for a, b in HEADLINES:
        if not rounds or a not in rounds[0] or b not in rounds[0]:
            continue
        values = [row[a] / row[b] for row in rounds]
        out[f"{a} / {b}"] = {
            "per_round": values,
            "min": min(values),
            "median": statistics.median(values),
            "max": max(values),
        }
    return out


def per_task_counts(
    variants: tuple[Variant, ...],
    redis_totals: dict[str, Counter[str]],
    sql_totals: dict[str, Counter[str]],
    sizes: dict[str, int],
    rounds: int,
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        n = sizes[v.name] * rounds
        rc, sc = redis_totals[v.name], sql_totals[v.name]
        commands = {k: c / n for k, c in sorted(rc.items()) if not k.startswith("_")}
        out[v.name] = {
            "redis_reads": rc["_reads"] / n,
            "redis_scripts": (rc["evalsha"] + rc["eval"]) / n,
            "redis_commands": sum(commands.values()),
            "redis_by_command": commands,
            "sql_statements": sum(sc.values()) / n,
            "sql_by_kind": {k: c / n for k, c in sorted(sc.items())},
        }
    return out


def _snapshot_into(target: Counter[str], counter: CpuCounter) -> None:
    target.update(counter.snapshot())


def traced_pass(
    svc: Services, control: Any, broker: Any, n: int, concurrency: int, loglevel: str
) -> dict[str, dict[str, float]]:
    """Client-side counts per task from a worker started with ``BENCH_TRACE=1``."""
    trace_dir = str(svc.workdir / "trace")
    worker = BenchWorker(
        svc.worker_env(BENCH_TRACE="1"),
        queue=svc.queue,
        log_dir=svc.workdir,
        concurrency=concurrency,
        loglevel=loglevel,
    )
    out: dict[str, dict[str, float]] = {}
    worker.start_answering(control)
    try:
        set_consuming(control, worker, False)
        for v in VARIANTS:  # every pool process connects before counting starts
            warm = 25 * concurrency if v.sleep else 100 * concurrency
            timed_run(svc, control, broker, worker, v.task, warm, sleep=v.sleep)
        time.sleep(0.5)
        for v in VARIANTS:
            before = trace.read_all(trace_dir)
            timed_run(svc, control, broker, worker, v.task, n, sleep=v.sleep)
            time.sleep(0.5)  # off-path releases, then one more dump of every child's counts
            after = trace.read_all(trace_dir)
            d = {k: (after[k] - before.get(k, 0)) / n for k in after}
            out[v.name] = {
                "redis_critical": d.get("redis:critical", 0.0),
                "redis_off": d.get("redis:off", 0.0),
                "pg_critical": d.get("postgresql:critical", 0.0),
                "pg_off": d.get("postgresql:off", 0.0),
                "sqlite_critical": d.get("sqlite:critical", 0.0),
                "sqlite_off": d.get("sqlite:off", 0.0),
                "redis_health_pings": (
                    d.get("redis-health:critical", 0.0) + d.get("redis-health:off", 0.0)
                )
                * n,
            }
            out[v.name]["blocking_round_trips"] = (
                out[v.name]["redis_critical"] + out[v.name]["pg_critical"]
            )
    finally:
        worker.stop()
    return out


def print_report(variants: tuple[Variant, ...], result: dict[str, Any], out: Any) -> None:
    m = result["machine"]
    load = f"{_load(result['load_before'])} before, {_load(result['load_after'])} after"
    print(
        f"\n# machine: {m['cpus']} CPUs ({m['cpu']}), Python {m['python']}, {m['system']}", file=out
    )
    print(f"# load average (1/5/15 min): {load}", file=out)

    print(
        "\n## Throughput: median tasks/s, ratio to plain Celery per round, worker-tree CPU",
        file=out,
    )
    rows = []
    for v in variants:
        median = statistics.median(row[v.name] for row in result["rounds"])
        ratio = result["ratios"].get(v.name)
        spread = (ratio["min"], ratio["median"], ratio["max"]) if ratio else ("-", "1", "-")
        cpu = result["worker_cpu_ms_per_task"][v.name]
        rows.append([v.name, result["sizes"][v.name], f"{median:.0f}", *spread, cpu])
    headers = ["variant", "tasks/run", "tasks/s", "ratio min", "median", "max", "worker CPU ms"]
    print(table(headers, rows, digits=3), file=out)
    print(
        "ratio: to plain (to plain-50ms for the 50 ms rows); worker CPU ms: per task, the "
        "worker's main process and its pool children (scheduler run time).",
        file=out,
    )
    for name, h in result["headlines"].items():
        a, b = name.split(" / ")
        cpu_a, cpu_b = (result["worker_cpu_ms_per_task"][x] for x in (a, b))
        print(
            f"# {a} runs {h['median']:.2f}x the tasks/s of {b} (per round min {h['min']:.2f}, "
            f"max {h['max']:.2f}): a task takes {1 / h['median']:.2f}x the time; worker CPU "
            f"{cpu_a:.3f} vs {cpu_b:.3f} ms a task ({cpu_a / max(cpu_b, 1e-9):.2f}x)",
            file=out,
        )

    print(
        "\n## Per task, counted by the servers (lease Redis: INFO commandstats and "
        f"total_reads_processed; SQL: {result['sql_source']})",
        file=out,
    )
    rows = []
    for v in variants:
        c = result["counts"][v.name]
        kinds = ", ".join(f"{k} {x:.2f}" for k, x in c["sql_by_kind"].items()) or "-"
        counted = ("redis_reads", "redis_scripts", "redis_commands", "sql_statements")
        rows.append([v.name, *(c[f] for f in counted), kinds])
    headers = ["variant", "Redis reads", "Lua scripts", "Redis commands*", "SQL stmts", "SQL"]
    print(table(headers, rows), file=out)
    print(
        "* including the commands run inside Lua scripts. Reads ~ round trips: a pipeline is "
        "one read.",
        file=out,
    )

    print(
        "\n## CPU ms per task, by process (scheduler run time, /proc/<pid>/task/*/schedstat)",
        file=out,
    )
    components = sorted({k for c in result["cpu_ms_per_task"].values() for k in c} - {MACHINE})
    medians = {v.name: statistics.median(r[v.name] for r in result["rounds"]) for v in variants}
    rows = []
    for v in variants:
        c = result["cpu_ms_per_task"][v.name]
        machine = c.get(MACHINE, 0.0)
        busy = machine * medians[v.name] / 1000 / (os.cpu_count() or 1)
        rows.append(
            [
                v.name,
                *(c.get(k, 0.0) for k in components),
                sum(c.get(k, 0.0) for k in components),
                machine,
                f"{100 * busy:.0f}%",
            ]
        )
    print(
        table(["variant", *components, "total", "machine", "machine busy"], rows, digits=3),
        file=out,
    )
    print(
        "machine: all CPUs' busy time (/proc/stat) while the run consumed, per task; machine "
        "busy: that over the run's CPU capacity.",
        file=out,
    )

    print(
        "\n## Per task, counted in the worker (BENCH_TRACE=1): the task's own thread vs "
        "background threads",
        file=out,
    )
    rows = []
    for v in variants:
        if v.name not in result["trace"]:
            continue
        t = result["trace"][v.name]
        fields = (
            "redis_critical",
            "pg_critical",
            "blocking_round_trips",
            "redis_off",
            "pg_off",
            "sqlite_critical",
        )
        rows.append([v.name, *(t[f] for f in fields)])
    headers = [
        "variant",
        "Redis RTs",
        "PG stmts",
        "blocking RTs",
        "background Redis RTs",
        "background PG",
        "SQLite stmts",
    ]
    print(table(headers, rows), file=out)
    print(
        "blocking RTs: lease-Redis round trips + PostgreSQL statements sent by the thread that "
        "runs the task.",
        file=out,
    )


def _load(load: Any) -> str:
    return "/".join(f"{x:.2f}" for x in load)
