"""What is left in the broker for a test's queue (:func:`celery_fence.testing.broker.queued`):
ready messages plus messages delivered and not yet acked, on Redis and on AMQP."""

from __future__ import annotations

from types import ModuleType

from celery_fence.testing.broker import queued


def broker_queue_length(client_app: ModuleType, queue: str | None = None) -> int:
    """Messages of ``queue`` (default: the app's default queue) the broker still holds."""
    app = client_app.app
    return queued(app, queue or app.conf.task_default_queue)
