"""Removing a test's queues from the broker, with what kombu keeps beside them.

kombu's Redis transport keeps a queue's messages in one list per priority step and, per exchange,
the binding sets ``_kombu.binding.<exchange>`` and ``_kombu.binding_permanent.<exchange>``;
``queue_delete`` and a worker's shutdown leave the binding sets behind, so a suite that makes a
queue per test piles up hundreds of them. Celery names a queue's default exchange like the queue,
so deleting those names removes everything the queue left. Only the named queues' keys go, never
the database: other processes share it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import redis
from celery import Celery

#: Priority steps of kombu's Redis transport: a queue's list for step n is ``<queue>\x06\x16n``.
_PRIORITY_STEPS = range(10)


def delete_queues(app: Celery, queues: Iterable[str]) -> None:
    """Delete ``queues`` from ``app``'s broker: on Redis their lists and binding keys (under
    ``global_keyprefix``), elsewhere through the broker's own ``queue_delete``."""
    url = str(app.conf.broker_url or "")
    if url.startswith(("redis://", "rediss://", "unix://")):
        options = app.conf.broker_transport_options or {}
        prefix = str(options.get("global_keyprefix") or "")
        client = redis.Redis.from_url(url)
        try:
            for q in queues:
                names = [q, *(f"{q}\x06\x16{n}" for n in _PRIORITY_STEPS)]
                names += [f"_kombu.binding.{q}", f"_kombu.binding_permanent.{q}"]
                client.delete(*(prefix + n for n in names))
        finally:
            client.close()
        return
    with contextlib.suppress(Exception), app.connection_for_write() as conn:
        for q in queues:
            with contextlib.suppress(Exception):
                conn.default_channel.queue_delete(q)
