"""Limit faults for your own tests: every slot of a concurrency group taken, or a rate limit's
bucket drained, as if other workers were using them (the ``fence_group_full`` and
``fence_rate_limited`` fixtures of :mod:`celery_fence.testing.plugin`).

A message of your task then meets a real ``group_full`` / ``rate_limited``: it is re-sent (a
``retry_scheduled`` row with that reason, the ``job_retry_scheduled`` signal), and runs once the
fault ends. Only the test's Redis and key prefix are touched.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery_fence.leases.limits import bucket_key, parse_rate, slot_keys


class GroupFull:
    """Occupy every slot of a group (``fill``) until ``free()`` or ``hold`` seconds pass."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self._held: list[tuple[str, str]] = []

    def fill(self, group: str, limit: int, *, hold: float = 60.0) -> None:
        """Take all ``limit`` slots of ``group`` (as the task's ``fence_group_limit`` says) for
        ``hold`` seconds: its tasks are re-sent as ``group_full`` until then."""
        token = f"fault-{uuid.uuid4().hex[:8]}"
        for i, key in enumerate(slot_keys(self.prefix, group, limit), start=1):
            value = f"{token}:{i}"
            self.client.set(key, value, px=round(hold * 1000))
            self._held.append((key, value))

    def free(self) -> None:
        """Give back the slots :meth:`fill` took (those it still holds)."""
        held, self._held = self._held, []
        for key, value in held:
            if self.client.get(key) == value.encode():
                self.client.delete(key)


class RateLimited:
    """Drain a rate limit's bucket: no token for ``seconds`` seconds."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def drain(
        self, rate_limit: str, *, seconds: float, task: str | None = None, group: str | None = None
    ) -> None:
        """Empty the bucket of ``task`` (its name) or of ``group``, limited to ``rate_limit``
        (as the task's ``fence_rate_limit`` says), so its next token is due in ``seconds``."""
        if (task is None) == (group is None):
            raise ValueError("drain() takes one of task= (a task name) or group=")
        rate = parse_rate(rate_limit)
        seconds_now, micros = self.client.time()
        now_ms = int(seconds_now) * 1000 + int(micros) // 1000
        bucket = f"group:{group}" if group is not None else f"task:{task}"
        key = bucket_key(self.prefix, bucket)
        tokens = 1.0 - rate.per_second * seconds
        self.client.hset(key, mapping={"tokens": repr(tokens), "ts": now_ms, "promised": now_ms})
        self.client.pexpire(key, round((seconds + rate.capacity / rate.per_second) * 1000) + 1000)


__all__ = ["GroupFull", "RateLimited"]
