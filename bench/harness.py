"""What every benchmark mode shares: the servers, the worker, publishing, and counting.

A run publishes ``n`` messages while the worker does not consume the queue, then tells it to
consume (``add_consumer``) and times until the queue and kombu's ``unacked`` hash are both empty
(with ``acks_late`` a message leaves ``unacked`` when the task has finished): every task is
done, acked, and nothing else was on the clock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from bench.servers import PrivatePostgres, PrivateRedis, wait_for
from celery_fence.testing import processes

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PG_ADMIN_URL = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"


# -- the worker -------------------------------------------------------------------------------


class BenchWorker(processes.Worker):
    """One ``celery worker`` of :mod:`bench.app`, in its own process group (the project's one
    process module, :mod:`celery_fence.testing.processes`); ready once it answers a ping."""

    def __init__(
        self,
        env: dict[str, str],
        *,
        queue: str,
        log_dir: Path,
        pool: str = "prefork",
        concurrency: int = 4,
        loglevel: str = "WARNING",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        name = f"bench-{uuid.uuid4().hex[:6]}"
        super().__init__(
            "bench.app",
            env={**env, "BENCH_POOL": pool},
            queue=queue,
            name=name,
            log_dir=log_dir,
            concurrency=concurrency,
            pool=pool,
            loglevel=loglevel,
            extra_args=extra_args,
            # --rev / --experiment-rev: that revision's celery_fence first, as happy_path does
            # (``python -m`` puts the working directory before PYTHONPATH: run from there too)
            cwd=Path(env["BENCH_FENCE_PATH"]) if env.get("BENCH_FENCE_PATH") else ROOT,
            pythonpath=[*filter(None, [env.get("BENCH_FENCE_PATH")]), str(ROOT)],
            prefetch_multiplier=None,  # Celery's default, as a user's worker has it
        )
        self.hostname = f"{name}@{socket.gethostname()}"

    def start_answering(self, control: Celery, timeout: float = 60.0) -> BenchWorker:
        """Start the worker and wait until it answers a control ping."""
        self.launch()

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker exited at start:\n{self.log()[-3000:]}")
            return bool(control.control.ping(destination=[self.hostname], timeout=0.5))

        if not processes.poll_until(answers, timeout, interval=0.0):
            self.stop()
            raise TimeoutError(f"worker not ready in {timeout}s:\n{self.log()[-3000:]}")
        return self

    def children(self) -> list[int]:
        """Pids of the pool processes (prefork children of the main worker process)."""
        assert self.proc is not None
        return sorted(children_of(self.proc.pid))


def rss_kib(pid: int) -> int:
    """``VmRSS`` of a process, KiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """CPU seconds the live threads of a process have run so far (0 when it is gone).

    From the scheduler's own run-time clock (``/proc/<pid>/task/<tid>/schedstat``, nanoseconds),
    not from ``utime``/``stime``: those are sampled at timer ticks, and a process that wakes
    on a timer is on the CPU at every tick, so short sleeps (a 50 ms task) get charged whole
    ticks they did not use. Falls back to ``/proc/<pid>/stat`` where schedstat is missing.
    """
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        return 0.0
    if total:
        return total / 1e9
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: The CpuCounter entry holding the whole machine's busy CPU seconds.
MACHINE = "machine"


def machine_busy_seconds() -> float:
    """Busy CPU seconds of all CPUs since boot (``/proc/stat``: everything but idle and
    iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / CLOCK_TICKS


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


class CpuCounter:
    """CPU seconds by component: the worker's main process, its pool children, PostgreSQL (the
    private cluster's processes), the lease Redis and the broker Redis."""

    def __init__(self, svc: Services, worker: BenchWorker) -> None:
        self.svc = svc
        self.worker = worker

    def _groups(self) -> dict[str, list[int]]:
        assert self.worker.proc is not None
        groups = {
            "worker main": [self.worker.proc.pid],
            "worker children": self.worker.children(),
            "redis (lease)": [self.svc.lease_redis.pid],
        }
        if self.svc.broker_redis is not None:
            groups["redis (broker)"] = [self.svc.broker_redis.pid]
        postmaster = self.svc.pg.postmaster_pid() if self.svc.pg is not None else None
        if postmaster:
            groups["postgresql"] = [postmaster, *children_of(postmaster)]
        return groups

    def snapshot(self) -> Counter[str]:
        """CPU seconds so far by component, plus ``machine``: every CPU's busy time (the
        kernel's, the bench's own and anything else running included)."""
        counts: dict[str, float] = {
            name: sum(cpu_seconds(p) for p in pids) for name, pids in self._groups().items()
        }
        counts[MACHINE] = machine_busy_seconds()
        return Counter(counts)


# -- counting from the servers ------------------------------------------------------------------


class RedisCounter:
    """Deltas of ``INFO commandstats`` and ``total_reads_processed`` on a Redis the bench owns.

    Commands run inside Lua scripts are counted by Redis too (``get``, ``pexpire`` ...);
    ``evalsha`` counts the scripts themselves. ``reads`` (read events on client sockets) is the
    server's view of round trips: a pipeline arrives in one read. The counter's own ``INFO`` is
    taken out.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def snapshot(self) -> Counter[str]:
        info = self.client.info("all")
        out: Counter[str] = Counter()
        for name, value in info.items():
            if name.startswith("cmdstat_") and isinstance(value, dict):
                command = name[len("cmdstat_") :]
                if command != "info":
                    out[command] = int(value["calls"])
        out["_reads"] = int(info["total_reads_processed"])
        return out

    @staticmethod
    def delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
        d = Counter({k: after[k] - before.get(k, 0) for k in after})
        d["_reads"] -= 1  # the second snapshot's own INFO
        return +d


class PgCounter:
    """SQL statements run in one database, from ``pg_stat_statements`` when the server has it
    preloaded (per statement), else from ``pg_stat_database`` commits (AUTOCOMMIT: one per
    statement; the statistics reach that view up to ~10 s late, so the bench waits for them)."""

    def __init__(self, admin_url: str, database: str) -> None:
        self.engine = sa.create_engine(
            admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        self.database = database
        with self.engine.connect() as conn:
            self.dbid = conn.exec_driver_sql(
                "SELECT oid FROM pg_database WHERE datname = %(d)s", {"d": database}
            ).scalar_one()
            try:
                conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                conn.exec_driver_sql("SELECT count(*) FROM pg_stat_statements")
                self.per_statement = True
            except sa.exc.DBAPIError:
                self.per_statement = False

    @property
    def source(self) -> str:
        return "pg_stat_statements" if self.per_statement else "pg_stat_database xact_commit"

    def snapshot(self) -> Counter[str]:
        out: Counter[str] = Counter()
        with self.engine.connect() as conn:
            if self.per_statement:
                rows = conn.exec_driver_sql(
                    "SELECT query, calls FROM pg_stat_statements WHERE dbid = %(d)s",
                    {"d": self.dbid},
                ).all()
                for query, calls in rows:
                    out[classify_sql(query)] += int(calls)
            else:
                time.sleep(11)  # idle backends flush their statistics within 10 s
                value = conn.exec_driver_sql(
                    "SELECT xact_commit + xact_rollback FROM pg_stat_database "
                    "WHERE datname = %(d)s",
                    {"d": self.database},
                ).scalar_one()
                out["statements"] = int(value)
        return out

    @staticmethod
    def delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
        return +Counter({k: after[k] - before.get(k, 0) for k in after})

    def dispose(self) -> None:
        self.engine.dispose()


def classify_sql(query: str) -> str:
    q = " ".join(query.split())
    if "celery_taskmeta" in q:  # Celery's database result backend: "celery select", ...
        return f"celery {q.split(' ', 1)[0].lower()}"
    if q == "SELECT $1":  # a pool's pre-ping (Celery's database backend has pool_pre_ping on)
        return "ping"
    if "INSERT INTO fence_jobs" in q:
        return "register"
    if "UPDATE fence_jobs SET status" in q:  # constants are $n in pg_stat_statements' text
        return "complete"
    if q.upper().startswith(("BEGIN", "COMMIT", "ROLLBACK")):
        return "tx-control"
    return "other"


# -- the environment a mode runs in -------------------------------------------------------------


@dataclass
class Services:
    """The servers one benchmark uses, and the URLs the workers get."""

    lease_redis: PrivateRedis
    broker_redis: PrivateRedis | None
    broker_url: str
    pg: PrivatePostgres | None
    pg_admin_url: str
    database: str
    workdir: Path
    queue: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}")

    @property
    def pg_url(self) -> str:
        return str(sa.engine.make_url(self.pg_admin_url).set(database=self.database))

    @property
    def success_dir(self) -> Path:
        """Where the workers count their tasks' successes (one file a run, see bench.app)."""
        return self.workdir / "succeeded"

    @property
    def sqlite_url(self) -> str:
        return f"sqlite:///{self.workdir / 'bench.sqlite3'}"

    def worker_env(self, **extra: str) -> dict[str, str]:
        return {
            "BENCH_BROKER": self.broker_url,
            "BENCH_QUEUE": self.queue,
            "BENCH_LEASE_REDIS": self.lease_redis.url,
            "BENCH_PG_URL": self.pg_url,
            "BENCH_SQLITE_URL": self.sqlite_url,
            "BENCH_TRACE_DIR": str(self.workdir / "trace"),
            "BENCH_SUCCESS_DIR": str(self.success_dir),
            **extra,
        }

    def control(self) -> Celery:
        """The publishing app: control commands, and ``bench.once`` (sent through celery_once's
        ``apply_async``, which takes the lock)."""
        from bench import once

        app = Celery("fence_bench_client", broker=self.broker_url)
        app.conf.update(task_ignore_result=True, broker_connection_retry_on_startup=True)
        once.register(app, self.lease_redis.url)
        return app

    def broker(self) -> redis.Redis:
        return redis.Redis.from_url(self.broker_url)


@contextlib.contextmanager
def services(
    workdir: Path, *, broker_url: str | None = None, pg_admin_url: str | None = None
) -> Iterator[Services]:
    """Start a private lease Redis, a private broker Redis (unless ``broker_url``) and a private
    PostgreSQL (unless ``pg_admin_url``, or when no server binaries are found: then the local
    server); create the bench database and the fence tables; tear everything down after."""
    from celery_fence.store import Store

    (workdir / "trace").mkdir(parents=True, exist_ok=True)
    (workdir / "succeeded").mkdir(parents=True, exist_ok=True)
    started: list[Any] = []
    pg: PrivatePostgres | None = None
    try:
        lease = PrivateRedis("lease").start()
        started.append(lease)
        broker: PrivateRedis | None = None
        if broker_url is None:
            broker = PrivateRedis("broker").start()
            started.append(broker)
            broker_url = broker.url
        if pg_admin_url is None:
            try:
                pg = PrivatePostgres()
                started.append(pg)
                pg.start()
                pg_admin_url = pg.admin_url
            except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
                print(f"# no private PostgreSQL ({exc}); using {DEFAULT_PG_ADMIN_URL}")
                pg = None
                pg_admin_url = DEFAULT_PG_ADMIN_URL
        database = f"fence_bench_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(
            pg_admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{database}"')
        svc = Services(lease, broker, broker_url, pg, pg_admin_url, database, workdir)
        Store(svc.pg_url).create_schema()
        Store(svc.sqlite_url).create_schema()
        create_celery_result_tables(svc.pg_url)
        try:
            yield svc
        finally:
            from celery_fence.process.runtime import runtime

            for store in runtime().stores():
                store.dispose()
            if pg is None:
                with contextlib.suppress(Exception), admin.connect() as conn:
                    conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            admin.dispose()
    finally:
        for server in reversed(started):
            server.stop()


def create_celery_result_tables(url: str) -> None:
    """The tables of Celery's database result backend (``celery_taskmeta``, ...), created once
    before any worker starts, so no two pool processes race to create them."""
    from celery.backends.database import models

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        models.ResultModelBase.metadata.create_all(engine)
    finally:
        engine.dispose()


# -- one timed run ----------------------------------------------------------------------------


def publish(control: Celery, task: str, keys: list[str], queue: str, sleep: float) -> None:
    """Send one message a key. A task registered on the publishing app goes through its own
    ``apply_async`` (celery_once takes its lock there); any other by name."""
    kwargs = {"sleep": sleep} if sleep else None
    registered = control.tasks.get(task)
    with control.producer_or_acquire() as producer:
        for key in keys:
            if registered is not None:
                registered.apply_async(args=(key,), kwargs=kwargs, queue=queue, producer=producer)
            else:
                control.send_task(task, args=(key,), kwargs=kwargs, queue=queue, producer=producer)


def pending(broker: redis.Redis, queue: str) -> int:
    pipe = broker.pipeline(transaction=False)
    pipe.llen(queue)
    pipe.hlen("unacked")
    n_queue, n_unacked = pipe.execute()
    return int(n_queue) + int(n_unacked)


def set_consuming(control: Celery, worker: BenchWorker, on: bool) -> None:
    method = control.control.add_consumer if on else control.control.cancel_consumer
    replies = method(worker.queue, destination=[worker.hostname], reply=True, timeout=5)
    if not replies:
        raise RuntimeError(f"worker did not answer {'add' if on else 'cancel'}_consumer")


def timed_run(
    svc: Services,
    control: Celery,
    broker: redis.Redis,
    worker: BenchWorker,
    task: str,
    n: int,
    *,
    sleep: float = 0.0,
    timeout: float = 600.0,
    on_start: Callable[[], None] | None = None,
    run: str | None = None,
) -> float:
    """Publish ``n`` messages with distinct keys (``<run>:<i>``) to ``worker``'s queue, then time
    their consumption; return seconds. ``on_start`` runs right before consumption starts."""
    run = run or uuid.uuid4().hex[:10]
    queue = worker.queue
    publish(control, task, [f"{run}:{i}" for i in range(n)], queue, sleep)
    wait_for(lambda: pending(broker, queue) >= n, 30, "published messages to be visible")
    if on_start is not None:
        on_start()
    started = time.perf_counter()
    set_consuming(control, worker, True)
    end = time.monotonic() + timeout
    while True:
        if not pending(broker, queue):
            elapsed = time.perf_counter() - started
            # kombu moves a message from the list to ``unacked`` in two steps: confirm the zero.
            time.sleep(0.02)
            if not pending(broker, queue):
                break
        if time.monotonic() > end:
            raise TimeoutError(f"{task}: {pending(broker, queue)} of {n} tasks not done")
        time.sleep(0.005)
    set_consuming(control, worker, False)
    return elapsed
