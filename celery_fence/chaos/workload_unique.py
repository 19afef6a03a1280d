"""The workload's tasks of the ``unique`` and ``beat`` scenarios, on :mod:`.workload`'s app.

- :data:`UNIQUE_TASK` ``(ukey, sleep=0.0)``: a unique job (``fence_unique``: the uniqueness key
  is ``ukey``; its fence key is the task id of the message that created it). Ledger ``start``
  and ``effect`` (inside ``guard()``) under its fence key, with ``ukey``; taking the one-shot
  flag ``overrun:<ukey>`` it records ``overrun`` and sleeps until something kills it (the
  harness's SIGKILL of the worker, or a hard time limit). Under ``CHAOS_TTL_LOCK=1`` (the
  ``--ttl-lock`` control arm) it is not unique: a celery-once-style Redis lock
  (:class:`~celery_fence.chaos.arms.TTLLockTask`, ``CHAOS_LOCK_TIMEOUT`` seconds) guards its
  sends instead, and a send that finds the lock taken is discarded (``apply_async`` returns
  None, celery-once's ``graceful``).
- :data:`TICK_TASK` ``(entry)``: a beat entry's tick (a fenced task: its key is the tick key
  ``celery_fence.beat:Scheduler`` enqueues the tick's job under, the message's task id under
  Celery's stock scheduler). Ledger ``start`` and ``effect`` under its fence key, with
  ``entry``. With ``CHAOS_BEAT_ENTRY`` set, the app's ``beat_schedule`` is that one entry, every
  :data:`TICK_EVERY` seconds (``fence_beat_missed=catch_up``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_fence.chaos import TICK_TASK, UNIQUE_TASK
from celery_fence.chaos.arms import TTLLockTask
from celery_fence.chaos.workload import _BASE, LEDGER, OVERRUN_S, app, ledger, record
from celery_fence.testing import faults

#: Seconds between two ticks of the beat scenario's entry.
TICK_EVERY = 1.0
#: The control arm's lock timeout (celery-once's default is an hour).
DEFAULT_LOCK_TIMEOUT = 60

TTL_LOCK = os.environ.get("CHAOS_TTL_LOCK") == "1"
BEAT_ENTRY = os.environ.get("CHAOS_BEAT_ENTRY", "")

if BEAT_ENTRY:
    app.conf.update(
        beat_schedule={
            BEAT_ENTRY: {"task": TICK_TASK, "schedule": TICK_EVERY, "kwargs": {"entry": BEAT_ENTRY}}
        },
        beat_max_loop_interval=0.5,
        fence_beat_missed="catch_up",
    )


def _unique_key(ukey: str, **kwargs: Any) -> str:
    return ukey


class _Lock(TTLLockTask, _BASE, fence_base=True):  # type: ignore[misc, valid-type]
    lock_redis = ledger
    lock_prefix = f"{LEDGER}:qo"
    lock_timeout = int(os.environ.get("CHAOS_LOCK_TIMEOUT") or DEFAULT_LOCK_TIMEOUT)


_unique_options: dict[str, Any] = (
    {"base": _Lock} if TTL_LOCK else {"base": _BASE, "fence_unique": _unique_key}
)


@app.task(bind=True, name=UNIQUE_TASK, **_unique_options)
def unique_op(self: Any, ukey: str, *, sleep: float = 0.0) -> dict[str, Any]:
    fence = self.fence
    key, gen, attempt = fence.key, fence.generation, fence.attempt_id
    record("start", key, gen, attempt, ukey=ukey)
    if faults.take(ledger, LEDGER, "overrun", ukey):
        record("overrun", key, gen, attempt, ukey=ukey)
        sleep = OVERRUN_S  # the harness's SIGKILL, or the hard time limit, ends it first
    end = time.monotonic() + sleep
    while time.monotonic() < end:
        time.sleep(0.02)
    t0 = time.time()
    with fence.guard():
        record("effect", key, gen, attempt, t0=t0, ukey=ukey)
    return {"key": key, "generation": gen, "attempt_id": attempt}


@app.task(base=_BASE, bind=True, name=TICK_TASK)
def tick(self: Any, entry: str = "") -> dict[str, Any]:
    fence = self.fence
    key, gen, attempt = fence.key, fence.generation, fence.attempt_id
    record("start", key, gen, attempt, entry=entry)
    t0 = time.time()
    with fence.guard():
        record("effect", key, gen, attempt, t0=t0, entry=entry)
    return {"key": key, "generation": gen, "attempt_id": attempt}
