"""The Celery app the benchmark's workers run (configured from ``BENCH_*`` environment variables).

Every variant is a task of this one app, so every variant runs under the same worker command:

- ``bench.plain``: plain Celery, ``acks_late``;
- ``bench.fenced_pg`` / ``bench.fenced_sqlite``: :class:`~celery_fence.FencedTask` with distinct
  keys, results fenced in PostgreSQL / SQLite;
- ``bench.rlock``: python-redis-lock's ``Lock`` with auto-renewal around the body (no fencing),
  what a user might pick instead.

Each takes ``(key, sleep=0.0)`` and sleeps ``sleep`` seconds (0: a no-op). No result backend:
plain tasks ignore results; fenced tasks keep theirs in the fence store.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

if os.environ.get("BENCH_FENCE_PATH"):  # --experiment-rev: celery_fence from another revision
    sys.path.insert(0, os.environ["BENCH_FENCE_PATH"])

import redis
import redis_lock
from celery import Celery, signals

from celery_fence import FencedTask

E = os.environ
LEASE_REDIS = E.get("BENCH_LEASE_REDIS", "redis://127.0.0.1:6379/0")
TTL = float(E.get("BENCH_TTL", "30"))
SQLITE_URL = E.get("BENCH_SQLITE_URL", "sqlite:///bench.sqlite3")

app = Celery("fence_bench", broker=E.get("BENCH_BROKER", "redis://127.0.0.1:6379/9"))
app.conf.update(
    task_default_queue=E.get("BENCH_QUEUE", "bench"),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=True,
    fence_redis_url=LEASE_REDIS,
    fence_database_url=E.get("BENCH_PG_URL", SQLITE_URL),
    fence_key_prefix=E.get("BENCH_PREFIX", "bench"),
    fence_lease_ttl=TTL,
    fence_renew_interval=float(E.get("BENCH_RENEW", str(TTL / 3))),
)


def _key(key: str, sleep: float = 0.0) -> str:
    return key


def _body(sleep: float) -> None:
    if sleep:
        time.sleep(sleep)


@app.task(name="bench.plain", acks_late=True)
def plain(key: str, sleep: float = 0.0) -> None:
    _body(sleep)


@app.task(name="bench.fenced_pg", base=FencedTask, bind=True, fence_key=_key)
def fenced_pg(self: Any, key: str, sleep: float = 0.0) -> None:
    _body(sleep)


@app.task(
    name="bench.fenced_sqlite",
    base=FencedTask,
    bind=True,
    fence_key=_key,
    fence_database_url=SQLITE_URL,
)
def fenced_sqlite(self: Any, key: str, sleep: float = 0.0) -> None:
    _body(sleep)


_rlock_client: redis.Redis | None = None


@app.task(name="bench.rlock", acks_late=True)
def rlock(key: str, sleep: float = 0.0) -> None:
    global _rlock_client
    if _rlock_client is None:
        _rlock_client = redis.Redis.from_url(LEASE_REDIS)
    with redis_lock.Lock(
        _rlock_client, f"rlock:{key}", expire=max(1, round(TTL)), auto_renewal=True
    ):
        _body(sleep)


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
