"""The Celery app of the outbox acceptance tests (configured from FENCE_T_* variables).

``publish(key)`` stages one ``notify`` effect; its handler POSTs it to the provider stub at
``FENCE_T_PROVIDER`` with the row's idempotency key. Ledger in Redis, as in ``app.py``:
``<prefix>:runs:<key>`` one entry per body start ("<generation>:<attempt id>"); a one-shot flag
``<prefix>:kill:after_send:<idempotency key>`` SIGKILLs the sender after the provider answered and
before the row is marked delivered.

:func:`race_sender` is the body of one process of the two-senders race (integration tests).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from typing import Any

import redis
from celery import Celery

from celery_fence import FencedTask
from celery_fence.ops.outbox import Outbox
from celery_fence.testing import faults

E = os.environ
PREFIX = E.get("FENCE_T_PREFIX", "t")
app = Celery("fence_outbox_tests", broker=E.get("FENCE_T_BROKER"), backend=E.get("FENCE_T_BROKER"))
app.conf.update(
    task_default_queue=E.get("FENCE_T_QUEUE", "celery"),
    worker_prefetch_multiplier=1,
    result_expires=600,
    broker_connection_retry_on_startup=True,
    fence_redis_url=E.get("FENCE_T_REDIS"),
    fence_database_url=E.get("FENCE_T_DB"),
    fence_key_prefix=PREFIX,
    fence_lease_ttl=float(E.get("FENCE_T_TTL", "2.0")),
    fence_renew_interval=float(E.get("FENCE_T_RENEW", "0.5")),
    fence_retry_backoff=float(E.get("FENCE_T_BACKOFF", "0.2")),
    fence_retry_backoff_max=float(E.get("FENCE_T_BACKOFF_MAX", "1.0")),
    # a failed delivery is retried at the pace of the tests, not the hours of the defaults
    fence_outbox_backoff=float(E.get("FENCE_T_BACKOFF", "0.2")),
    fence_outbox_backoff_max=float(E.get("FENCE_T_BACKOFF_MAX", "1.0")),
    fence_outbox_max_attempts=int(E.get("FENCE_T_OUTBOX_MAX_ATTEMPTS", "5")),
)
outbox = Outbox(app, claim_ttl=float(E.get("FENCE_T_CLAIM_TTL", "2.0")))
ledger = redis.Redis.from_url(E.get("FENCE_T_REDIS", "redis://127.0.0.1:6379/1"))


@app.task(shared=False, base=FencedTask, bind=True, fence_key=lambda key, **kw: key)
def publish(self: Any, key: str, *, sleep: float = 0.0) -> dict[str, Any]:
    fence = self.fence
    ledger.rpush(f"{PREFIX}:runs:{key}", f"{fence.generation}:{fence.attempt_id}")
    payload = {"key": key, "generation": fence.generation, "attempt_id": fence.attempt_id}
    idem = fence.effects.add("notify", payload)
    end = time.monotonic() + sleep
    while time.monotonic() < end:  # works without checking its lease: the store must defend
        time.sleep(0.02)
    return {"key": key, "generation": fence.generation, "idempotency_key": idem}


@outbox.handler("notify")
def notify(payload: Any, *, idempotency_key: str) -> None:
    request = urllib.request.Request(
        f"{E['FENCE_T_PROVIDER']}/notify",
        data=json.dumps(payload).encode(),
        headers={"Idempotency-Key": idempotency_key, "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()
    # The provider accepted it; crash before the row is marked delivered (once, when asked).
    if faults.take(ledger, PREFIX, "kill", "after_send", idempotency_key):
        os.kill(os.getpid(), signal.SIGKILL)


def race_sender(db_url: str, redis_url: str, ledger_key: str, barrier_key: str) -> None:
    """One racing sender process: wait for the start signal, then deliver every due row."""
    racer = Celery("fence_outbox_race", set_as_current=False)
    racer.conf.update(fence_database_url=db_url, fence_redis_url=redis_url)
    sender = Outbox(racer, claim_ttl=30.0, batch=10_000)
    r = redis.Redis.from_url(redis_url)
    me = str(os.getpid())

    @sender.handler("race")
    def deliver(payload: Any, *, idempotency_key: str) -> None:
        r.rpush(ledger_key, json.dumps([idempotency_key, me]))
        time.sleep(0.01)  # long enough that the two senders interleave

    end = time.monotonic() + 60
    while not r.exists(barrier_key) and time.monotonic() < end:
        time.sleep(0.005)
    sender.deliver()


def crashing_sender(db_url: str, redis_url: str, ledger_key: str, key: str) -> None:
    """One sender process whose handler kills it (SIGKILL) mid-delivery, as an OOM kill would:
    the row stays claimed, and the sender never reaches its failure path."""
    crasher = Celery("fence_outbox_crash", set_as_current=False)
    crasher.conf.update(fence_database_url=db_url, fence_redis_url=redis_url)
    sender = Outbox(crasher, claim_ttl=0.3, max_attempts=3)
    r = redis.Redis.from_url(redis_url)

    @sender.handler("crash")
    def deliver(payload: Any, *, idempotency_key: str) -> None:
        r.rpush(ledger_key, idempotency_key)
        os.kill(os.getpid(), signal.SIGKILL)

    sender.deliver(key=key)
