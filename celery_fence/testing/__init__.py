"""Test support that behaves like the real thing.

- :mod:`celery_fence.testing.plugin` — the pytest plugin (fixtures ``fence_store``,
  ``fence_redis``, ``fence_env``, ``fenced_worker``, ``fence_chaos``, ``fence_unique_holder``,
  ``fence_group_full``, ``fence_rate_limited``), loaded by its entry point.
- :mod:`celery_fence.testing.unique` — the holder of a unique job killed mid-run, for a user's
  test of what the next send does.
- :mod:`celery_fence.testing.processes` — the one worker harness the plugin, the chaos suite
  (:mod:`celery_fence.chaos`) and the project's own tests share: Celery workers
  (:class:`~celery_fence.testing.workers.Worker`) and ``redis-server`` processes, stopped by
  process group, bounded waits and free ports.
- :mod:`celery_fence.testing.faults` — one-shot fault flags a test arms and a worker takes once.
- :mod:`celery_fence.testing.proxy` — a TCP proxy in front of a database, for outages.
- :mod:`celery_fence.testing.broker` — a test's queues deleted from the broker, with kombu's
  binding keys.
- :class:`ProviderStub` — an idempotent HTTP provider for outbox handlers.
"""

from __future__ import annotations

from celery_fence.testing.provider import ProviderStub

__all__ = ["ProviderStub"]
