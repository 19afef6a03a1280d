"""One-shot fault flags: the one vocabulary of every fault a harness injects into a worker — the
project's test workloads (``tests.support.app``, the outbox app), the chaos workload
(:mod:`celery_fence.chaos.workload`) and the pytest plugin's fault points
(:mod:`celery_fence.testing.worker_app`).

A flag is a Redis key ``<prefix>:<kind>[:<where>...]`` (``kill:before_commit:<key>``,
``hang:<key>``, ``overrun:<key>``, ``fail:<key>``; the plugin's ``fault:<point>:<task id>``).
The test process :func:`arm`\\ s it; the worker :func:`take`\\ s it (GET and DEL in one
transaction) right before the fault (a SIGKILL, a hang, a raised error), so a fault happens once
even though the process dies; :func:`armed` tells the test whether the fault fired, or a worker
whether a gate is open (:func:`disarm` closes it). A flag may carry a value (the plugin's
``hold`` or ``kill``), which :func:`take_value` returns.
"""

from __future__ import annotations

import redis

#: The kind of the pytest plugin's fault points: ``<prefix>:testing:fault:<point>:<task id>``,
#: valued ``hold`` or ``kill`` (:mod:`celery_fence.testing.worker_app`).
FAULT_POINT = "fault"


def flag(prefix: str, kind: str, *where: str) -> str:
    """The flag's Redis key: ``<prefix>:<kind>:<where>...``."""
    return ":".join((prefix, kind, *where))


def arm(
    client: redis.Redis,
    prefix: str,
    kind: str,
    *where: str,
    value: str = "1",
    ttl: float | None = None,
) -> None:
    """Set the flag (to ``value``; gone after ``ttl`` seconds when given): the next worker that
    reaches the fault takes it."""
    client.set(flag(prefix, kind, *where), value, px=None if ttl is None else int(ttl * 1000))


def take_value(client: redis.Redis, prefix: str, kind: str, *where: str) -> str | None:
    """Consume the flag: its value once per :func:`arm`, else None (GET and DEL in one
    transaction, so two workers never both take it)."""
    pipe = client.pipeline(transaction=True)
    pipe.get(flag(prefix, kind, *where))
    pipe.delete(flag(prefix, kind, *where))
    value, _ = pipe.execute()
    return None if value is None else value.decode()


def take(client: redis.Redis, prefix: str, kind: str, *where: str) -> bool:
    """Consume the flag: True once per :func:`arm`."""
    return take_value(client, prefix, kind, *where) is not None


def disarm(client: redis.Redis, prefix: str, kind: str, *where: str) -> None:
    """Clear the flag (a gate a test closes again)."""
    client.delete(flag(prefix, kind, *where))


def armed(client: redis.Redis, prefix: str, kind: str, *where: str) -> bool:
    """True while the flag is set (nobody has taken it yet)."""
    return bool(client.exists(flag(prefix, kind, *where)))
