"""What is left in the broker for a test's queue: ready messages plus messages delivered and not
yet acked (countdown retries wait there, in the worker's memory). The Redis transport keeps the
unacked ones in a hash of its own; AMQP counts only ready messages, so there the unacked ones
are those the workers report holding unacknowledged (Celery's remote control: active, reserved
and scheduled requests)."""

from __future__ import annotations

import json
from types import ModuleType

from celery import Celery
from kombu import Connection

#: Seconds each remote-control query waits for the workers' replies (AMQP only).
INSPECT_TIMEOUT = 0.5


def broker_queue_length(client_app: ModuleType, queue: str | None = None) -> int:
    """Messages of ``queue`` (default: the app's default queue) the broker still holds."""
    app = client_app.app
    queue = queue or app.conf.task_default_queue
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        if conn.transport.driver_type != "redis":
            ready = int(channel.queue_declare(queue=queue, passive=True).message_count)
            return ready + unacked_by_workers(app, queue, conn)
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
