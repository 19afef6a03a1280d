"""Test support that behaves like the real thing.

- :mod:`celery_fence.testing.plugin` — the pytest plugin (fixtures ``fence_store``,
  ``fence_redis``, ``fence_env``, ``fenced_worker``, ``fence_chaos``), loaded by its entry point.
- :mod:`celery_fence.testing.processes` — workers and ``redis-server`` processes, stopped by
  process group.
- :mod:`celery_fence.testing.broker` — a test's queues deleted from the broker, with kombu's
  binding keys.
- :class:`ProviderStub` — an idempotent HTTP provider for outbox handlers.
"""

from __future__ import annotations

from .provider import ProviderStub

__all__ = ["ProviderStub"]
