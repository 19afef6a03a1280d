"""Reading the ledger the test workloads write to Redis (see :mod:`tests.support.app`).

``<prefix>:runs:<key>`` has one entry per body start and ``<prefix>:effects:<key>`` one per side
effect performed, each ``"<generation>:<attempt id>"``.
"""

from __future__ import annotations

import redis


def entries(redis_client: redis.Redis, name: str) -> list[str]:
    """The Redis list ``name`` as text."""
    return [v.decode() if isinstance(v, bytes) else v for v in redis_client.lrange(name, 0, -1)]


def runs(redis_client: redis.Redis, prefix: str, key: str) -> list[str]:
    """Every body start of ``key``, in order: ``"<generation>:<attempt id>"``."""
    return entries(redis_client, f"{prefix}:runs:{key}")


def run_count(redis_client: redis.Redis, prefix: str, key: str) -> int:
    """How many times a body of ``key`` started."""
    return int(redis_client.llen(f"{prefix}:runs:{key}"))


def run_attempts(redis_client: redis.Redis, prefix: str, key: str) -> list[tuple[int, str]]:
    """Every body start of ``key``, in order, as ``(generation, attempt id)``."""
    entries = [entry.split(":") for entry in runs(redis_client, prefix, key)]
    return [(int(generation), attempt) for generation, attempt in entries]


def effects(redis_client: redis.Redis, prefix: str, key: str) -> list[str]:
    """Every side effect performed for ``key``, in order: ``"<generation>:<attempt id>"``."""
    return entries(redis_client, f"{prefix}:effects:{key}")
