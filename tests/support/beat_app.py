"""The app beat replicas and their worker run in the beat tests (configured from FENCE_T_*).

One entry (``FENCE_T_BEAT_ENTRY``, ``tick`` by default), every ``FENCE_T_BEAT_EVERY`` seconds (1
by default), of a fenced task whose body appends ``<unix time> <fence key>`` to the Redis
list ``<prefix>:beat-runs``: one entry per body run. ``FENCE_T_RECOVER_PENDING_AFTER``: how long
a tick's ``pending`` job waits for its message before the workers' recovery re-sends it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_fence import FencedTask

E = os.environ
PREFIX = E.get("FENCE_T_PREFIX", "t")
app = Celery("fence_beat_tests", broker=E.get("FENCE_T_BROKER"))
app.conf.update(
    task_default_queue=E.get("FENCE_T_QUEUE", "celery"),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=0.5,
    beat_schedule={
        E.get("FENCE_T_BEAT_ENTRY", "tick"): {
            "task": "beat_tests.tick",
            "schedule": float(E.get("FENCE_T_BEAT_EVERY", "1")),
        }
    },
    fence_redis_url=E.get("FENCE_T_REDIS"),
    fence_database_url=E.get("FENCE_T_DB"),
    fence_key_prefix=PREFIX,
    fence_lease_ttl=2.0,
    fence_renew_interval=0.5,
    fence_retry_backoff=0.2,
    fence_retry_backoff_max=1.0,
    fence_beat_missed=E.get("FENCE_T_BEAT_MISSED", "skip"),
    # a tick whose message the broker lost is re-sent by the workers' recovery after this long
    fence_recover_pending_after=float(E.get("FENCE_T_RECOVER_PENDING_AFTER", "60")),
)
ledger = redis.Redis.from_url(E.get("FENCE_T_LEDGER", E.get("FENCE_T_REDIS", "")))


@app.task(shared=False, base=FencedTask, bind=True, name="beat_tests.tick")
def tick(self: Any) -> None:
    ledger.rpush(f"{PREFIX}:beat-runs", f"{time.time():.3f} {self.fence.key}")
