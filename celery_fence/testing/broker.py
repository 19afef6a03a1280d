"""A test's queues on the broker: what is left in one (:func:`queued`), and removing them with what
kombu keeps beside them (:func:`delete_queues`).

kombu's Redis transport keeps a queue's messages in one list per priority step and, per exchange,
the binding sets ``_kombu.binding.<exchange>`` and ``_kombu.binding_permanent.<exchange>``;
``queue_delete`` and a worker's shutdown leave the binding sets behind, so a suite that makes a
queue per test piles up hundreds of them. Celery names a queue's default exchange like the queue,
so deleting those names removes everything the queue left. Only the named queues' keys go, never
the database: other processes share it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable

import redis
from celery import Celery
from kombu import Connection

#: Priority steps of kombu's Redis transport: a queue's list for step n is ``<queue>\x06\x16n``.
_PRIORITY_STEPS = range(10)
#: Seconds each remote-control query waits for the workers' replies (AMQP only).
INSPECT_TIMEOUT = 0.5


def queued(app: Celery, queue: str, *, held_by_workers: bool = True) -> int:
    """Messages of ``queue`` the broker still holds: ready ones, plus those delivered and not yet
    acked (countdown retries wait there, in a worker's memory).

    The Redis transport keeps the unacked ones in a hash of its own. AMQP counts only ready
    messages: with ``held_by_workers`` the unacked ones are those the running workers report
    holding unacknowledged (Celery's remote control: active, reserved and scheduled requests);
    without it a message a worker holds counts as taken."""
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        if conn.transport.driver_type != "redis":
            ready = int(channel.queue_declare(queue=queue, passive=True).message_count)
            return ready + (unacked_by_workers(app, queue, conn) if held_by_workers else 0)
        client = channel.client
        lists = [queue, *(f"{queue}{channel.sep}{p}" for p in channel.priority_steps[1:])]
        ready = sum(int(client.llen(name)) for name in lists)
        unacked = 0
        for raw in client.hvals(channel.unacked_key):
            try:
                _, _, routing_key = json.loads(raw)
            except (ValueError, TypeError):
                continue
            unacked += routing_key == queue
        return ready + unacked


def unacked_by_workers(app: Celery, queue: str, connection: Connection) -> int:
    """Messages of ``queue`` the running workers hold delivered and not yet acked (asked over
    ``connection``, which the caller closes)."""
    inspect = app.control.inspect(timeout=INSPECT_TIMEOUT, connection=connection)
    held = 0
    for method in (inspect.active, inspect.reserved, inspect.scheduled):
        for requests in (method() or {}).values():
            for entry in requests:
                request = entry.get("request", entry)  # scheduled() wraps each request
                delivery = request.get("delivery_info") or {}
                if delivery.get("routing_key") == queue and not request.get("acknowledged"):
                    held += 1
    return held


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
