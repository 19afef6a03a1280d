"""``--latency``: per task, the time from publish to result stored, at a steady rate well below
saturation, every variant side by side in one run.

One worker (``-P prefork -c 4 -E``) consumes all the time; the caller publishes ``tasks`` messages
of a variant at ``rate`` a second, evenly spaced, each a ``sleep`` s body, then the next variant:
the variants alternate within each round. Each variant stores its result once: plain Celery and
python-redis-lock in a Redis result backend (the lease Redis, db 1), the fenced tasks in their
store (PostgreSQL or SQLite).

The observation, the same for every variant: the caller receives Celery's ``task-succeeded``
event for the task id. The worker's main process sends it once the pool child has returned, so
by then the result is stored (written to the result backend, or committed by the fence's
completion). Latency = that receipt minus the moment the caller started to publish the message
(both on the caller's monotonic clock). The fence's own events (``fence_send_events``) are off in
this worker, as on a worker run without ``-E``: only Celery's task events are sent.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa

from bench.harness import BenchWorker, Services
from bench.report import table
from bench.throughput import machine


@dataclass(frozen=True)
class Variant:
    name: str
    task: str
    label: str
    experimental: bool = False  # run by the second worker (--experiment-rev)


VARIANTS = (
    Variant("plain", "bench.plain_redisresult", "plain Celery, Redis result backend"),
    Variant("fenced-pg", "bench.fenced_pg", "fenced, PostgreSQL"),
    Variant("fenced-sqlite", "bench.fenced_sqlite", "fenced, SQLite"),
    Variant(
        "redis-lock",
        "bench.rlock_redisresult",
        "python-redis-lock, auto-renewal, Redis result backend",
    ),
    Variant("plain-noresult", "bench.plain", "plain Celery, no result stored"),
)
EXPERIMENTS = {
    "fenced-pg": Variant("fenced-pg-exp", "bench.fenced_pg", "fenced-pg, *-exp revision", True),
    "fenced-sqlite": Variant(
        "fenced-sqlite-exp", "bench.fenced_sqlite", "fenced-sqlite, *-exp revision", True
    ),
}
BASELINE = "plain"
PERCENTILES = (0.5, 0.9, 0.99)


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def switches(pids: list[int]) -> int:
    """Voluntary context switches so far of every thread of ``pids``: each is a thread going to
    sleep (a blocking round trip, a wait for another thread), so the per-task difference counts
    the wake-ups the task costs, whatever else the machine runs."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                for line in (task / "status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return total


def floor_probe(svc: Services, n: int, gap: float) -> dict[str, list[float]]:
    """What one round trip costs after ``gap`` s idle, as the fenced path meets it: a lease-Redis
    ``PING``, a PostgreSQL ``SELECT 1``, and a one-row ``INSERT`` committed synchronously (its
    WAL flushed, as every fence commit is) and asynchronously (``synchronous_commit=off``: the
    same statement without waiting for the flush), ms."""
    client = redis.Redis.from_url(svc.lease_redis.url)
    engine = sa.create_engine(svc.pg_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    out: dict[str, list[float]] = {"redis PING": [], "pg SELECT 1": [], "pg commit": []}
    out["pg commit, no flush wait"] = []
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS bench_probe (at timestamptz)")
            client.ping()
            for _ in range(n):
                for name, call in (
                    ("redis PING", client.ping),
                    ("pg SELECT 1", lambda: conn.exec_driver_sql("SELECT 1")),
                    (
                        "pg commit",
                        lambda: conn.exec_driver_sql("INSERT INTO bench_probe VALUES (now())"),
                    ),
                ):
                    time.sleep(gap)
                    t0 = time.perf_counter()
                    call()
                    out[name].append((time.perf_counter() - t0) * 1000)
                conn.exec_driver_sql("SET synchronous_commit TO off")
                time.sleep(gap)
                t0 = time.perf_counter()
                conn.exec_driver_sql("INSERT INTO bench_probe VALUES (now())")
                out["pg commit, no flush wait"].append((time.perf_counter() - t0) * 1000)
                conn.exec_driver_sql("SET synchronous_commit TO on")
    finally:
        engine.dispose()
        client.close()
    return out


class Observer:
    """Receives ``task-succeeded`` / ``task-failed`` events on a thread of its own and notes the
    caller's monotonic time of receipt per task id."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.done: dict[str, float] = {}
        #: per task id: the worker's task-received timestamp, the child's runtime (s)
        self.received: dict[str, float] = {}
        self.runtime: dict[str, float] = {}
        self.failed: set[str] = set()
        self.ready = threading.Event()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, name="bench-latency-events", daemon=True)

    def start(self) -> Observer:
        self._thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("the event receiver did not start")
        return self

    def _run(self) -> None:
        def received(event: dict[str, Any]) -> None:
            self.received[event["uuid"]] = event["timestamp"]

        def succeeded(event: dict[str, Any]) -> None:
            self.runtime[event["uuid"]] = float(event.get("runtime") or 0.0)
            self.done[event["uuid"]] = time.monotonic()

        def failed(event: dict[str, Any]) -> None:
            self.failed.add(event["uuid"])
            self.done[event["uuid"]] = time.monotonic()

        with self.app.connection_for_read() as conn:
            receiver = self.app.events.Receiver(
                conn,
                handlers={
                    "task-received": received,
                    "task-succeeded": succeeded,
                    "task-failed": failed,
                },
            )
            iterations = 0

            def on_iteration() -> None:  # the second: one drain ran, the queue is subscribed
                nonlocal iterations
                iterations += 1
                if iterations == 2:
                    self.ready.set()

            receiver.on_iteration = on_iteration
            self._receiver = receiver
            for _ in receiver.consume(limit=None, timeout=None, safety_interval=0.2):
                pass

    def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(timeout=5)


def paced_run(
    control: Any,
    observer: Observer,
    task: str,
    queue: str,
    n: int,
    *,
    rate: float,
    sleep: float,
    timeout: float = 120.0,
) -> list[tuple[float, float, float]]:
    """Publish ``n`` messages at ``rate`` a second; return, for each, its latency, the part
    before the worker received it and the pool child's run time (ms)."""
    sent: dict[str, float] = {}
    wall: dict[str, float] = {}
    interval = 1.0 / rate
    run = uuid.uuid4().hex[:10]
    with control.producer_or_acquire() as producer:
        due = time.monotonic()
        for i in range(n):
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            task_id = uuid.uuid4().hex
            wall[task_id], sent[task_id] = time.time(), time.monotonic()
            control.send_task(
                task,
                args=(f"{run}:{i}",),
                kwargs={"sleep": sleep},
                queue=queue,
                task_id=task_id,
                producer=producer,
            )
            due += interval
    end = time.monotonic() + timeout
    while any(t not in observer.done for t in sent):
        if time.monotonic() > end:
            missing = sum(t not in observer.done for t in sent)
            raise TimeoutError(f"{task}: {missing} of {n} tasks not observed in {timeout}s")
        time.sleep(0.01)
    failed = observer.failed & sent.keys()
    if failed:
        raise RuntimeError(f"{task}: {len(failed)} of {n} tasks failed (see the worker log)")
    return [
        (
            (observer.done[t] - sent[t]) * 1000,
            (observer.received.get(t, wall[t]) - wall[t]) * 1000,
            observer.runtime.get(t, 0.0) * 1000,
        )
        for t in sent
    ]


def select(only: frozenset[str] | None, experiment: bool) -> tuple[Variant, ...]:
    if only is not None:
        unknown = only - {v.name for v in VARIANTS}
        if unknown:
            raise SystemExit(
                f"--variants: unknown {', '.join(sorted(unknown))}; "
                f"known with --latency: {', '.join(v.name for v in VARIANTS)}"
            )
        only = only | {BASELINE}
    chosen: list[Variant] = []
    for v in VARIANTS:
        if only is None or v.name in only:
            chosen.append(v)
            if experiment and v.name in EXPERIMENTS:
                chosen.append(EXPERIMENTS[v.name])
    return tuple(chosen)


def run(
    svc: Services,
    *,
    rounds: int,
    tasks: int,
    rate: float,
    sleep: float,
    concurrency: int,
    loglevel: str,
    out: Any,
    experiment_fence_path: str | None = None,
    only: frozenset[str] | None = None,
) -> dict[str, Any]:
    variants = select(only, experiment_fence_path is not None)
    control = svc.control()
    env = svc.worker_env(BENCH_FENCE_EVENTS="0")
    workers = {
        False: BenchWorker(
            env,
            queue=svc.queue,
            log_dir=svc.workdir,
            concurrency=concurrency,
            loglevel=loglevel,
            extra_args=("-E",),
        )
    }
    if experiment_fence_path is not None:
        workers[True] = BenchWorker(
            {**env, "BENCH_FENCE_PATH": experiment_fence_path},
            queue=f"{svc.queue}-exp",
            log_dir=svc.workdir,
            concurrency=concurrency,
            loglevel=loglevel,
            extra_args=("-E",),
        )
    result: dict[str, Any] = {
        "machine": machine(),
        "load_before": os.getloadavg(),
        "rate": rate,
        "sleep": sleep,
        "tasks": tasks,
        "rounds": rounds,
        "worker_command": " ".join(workers[False].command()[1:]),
        "variants": {},
    }
    samples: dict[str, list[float]] = {v.name: [] for v in variants}
    delivery: dict[str, list[float]] = {v.name: [] for v in variants}
    wakeups: dict[str, int] = {v.name: 0 for v in variants}
    probes: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {v.name: [] for v in variants}
    medians: dict[str, list[float]] = {v.name: [] for v in variants}
    observer = Observer(control).start()
    try:
        for w in workers.values():
            w.start_answering(control)
        warm = max(8 * concurrency, 20)
        for v in variants:  # every pool child connects and loads its scripts before timing
            w = workers[v.experimental]
            paced_run(control, observer, v.task, w.queue, warm, rate=rate, sleep=sleep)
        print(f"# worker: {result['worker_command']}", file=out)
        if experiment_fence_path:
            print(f"# *-exp: celery_fence from {experiment_fence_path}", file=out)
        print(
            f"# {'round':>5} " + " ".join(f"{v.name:>17}" for v in variants) + "   p50 ms",
            file=out,
        )
        for r in range(rounds):
            row = {}
            for v in variants:
                w = workers[v.experimental]
                children = w.children()
                before = switches(children)
                timed = paced_run(control, observer, v.task, w.queue, tasks, rate=rate, sleep=sleep)
                wakeups[v.name] += switches(children) - before
                values = [t[0] for t in timed]
                samples[v.name] += values
                delivery[v.name] += [t[1] for t in timed]
                runtime[v.name] += [t[2] for t in timed]
                row[v.name] = statistics.median(values)
                medians[v.name].append(row[v.name])
            print(
                f"  {r + 1:>5} " + " ".join(f"{row[v.name]:>17.2f}" for v in variants),
                file=out,
                flush=True,
            )
            for name, values in floor_probe(svc, 20, 1.0 / rate).items():
                probes.setdefault(name, []).extend(values)
    finally:
        observer.stop()
        for w in workers.values():
            w.stop()
    result["load_after"] = os.getloadavg()
    base = samples[BASELINE]
    for v in variants:
        values = samples[v.name]
        entry: dict[str, Any] = {
            "label": v.label,
            "n": len(values),
            "p50_ms": pct(values, 0.5),
            "p90_ms": pct(values, 0.9),
            "p99_ms": pct(values, 0.99),
            "max_ms": max(values),
            "round_p50_ms": medians[v.name],
            "to_worker_p50_ms": pct(delivery[v.name], 0.5),
            "runtime_p50_ms": pct(runtime[v.name], 0.5),
            "runtime_p99_ms": pct(runtime[v.name], 0.99),
            "switches_per_task": wakeups[v.name] / len(values),
        }
        entry["added_p50_ms"] = entry["p50_ms"] - pct(base, 0.5)
        entry["added_p99_ms"] = entry["p99_ms"] - pct(base, 0.99)
        entry["added_p50_per_round_ms"] = [
            a - b for a, b in zip(medians[v.name], medians[BASELINE], strict=True)
        ]
        result["variants"][v.name] = entry
    result["probe"] = {
        name: {"p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99), "n": len(values)}
        for name, values in probes.items()
    }
    print_report(variants, result, out)
    return result


def print_report(variants: tuple[Variant, ...], result: dict[str, Any], out: Any) -> None:
    m = result["machine"]
    load = "/".join(f"{x:.2f}" for x in result["load_before"])
    load_after = "/".join(f"{x:.2f}" for x in result["load_after"])
    print(
        f"\n# machine: {m['cpus']} CPUs ({m['cpu']}), Python {m['python']}, {m['system']}",
        file=out,
    )
    print(f"# load average (1/5/15 min): {load} before, {load_after} after", file=out)
    print(
        f"\n## Latency, publish -> result stored: {result['sleep'] * 1000:.0f} ms tasks at "
        f"{result['rate']:g}/s, {result['tasks']} a variant x {result['rounds']} rounds "
        "(alternating); ms",
        file=out,
    )
    rows = []
    for v in variants:
        e = result["variants"][v.name]
        per_round = e["added_p50_per_round_ms"]
        spread = "-" if v.name == BASELINE else f"{min(per_round):+.2f} .. {max(per_round):+.2f}"
        added = (
            ("-", "-")
            if v.name == BASELINE
            else (f"{e['added_p50_ms']:+.2f}", f"{e['added_p99_ms']:+.2f}")
        )
        rows.append([v.name, e["p50_ms"], e["p90_ms"], e["p99_ms"], e["max_ms"], *added, spread])
    headers = [
        "variant",
        "p50",
        "p90",
        "p99",
        "max",
        "added p50",
        "added p99",
        "added p50 per round",
    ]
    print(table(headers, rows), file=out)
    print(
        f"added: the percentile minus {BASELINE}'s over all rounds ({BASELINE}: "
        f"{result['variants'][BASELINE]['label']}); per round: the round's median minus "
        f"{BASELINE}'s in the same round. Observed: the caller's receipt of Celery's "
        "task-succeeded event (sent once the result is stored).",
        file=out,
    )
    print("\n## Where the time goes (p50, ms)", file=out)
    rows = []
    for v in variants:
        e = result["variants"][v.name]
        rest = e["p50_ms"] - e["to_worker_p50_ms"] - e["runtime_p50_ms"]
        rows.append(
            [
                v.name,
                e["to_worker_p50_ms"],
                e["runtime_p50_ms"],
                e["runtime_p99_ms"],
                rest,
                e["switches_per_task"],
            ]
        )
    headers = [
        "variant",
        "publish -> worker",
        "child run time",
        "run time p99",
        "rest",
        "child wake-ups a task",
    ]
    print(table(headers, rows), file=out)
    print(
        "publish -> worker: to the worker's task-received event (its timestamp); child run time: "
        "the task-succeeded event's runtime (the pool child's trace: the fence's claim, "
        "registration and completion, and the body); rest: the p50 latency minus both (child -> "
        "main process, the event to the caller); wake-ups: voluntary context switches of every "
        "thread of the pool children (/proc/<pid>/task/*/status), per task.",
        file=out,
    )
    print(
        f"\n## One round trip after {1000 / result['rate']:.0f} ms idle, on the bench's servers "
        "(the same run, between rounds), ms",
        file=out,
    )
    rows = [[name, p["p50_ms"], p["p99_ms"]] for name, p in result["probe"].items()]
    print(table(["round trip", "p50", "p99"], rows), file=out)
    print(
        "pg commit: a one-row INSERT committed with its WAL flushed (each fence commit: "
        "fenced-pg has two a task: the completion waits for its flush, the registration "
        "does not); no flush wait: the same with synchronous_commit off.",
        file=out,
    )
