"""The Celery app the benchmark's workers run (configured from ``BENCH_*`` environment variables).

Every variant is a task of this one app, so every variant runs under the same worker command:

- ``bench.plain``: plain Celery, ``acks_late``;
- ``bench.fenced_pg`` / ``bench.fenced_sqlite``: :class:`~celery_fence.FencedTask` with distinct
  keys, results fenced in PostgreSQL / SQLite;
- ``bench.fenced_pg_group`` / ``bench.fenced_pg_ratelimit``: ``bench.fenced_pg`` in a
  concurrency group of 1000 slots / under a rate limit of a million a second (never reached:
  the cost of the slot's or the token's round trip);
- ``bench.rlock``: python-redis-lock's ``Lock`` with auto-renewal around the body (no fencing),
  what a user might pick instead;
- ``bench.plain_dbresult``: plain Celery whose result goes to Celery's own database result backend
  (``db+postgresql+psycopg2://``) on the same PostgreSQL as the fence store;
- ``bench.once``: a celery_once ``QueueOnce`` task, locks in the lease Redis (:mod:`bench.once`);
- ``bench.fenced_pg_redisresult``: ``bench.fenced_pg`` with a Redis result backend as well (the
  result is written to the fence store and to Redis);
- ``bench.plain_redisresult`` / ``bench.rlock_redisresult``: ``bench.plain`` / ``bench.rlock``
  with a Redis result backend (``--latency``: every variant stores its result once).

Each takes ``(key, sleep=0.0)`` and sleeps ``sleep`` seconds (0: a no-op). The app has no result
backend and ignores results (``task_ignore_result``); fenced tasks keep theirs in the fence store.
The two tasks that store a result take ``ignore_result=False`` and their own ``backend`` (Celery's
``Task.backend`` option), built from a URL exactly as ``result_backend`` would be: the same
worker runs every variant, and no other task's path changes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from typing import Any

if os.environ.get("BENCH_FENCE_PATH"):  # --experiment-rev: celery_fence from another revision
    sys.path.insert(0, os.environ["BENCH_FENCE_PATH"])

import redis
import redis_lock
from celery import Celery, signals
from celery.app.backends import by_url

import celery_fence
from bench import once
from celery_fence import FencedTask

if os.environ.get("BENCH_FENCE_PATH") and not os.path.realpath(celery_fence.__file__).startswith(
    os.path.realpath(os.environ["BENCH_FENCE_PATH"]) + os.sep
):  # a before/after against the working tree itself would be a silent no-op
    raise RuntimeError(
        f"BENCH_FENCE_PATH={os.environ['BENCH_FENCE_PATH']} but celery_fence was imported from "
        f"{celery_fence.__file__}"
    )

E = os.environ
LEASE_REDIS = E.get("BENCH_LEASE_REDIS", "redis://127.0.0.1:6379/0")
TTL = float(E.get("BENCH_TTL", "30"))
SQLITE_URL = E.get("BENCH_SQLITE_URL", "sqlite:///bench.sqlite3")
PG_URL = E.get("BENCH_PG_URL", SQLITE_URL)

app = Celery("fence_bench", broker=E.get("BENCH_BROKER", "redis://127.0.0.1:6379/9"))
app.conf.update(
    task_default_queue=E.get("BENCH_QUEUE", "bench"),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    fence_redis_url=LEASE_REDIS,
    fence_database_url=PG_URL,
    fence_key_prefix=E.get("BENCH_PREFIX", "bench"),
    fence_lease_ttl=TTL,
    fence_renew_interval=float(E.get("BENCH_RENEW", str(TTL / 3))),
    # --memory with a short counter lifetime shows the key count level off within one run
    fence_generation_ttl=float(E.get("BENCH_GENERATION_TTL", "600")),
    # --latency runs its worker with -E (the caller times Celery's task-succeeded events); the
    # fence's own events stay off there, as on a worker without -E
    fence_send_events=E.get("BENCH_FENCE_EVENTS", "1") == "1",
    # The workers' periodic recovery check is a cost per interval, not per task (a SET NX per
    # worker about every half TTL, one stranded scan per interval across the cluster); every
    # variant's workers stay up for the whole run, so it would land in whichever variant is being
    # timed, plain Celery's included. The bench's workers run without it (bench/takeover.py
    # measures it); BENCH_RECOVER_INTERVAL=default keeps the default.
    **(
        {}
        if E.get("BENCH_RECOVER_INTERVAL") == "default"
        else {"fence_recover_interval": float(E.get("BENCH_RECOVER_INTERVAL", "0"))}
    ),
)


def result_backend(url: str) -> Any:
    """A result backend instance for ``url``, built as Celery builds ``result_backend``."""
    cls, url = by_url(url, app.loader)
    return cls(app=app, url=url)


def _key(key: str, sleep: float = 0.0) -> str:
    return key


#: Task names made to raise (``BENCH_FAIL_TASKS=bench.fenced_pg,...``): only the smoke test sets
#: it, to see the bench refuse to report a variant whose tasks did not succeed.
FAIL_TASKS = frozenset(filter(None, E.get("BENCH_FAIL_TASKS", "").split(",")))


def _body(sleep: float, name: str = "") -> None:
    if name in FAIL_TASKS:
        raise RuntimeError(f"{name}: made to fail by BENCH_FAIL_TASKS")
    if sleep:
        time.sleep(sleep)


@app.task(name="bench.plain", acks_late=True)
def plain(key: str, sleep: float = 0.0) -> None:
    _body(sleep, "bench.plain")


@app.task(name="bench.fenced_pg", base=FencedTask, bind=True, fence_key=_key)
def fenced_pg(self: Any, key: str, sleep: float = 0.0) -> None:
    _body(sleep, "bench.fenced_pg")


# The variants of settings a previous revision may not have: on the new worker, and on an @old
# worker (BENCH_FENCE_PATH) whose revision has the limits (else it would refuse a task whose
# settings it does not know and not start), so --rev compares them too.
def _has_limits() -> bool:
    try:
        return importlib.util.find_spec("celery_fence.leases.limits") is not None
    except ModuleNotFoundError:  # a revision without the leases package
        return False


if not E.get("BENCH_FENCE_PATH") or _has_limits():

    @app.task(
        name="bench.fenced_pg_group",
        base=FencedTask,
        bind=True,
        fence_key=_key,
        fence_group="bench",
        fence_group_limit=1000,  # never full: the cost of taking and giving back a slot
    )
    def fenced_pg_group(self: Any, key: str, sleep: float = 0.0) -> None:
        _body(sleep, "bench.fenced_pg_group")

    @app.task(
        name="bench.fenced_pg_ratelimit",
        base=FencedTask,
        bind=True,
        fence_key=_key,
        fence_rate_limit="1000000/s",  # never empty: the cost of taking a token
    )
    def fenced_pg_ratelimit(self: Any, key: str, sleep: float = 0.0) -> None:
        _body(sleep, "bench.fenced_pg_ratelimit")


@app.task(
    name="bench.fenced_sqlite",
    base=FencedTask,
    bind=True,
    fence_key=_key,
    fence_database_url=SQLITE_URL,
)
def fenced_sqlite(self: Any, key: str, sleep: float = 0.0) -> None:
    _body(sleep, "bench.fenced_sqlite")


_rlock_client: redis.Redis | None = None


@app.task(name="bench.rlock", acks_late=True)
def rlock(key: str, sleep: float = 0.0) -> None:
    global _rlock_client
    if _rlock_client is None:
        _rlock_client = redis.Redis.from_url(LEASE_REDIS)
    with redis_lock.Lock(
        _rlock_client, f"rlock:{key}", expire=max(1, round(TTL)), auto_renewal=True
    ):
        _body(sleep, "bench.rlock")


# Celery's database result backend on the fence store's PostgreSQL. Built at import, in the
# worker's main process before it forks the pool, as an app-wide ``result_backend`` is (the worker
# banner asks it for its URL): each child then keeps one pooled engine, not a connection a task.
# The bench creates its tables before the workers start (database_create_tables_at_setup off).
app.conf.database_create_tables_at_setup = False
DB_RESULT = result_backend(f"db+{PG_URL}")
# A Redis result backend on the lease Redis (db 1), so the servers' counts show its writes.
REDIS_RESULT = result_backend(LEASE_REDIS.rsplit("/", 1)[0] + "/1")


@app.task(name="bench.plain_dbresult", acks_late=True, ignore_result=False, backend=DB_RESULT)
def plain_dbresult(key: str, sleep: float = 0.0) -> None:
    _body(sleep, "bench.plain_dbresult")


@app.task(name="bench.plain_redisresult", acks_late=True, ignore_result=False, backend=REDIS_RESULT)
def plain_redisresult(key: str, sleep: float = 0.0) -> None:
    _body(sleep, "bench.plain_redisresult")


@app.task(name="bench.rlock_redisresult", acks_late=True, ignore_result=False, backend=REDIS_RESULT)
def rlock_redisresult(key: str, sleep: float = 0.0) -> None:
    rlock.run(key, sleep)


@app.task(
    name="bench.fenced_pg_redisresult",
    base=FencedTask,
    bind=True,
    fence_key=_key,
    ignore_result=False,
    backend=REDIS_RESULT,
)
def fenced_pg_redisresult(self: Any, key: str, sleep: float = 0.0) -> None:
    _body(sleep, "bench.fenced_pg_redisresult")


once.register(app, LEASE_REDIS)

# Successes, counted where no store row says so (``BENCH_SUCCESS_DIR``): one byte appended to
# ``<dir>/<run>`` a task that returned (the run id is its key's first part), written by the pool
# process (O_APPEND: concurrent one-byte writes do not overwrite each other). The bench compares
# the file's size with the tasks it sent (bench.throughput.check_succeeded).
SUCCESS_DIR = E.get("BENCH_SUCCESS_DIR")
if SUCCESS_DIR:
    _success_fds: dict[str, int] = {}

    @signals.task_success.connect(weak=False)
    def _count_success(sender: Any = None, **_: Any) -> None:
        args = getattr(getattr(sender, "request", None), "args", None) or ()
        if not args or not isinstance(args[0], str) or ":" not in args[0]:
            return
        run = args[0].split(":", 1)[0]
        fd = _success_fds.get(run)
        if fd is None:
            if len(_success_fds) > 64:  # runs are sequential: forget the old ones
                for old in _success_fds.values():
                    os.close(old)
                _success_fds.clear()
            path = os.path.join(E["BENCH_SUCCESS_DIR"], run)
            fd = _success_fds[run] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, b".")


if E.get("BENCH_METRICS") == "1":  # fenced-pg-metrics: Prometheus metrics on, nobody scraping
    app.conf.fence_metrics = True

if E.get("BENCH_EXPERIMENT") == "1":
    from bench import experiments

    experiments.apply()

if E.get("BENCH_TRACE") == "1":
    from bench import trace

    @signals.worker_process_init.connect(weak=False)
    def _install_trace(**_: Any) -> None:
        trace.install(int(LEASE_REDIS.rsplit(":", 1)[1].split("/")[0]), E["BENCH_TRACE_DIR"])

    @signals.task_prerun.connect(weak=False)
    def _mark(**_: Any) -> None:
        trace.mark_task_thread()

    if E.get("BENCH_POOL") == "threads":  # no child processes: install in the worker itself

        @signals.worker_init.connect(weak=False)
        def _install_trace_threads(**_: Any) -> None:
            trace.install(int(LEASE_REDIS.rsplit(":", 1)[1].split("/")[0]), E["BENCH_TRACE_DIR"])
