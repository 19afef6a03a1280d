"""The chaos workload's limited tasks (the ``group`` and ``rate`` scenarios), on the workload's
own app (:mod:`celery_fence.chaos.workload` imports this module).

- :data:`GROUPED_TASK`: ``fence_group=GROUP`` and ``fence_group_limit=CHAOS_GROUP_LIMIT``; with
  ``CHAOS_GROUP_LIMIT=0`` (the ``--no-group-limit`` control arm) the same group with no limit:
  only Celery's per-worker concurrency bounds it.
- :data:`RATED_TASK`: ``fence_rate_limit=CHAOS_RATE``; with ``CHAOS_CELERY_RATE=1`` (the
  ``--celery-rate-limit`` control arm) Celery's own ``rate_limit=CHAOS_RATE`` instead, which
  each worker applies on its own.

Each body records ``start`` and ``end`` in the ledger (as the workload's ``op`` does, with its
generation and attempt) and, for the harness's sampler, sets its attempt in the ledger's
``running`` hash (attempt id -> pid) while it runs. The control arms are settings, not source
mutations: the fence's own code runs unchanged in every arm.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery_fence.chaos.workload import _BASE, LEDGER, app, ledger, record

#: The task names (the harness sends them by name).
GROUPED_TASK = "celery_fence.chaos.grouped"
RATED_TASK = "celery_fence.chaos.rated"
#: The concurrency group of :data:`GROUPED_TASK`.
GROUP = "chaos-group"

_GROUP_LIMIT = int(os.environ.get("CHAOS_GROUP_LIMIT") or "3")
_RATE = os.environ.get("CHAOS_RATE") or "2/s"
_CELERY_RATE = os.environ.get("CHAOS_CELERY_RATE") == "1"


def running_key(ledger_prefix: str) -> str:
    """The ledger's hash of the limited bodies running now: attempt id -> pid."""
    return f"{ledger_prefix}:running"


def _body(fence: Any, key: str, sleep: float) -> dict[str, Any]:
    gen, attempt = fence.generation, fence.attempt_id
    ledger.hset(running_key(LEDGER), attempt, os.getpid())
    record("start", key, gen, attempt)
    try:
        end = time.monotonic() + sleep
        while time.monotonic() < end:
            time.sleep(0.02)
    finally:
        record("end", key, gen, attempt)
        ledger.hdel(running_key(LEDGER), attempt)
    return {"key": key, "generation": gen, "attempt_id": attempt}


_group_options: dict[str, Any] = {"fence_group": GROUP}
if _GROUP_LIMIT > 0:
    _group_options["fence_group_limit"] = _GROUP_LIMIT


@app.task(
    base=_BASE, bind=True, name=GROUPED_TASK, fence_key=lambda key, **kw: key, **_group_options
)
def grouped(self: Any, key: str, *, sleep: float = 0.5) -> dict[str, Any]:
    """One attempt of the group: runs ``sleep`` seconds."""
    return _body(self.fence, key, sleep)


_rate_options: dict[str, Any] = (
    {"rate_limit": _RATE} if _CELERY_RATE else {"fence_rate_limit": _RATE}
)


@app.task(base=_BASE, bind=True, name=RATED_TASK, fence_key=lambda key, **kw: key, **_rate_options)
def rated(self: Any, key: str, *, sleep: float = 0.05) -> dict[str, Any]:
    """One rate-limited attempt: runs ``sleep`` seconds."""
    return _body(self.fence, key, sleep)


__all__ = ["GROUP", "GROUPED_TASK", "RATED_TASK", "grouped", "rated", "running_key"]
