"""Every process a test or harness starts, and how it is stopped: Celery workers and Redis servers.

One import for the pytest plugin, the project's acceptance tests, the chaos harness, the bench and
the demo; the code lives in one module per concept: :mod:`~celery_fence.testing.groups` (the
registry of process groups, :func:`cleanup`), :mod:`~celery_fence.testing.waiting` (bounded
waits), :mod:`~celery_fence.testing.workers` (:class:`Worker`) and
:mod:`~celery_fence.testing.redis_server` (:class:`RedisServer`). Each child runs in its own
session, so its process group is its pid and :meth:`Worker.stop` leaves nothing behind. Nothing is
ever killed by name.
"""

from __future__ import annotations

from celery_fence.testing.groups import (
    cleanup,
    group_alive,
    install_handlers,
    kill_group,
    register,
    register_closer,
)
from celery_fence.testing.redis_server import (
    RedisServer,
    redis_answers,
    redis_server_binary,
    redis_url_or_server,
)
from celery_fence.testing.waiting import WaitTimeout, free_port, poll_until, wait_until
from celery_fence.testing.workers import Worker, running

__all__ = [
    "RedisServer",
    "WaitTimeout",
    "Worker",
    "cleanup",
    "free_port",
    "group_alive",
    "install_handlers",
    "kill_group",
    "poll_until",
    "redis_answers",
    "redis_server_binary",
    "redis_url_or_server",
    "register",
    "register_closer",
    "running",
    "wait_until",
]
