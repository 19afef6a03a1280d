"""Unique-job faults for your own tests: the holder of a uniqueness key dies mid-run (the
``fence_unique_holder`` fixture of :mod:`celery_fence.testing.plugin`).

:meth:`UniqueHolder.kill` sends your unique task (``fence_unique``) as your code would, to a
worker of the test that holds the body at its start, and SIGKILLs that whole worker there: the
job's row stays ``running`` with its uniqueness key, its message dies unacked with the worker,
its lease expires — what a worker killed by the OOM killer or a deploy leaves behind. Your test
then asserts what celery-once and celery-singleton users lose: a later send of the key returns
that job (nothing is discarded), and it runs again — a plugin worker's own recovery check
re-sends it about ``fence_recover_after`` (3 lease TTLs) after the death — and completes once;
once it ended, the key is free again::

    def test_a_dead_holder_does_not_block_the_key(fence_unique_holder, fenced_worker):
        held = fence_unique_holder.kill(refresh_feed.s(7))
        again = refresh_feed.delay(7)
        assert again.id == held.task_id  # the same job, not discarded
        fenced_worker.start()
        assert again.get(timeout=30) == ...  # it ran again and completed

Call it before your own workers start (it starts, and kills, a worker of its own; the message
goes to the test's queue, where recovery sends it again).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from celery.canvas import Signature

from celery_fence.errors import ConfigurationError, FenceError
from celery_fence.testing import faults, processes
from celery_fence.testing.environment import FenceEnv


@dataclass(frozen=True)
class DeadHolder:
    """The job :meth:`UniqueHolder.kill` left behind: its ``task_id``, fence ``key`` and
    ``unique_key``, and the ``pid`` of the pool process that ran its body (now dead)."""

    task_id: str
    key: str
    unique_key: str
    pid: int


class UniqueHolder:
    """The ``fence_unique_holder`` fixture: ``kill(signature)``."""

    def __init__(self, env: FenceEnv, *, timeout: float = 60.0) -> None:
        self.env = env
        self.timeout = timeout

    def kill(self, signature: Signature) -> DeadHolder:
        """Send ``signature`` (a task with ``fence_unique``) through the task's own
        ``apply_async``, hold its body at its start on a worker of its own, and SIGKILL that
        worker there. Raises :class:`FenceError` when the key is already held by another job."""
        if not isinstance(signature, Signature):
            raise TypeError(f"give a signature, e.g. my_task.s(42), not {signature!r}")
        task = self.env.app.tasks.get(str(signature.task))
        args, kwargs = tuple(signature.args), dict(signature.kwargs)
        if task is None or not hasattr(task, "unique_policy"):
            raise ConfigurationError(
                f"fence_unique_holder: {signature.task!r} is not a fenced task of your app"
            )
        policy = task.unique_policy(args, kwargs)
        if policy is None:
            raise ConfigurationError(
                f"fence_unique_holder: {task.name} is not unique; declare it with "
                "fence_unique=True (or a key, or a callable of its arguments)"
            )
        client, base = self.env.redis.client, self.env.ledger_base
        worker = self.env.worker("unique-holder")
        worker.start()
        tid = uuid.uuid4().hex
        faults.arm(client, base, faults.FAULT_POINT, "start", tid, value="hold", ttl=600)
        result = task.apply_async(args, kwargs, task_id=tid)
        if result is None or result.id != tid:
            faults.disarm(client, base, faults.FAULT_POINT, "start", tid)
            worker.stop()
            held_by = getattr(result, "id", None)
            raise FenceError(
                f"fence_unique_holder: unique key {policy.key!r} is already held by job "
                f"{held_by!r}; kill() needs a key nobody holds"
            )
        started = self._started(tid)
        worker.kill()  # the whole worker: main process and pool, as the OOM killer does
        processes.poll_until(lambda: not processes.group_alive(worker.pid), 10, interval=0.05)
        return DeadHolder(
            task_id=tid, key=str(started["key"]), unique_key=policy.key, pid=int(started["pid"])
        )

    def _started(self, tid: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def held() -> bool:
            raw = self.env.redis.client.lrange(f"{self.env.ledger_base}:events", 0, -1)
            found[:] = [
                e
                for e in map(json.loads, raw)
                if e["ev"] == "start" and e.get("tid") == tid and e.get("held")
            ]
            return bool(found)

        if not processes.poll_until(held, self.timeout, interval=0.05):
            raise FenceError(
                f"fence_unique_holder: the body of {tid} did not start within {self.timeout:g}s"
            )
        return found[0]


__all__ = ["DeadHolder", "UniqueHolder"]
