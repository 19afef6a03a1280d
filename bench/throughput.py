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
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

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
    old: str | None = None  # before/after: the variant this one is, on the --rev worker
    metrics: bool = False  # run by the BENCH_METRICS=1 worker (Prometheus metrics on)

    @property
    def worker(self) -> str:
        """Which worker runs it: ``main`` (the working tree), ``exp`` or ``old`` (``--rev``)."""
        if self.old:
            return "old"
        return "exp" if self.experimental else "metrics" if self.metrics else "main"

    @property
    def fenced(self) -> bool:
        return self.task.startswith("bench.fenced")


VARIANTS = (
    Variant("plain", "bench.plain", 0.0, None, "-"),
    Variant("fenced-pg", "bench.fenced_pg", 0.0, "plain", "postgresql"),
    Variant("fenced-pg-redisresult", "bench.fenced_pg_redisresult", 0.0, "plain", "postgresql"),
    Variant("fenced-pg-group", "bench.fenced_pg_group", 0.0, "plain", "postgresql"),
    Variant("fenced-pg-ratelimit", "bench.fenced_pg_ratelimit", 0.0, "plain", "postgresql"),
    Variant("fenced-pg-metrics", "bench.fenced_pg", 0.0, "plain", "postgresql", metrics=True),
    Variant("plain-dbresult", "bench.plain_dbresult", 0.0, "plain", "postgresql"),
    Variant("fenced-sqlite", "bench.fenced_sqlite", 0.0, "plain", "sqlite"),
    Variant("redis-lock", "bench.rlock", 0.0, "plain", "-"),
    Variant("celery-once", "bench.once", 0.0, "plain", "-"),
    Variant("plain-50ms", "bench.plain", 0.05, None, "-"),
    Variant("fenced-pg-50ms", "bench.fenced_pg", 0.05, "plain-50ms", "postgresql"),
)
#: With ``--experiment``: the same tasks on the second worker, each right after its reference.
EXPERIMENTS = {
    "fenced-pg": Variant("fenced-pg-exp", "bench.fenced_pg", 0.0, "plain", "postgresql", True),
    "fenced-sqlite": Variant(
        "fenced-sqlite-exp", "bench.fenced_sqlite", 0.0, "plain", "sqlite", True
    ),
}

#: Before/after (``--rev``, on by default): these run on a second worker importing
#: ``celery_fence`` as of the revision, each named ``<name>@old``, in the same rounds.
BEFORE_AFTER = (
    "fenced-pg",
    "fenced-sqlite",
    "fenced-pg-50ms",
    "fenced-pg-group",
    "fenced-pg-ratelimit",
)


def old_copy(v: Variant) -> Variant:
    return Variant(f"{v.name}@old", v.task, v.sleep, v.baseline, v.store, old=v.name)


class TasksFailed(RuntimeError):
    """A variant's tasks did not all succeed: its throughput would count failures as work."""


#: Throughput ratios printed as the headline, each within a round: (numerator, denominator).
#: fenced-pg / plain-dbresult: a fenced task with its result in PostgreSQL against plain Celery
#: with its own database result backend on the same PostgreSQL (the like-for-like durable
#: result); fenced-pg-redisresult / fenced-pg: the cost of also writing the result to Redis.
HEADLINES = (
    ("fenced-pg", "plain-dbresult"),
    ("fenced-pg-redisresult", "fenced-pg"),
    ("fenced-pg-group", "fenced-pg"),
    ("fenced-pg-ratelimit", "fenced-pg"),
    ("fenced-pg-metrics", "fenced-pg"),
)
#: The worker tree's processes in the CPU counts (the rest: the servers and the machine).
WORKER_TREE = ("worker main", "worker children")


def select(
    only: frozenset[str] | None, *, experiment: bool, before_after: bool = False
) -> tuple[Variant, ...]:
    """The variants to run, in order: ``only`` (with the baselines their ratios need) or all;
    with ``experiment``, each reference in :data:`EXPERIMENTS` then its second-worker copy; with
    ``before_after``, each of :data:`BEFORE_AFTER` then its ``@old`` copy."""
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
            if before_after and v.name in BEFORE_AFTER:
                chosen.append(old_copy(v))
    return tuple(chosen)


def round_order(variants: tuple[Variant, ...], r: int) -> tuple[str, tuple[Variant, ...]]:
    """Round ``r``'s order (0-based): as listed when ``r`` is even, else reversed, so each pair (new
    then old, plain then fenced) runs in both orders: the later of two runs reads higher on a
    busy machine (issue 33 measured about 5 %)."""
    return ("forward", variants) if r % 2 == 0 else ("reversed", tuple(reversed(variants)))


def succeeded(svc: Services, v: Variant, run: str) -> int:
    """How many of run ``run``'s tasks succeeded: completed rows in the fence store for a fenced
    variant (keys ``<run>:<i>``), else the successes the pool processes counted."""
    if v.fenced:
        url = svc.sqlite_url if v.store == "sqlite" else svc.pg_url
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                return int(
                    conn.execute(
                        sa.text(
                            "SELECT count(*) FROM fence_jobs WHERE key LIKE :p "
                            "AND status = 'completed'"
                        ),
                        {"p": f"{run}:%"},
                    ).scalar_one()
                )
        finally:
            engine.dispose()
    path = svc.success_dir / run
    return path.stat().st_size if path.exists() else 0


def check_succeeded(svc: Services, runs: list[tuple[Variant, int, str, int]]) -> dict[str, Any]:
    """Every timed run's tasks succeeded, or :class:`TasksFailed` naming each variant, round and
    how many of N. Returns {variant: succeeded of sent, over every round}."""
    totals: dict[str, list[int]] = {}
    short = []
    for v, r, run, n in runs:
        ok = succeeded(svc, v, run)
        t = totals.setdefault(v.name, [0, 0])
        t[0] += ok
        t[1] += n
        if ok != n:
            short.append(f"{v.name}: {ok} of {n} tasks succeeded in round {r + 1}")
    if short:
        raise TasksFailed(
            "not reported: a throughput that counts failed tasks is no throughput.\n  "
            + "\n  ".join(short)
        )
    return {name: f"{ok} of {n}" for name, (ok, n) in totals.items()}


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
    rev: str | None = None,
    rev_fence_path: str | None = None,
) -> dict[str, Any]:
    """The rounds; with ``rev_fence_path`` (``celery_fence`` as of ``rev``), before/after too."""
    variants = select(only, experiment=experiment, before_after=bool(rev_fence_path))
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
    workers = {"main": worker}
    if rev_fence_path:
        workers["old"] = BenchWorker(
            svc.worker_env(BENCH_FENCE_PATH=rev_fence_path),
            queue=f"{svc.queue}-old",
            log_dir=svc.workdir,
            concurrency=concurrency,
            loglevel=loglevel,
        )
        result["rev"] = rev
    if experiment:
        workers["exp"] = BenchWorker(
            svc.worker_env(
                BENCH_EXPERIMENT="1",
                **({"BENCH_FENCE_PATH": experiment_fence_path} if experiment_fence_path else {}),
            ),
            queue=f"{svc.queue}-exp",
            log_dir=svc.workdir,
            concurrency=concurrency,
            loglevel=loglevel,
        )
    if any(v.worker == "metrics" for v in variants):
        workers["metrics"] = BenchWorker(
            svc.worker_env(BENCH_METRICS="1"),
            queue=f"{svc.queue}-metrics",
            log_dir=svc.workdir,
            concurrency=concurrency,
            loglevel=loglevel,
        )
    cpu_counters = {name: CpuCounter(svc, w) for name, w in workers.items()}
    runs: list[tuple[Variant, int, str, int]] = []  # (variant, round, run id, tasks sent)
    result["worker_cpu_rounds"] = []
    result["orders"] = []
    try:
        for w in workers.values():
            w.start_answering(control)
            set_consuming(control, w, False)
        for v in variants:  # warm-up: connections, scripts, SQLite schema, imports
            w = workers[v.worker]
            timed_run(svc, control, broker, w, v.task, min(200, sizes[v.name]), sleep=v.sleep)
        print(f"# worker: {result['worker_command']}", file=out)
        if experiment_fence_path:
            print(f"# *-exp: celery_fence from {experiment_fence_path}", file=out)
        if rev_fence_path:
            print(f"# *@old: celery_fence as of {rev} (from {rev_fence_path})", file=out)
        print(
            f"# {'round':>5} " + " ".join(f"{v.name:>15}" for v in variants) + "   tasks/s",
            file=out,
        )
        for r in range(rounds):
            row: dict[str, float] = {}
            cpu_row: dict[str, float] = {}
            order, ordered = round_order(variants, r)
            result["orders"].append(order)
            for v in ordered:
                r0, p0 = lease_counter.snapshot(), pg_counter.snapshot()
                w, cpu_counter = workers[v.worker], cpu_counters[v.worker]
                c0: Counter[str] = Counter()  # taken once the messages are published
                run_id = uuid.uuid4().hex[:10]
                seconds = timed_run(
                    *(svc, control, broker, w, v.task, sizes[v.name]),
                    sleep=v.sleep,
                    on_start=functools.partial(_snapshot_into, c0, cpu_counter),
                    run=run_id,
                )
                time.sleep(0.3)  # releases left to the renewer thread go out within 20 ms
                c1 = cpu_counter.snapshot()
                r1, p1 = lease_counter.snapshot(), pg_counter.snapshot()
                spent = Counter({k: c1[k] - c0.get(k, 0.0) for k in c1})
                cpu_totals[v.name] += spent
                cpu_row[v.name] = 1000 * sum(spent[k] for k in WORKER_TREE) / sizes[v.name]
                redis_totals[v.name] += RedisCounter.delta(r0, r1)
                sql_totals[v.name] += PgCounter.delta(p0, p1)
                row[v.name] = sizes[v.name] / seconds
                runs.append((v, r, run_id, sizes[v.name]))
            result["rounds"].append(row)
            result["worker_cpu_rounds"].append(cpu_row)
            print(
                f"  {r + 1:>5} "
                + " ".join(f"{row[v.name]:>15.1f}" for v in variants)
                + f"   ({order} order)",
                file=out,
                flush=True,
            )
        # a consumed message is not a success: count what each run's tasks completed
        result["succeeded"] = check_succeeded(svc, runs)
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
    result["spread"] = spread(variants, result["rounds"], result["worker_cpu_rounds"])
    result["before_after"] = before_after(
        variants, result["rounds"], result["worker_cpu_rounds"], result["orders"]
    )
    result["counts"] = per_task_counts(variants, redis_totals, sql_totals, sizes, rounds)
    result["cpu_ms_per_task"] = {
        v.name: {k: 1000 * c / (sizes[v.name] * rounds) for k, c in cpu_totals[v.name].items()}
        for v in variants
    }
    result["worker_cpu_ms_per_task"] = {
        name: sum(c.get(k, 0.0) for k in WORKER_TREE)
        for name, c in result["cpu_ms_per_task"].items()
    }
    result["trace"] = (
        traced_pass(svc, control, broker, trace_tasks, concurrency, loglevel)
        if trace_tasks > 0
        else {}
    )
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


def _mmm(values: list[float]) -> dict[str, Any]:
    return {
        "per_round": values,
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
    }


def spread(
    variants: tuple[Variant, ...], rounds: list[dict[str, float]], cpu: list[dict[str, float]]
) -> dict[str, dict[str, Any]]:
    """Per variant, tasks/s and worker CPU ms a task, min / median / max over the rounds."""
    return {
        v.name: {
            "tasks_per_s": _mmm([row[v.name] for row in rounds]),
            "worker_cpu_ms": _mmm([row[v.name] for row in cpu]),
        }
        for v in variants
    }


def before_after(
    variants: tuple[Variant, ...],
    rounds: list[dict[str, float]],
    cpu: list[dict[str, float]],
    orders: list[str],
) -> dict[str, dict[str, Any]]:
    """Per ``@old`` pair, within each round: new/old tasks/s and new/old worker CPU a task,
    min / median / max, and the median in each order (forward: new ran first)."""
    out: dict[str, dict[str, Any]] = {}
    for v in variants:
        if not v.old:
            continue
        new, old = v.old, v.name
        speed = [row[new] / row[old] for row in rounds]
        cost = [row[new] / max(row[old], 1e-9) for row in cpu]
        out[new] = {
            "old": old,
            "ratio": _mmm(speed),
            "cpu_ratio": _mmm(cost),
            "by_order": {
                order: statistics.median(
                    x for x, o in zip(speed, orders, strict=True) if o == order
                )
                for order in sorted(set(orders))
            },
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
        tps, cpu = (
            result["spread"][v.name]["tasks_per_s"],
            result["spread"][v.name]["worker_cpu_ms"],
        )
        ratio = result["ratios"].get(v.name)
        spread = (ratio["min"], ratio["median"], ratio["max"]) if ratio else ("-", "1", "-")
        rows.append(
            [
                v.name,
                result["sizes"][v.name],
                *(f"{tps[k]:.0f}" for k in ("min", "median", "max")),
                *spread,
                *(cpu[k] for k in ("min", "median", "max")),
            ]
        )
    headers = ["variant", "tasks/run", "tasks/s min", "median", "max"]
    headers += ["ratio min", "median", "max", "worker CPU ms min", "median", "max"]
    print(table(headers, rows, digits=3), file=out)
    print(
        "min / median / max over the rounds. ratio: to plain (to plain-50ms for the 50 ms rows), "
        "within each round; worker CPU ms: per task, the worker's main process and its pool "
        "children (scheduler run time). Every task of every run succeeded (checked: "
        + ", ".join(f"{k} {x}" for k, x in result["succeeded"].items())
        + ").",
        file=out,
    )
    if result["before_after"]:
        print_before_after(result, out)
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

    if not result["trace"]:
        return
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


def print_before_after(result: dict[str, Any], out: Any) -> None:
    rev, orders = result.get("rev", "?"), result["orders"]
    print(
        f"\n## Before/after: working tree (new) vs celery_fence as of {rev} (old), same rounds, "
        f"orders by round: {', '.join(orders)}",
        file=out,
    )
    rows = []
    for new, ba in result["before_after"].items():
        old = ba["old"]
        for name in (new, old):
            tps = result["spread"][name]["tasks_per_s"]
            cpu = result["spread"][name]["worker_cpu_ms"]
            rows.append(
                [
                    name,
                    *(f"{tps[k]:.0f}" for k in ("min", "median", "max")),
                    *(cpu[k] for k in ("min", "median", "max")),
                ]
            )
    headers = ["variant", "tasks/s min", "median", "max", "worker CPU ms min", "median", "max"]
    print(table(headers, rows, digits=3), file=out)
    rows = []
    for new, ba in result["before_after"].items():
        r, c = ba["ratio"], ba["cpu_ratio"]
        by_order = ba["by_order"]
        rows.append(
            [
                f"{new} / {ba['old']}",
                r["min"],
                r["median"],
                r["max"],
                by_order.get("forward", "-"),
                by_order.get("reversed", "-"),
                c["min"],
                c["median"],
                c["max"],
            ]
        )
    headers = ["new / old", "tasks/s ratio min", "median", "max", "forward", "reversed"]
    headers += ["CPU ratio min", "median", "max"]
    print(table(headers, rows, digits=3), file=out)
    print(
        "ratios within each round, min / median / max over the rounds; forward: new ran first "
        "in the round, reversed: old ran first (median of those rounds). Call a change real only "
        "where the ratio's whole spread, in both orders, is on one side of 1.",
        file=out,
    )


def _load(load: Any) -> str:
    return "/".join(f"{x:.2f}" for x in load)
