"""One-shot fault flags: the one vocabulary the test workloads (``tests.support.app``, the outbox
app) and the chaos workload (:mod:`celery_fence.chaos.workload`) share.

A flag is a Redis key ``<prefix>:<kind>[:<window>]:<key>`` (``kill:before_commit:<key>``,
``hang:<key>``, ``overrun:<key>``, ``fail:<key>``, ...). The test process :func:`arm`\\ s it; the
worker :func:`take`\\ s it with GETDEL right before the fault (a SIGKILL, a hang, a raised error),
so a fault happens once even though the process dies; :func:`armed` tells the test whether the
fault fired. (The pytest plugin's fault points, :mod:`celery_fence.testing.worker_app`, are keyed
on the Celery task id instead: they are a user's API, not a workload's.)
"""

from __future__ import annotations

import redis


def flag(prefix: str, kind: str, *where: str) -> str:
    """The flag's Redis key: ``<prefix>:<kind>:<where>...``."""
    return ":".join((prefix, kind, *where))


def arm(client: redis.Redis, prefix: str, kind: str, *where: str) -> None:
    """Set the flag: the next worker that reaches the fault takes it."""
    client.set(flag(prefix, kind, *where), 1)


def take(client: redis.Redis, prefix: str, kind: str, *where: str) -> bool:
    """Consume the flag (GETDEL): True once per :func:`arm`."""
    return client.getdel(flag(prefix, kind, *where)) is not None


def armed(client: redis.Redis, prefix: str, kind: str, *where: str) -> bool:
    """True while the flag is set (nobody has taken it yet)."""
    return bool(client.exists(flag(prefix, kind, *where)))
