"""What is left in the broker for a test's queue: ready messages plus, on the Redis transport,
messages delivered and not yet acked (countdown retries wait there, in the worker's memory)."""

from __future__ import annotations

import json
from typing import Any


def broker_queue_length(client_app: Any, queue: str | None = None) -> int:
    """Messages of ``queue`` (default: the app's default queue) the broker still holds."""
    app = client_app.app
    queue = queue or app.conf.task_default_queue
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        if conn.transport.driver_type != "redis":
            return int(channel.queue_declare(queue=queue, passive=True).message_count)
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
