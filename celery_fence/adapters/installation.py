"""``celery_fence.install(app)``: what celery-fence adds to a Celery app, done once, on request.

What it adds (the beat tasks on ``app``; once per process, the receivers of Celery's signals,
each acting only for installed apps) and when :class:`~celery_fence.FencedTask` calls it are
described once, in docs/design.md, "What importing does, and what install(app) does".
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from celery.utils.dispatch import Signal

from celery_fence.adapters import metrics as metrics_serve
from celery_fence.adapters import worker
from celery_fence.announce import events, logs
from celery_fence.app_state import installed, mark_installed, real_app
from celery_fence.body import watch
from celery_fence.ops.recovery import RECOVER_TASK, recover_task
from celery_fence.ops.retention import PURGE_TASK, purge_task

#: Every process-wide receiver, in the order the first :func:`install` connects them.
RECEIVERS: tuple[tuple[Signal, Any], ...] = (
    *worker.RECEIVERS,
    *events.RECEIVERS,
    *logs.RECEIVERS,
    *metrics_serve.RECEIVERS,
)

_lock = threading.RLock()  # registering a task binds it, which may ask for install() again
_connected = False


def install(app: Any) -> None:
    """Install celery-fence on ``app``: its beat tasks, and (once per process) the receivers.

    Idempotent; thread-safe. ``app`` may be Celery's ``current_app`` proxy.
    """
    app = real_app(app)
    with _lock:
        if not mark_installed(app):
            return
        _connect_receivers()
        _register_tasks(app)
        _publish_as_bookkeeping(app)


def _publish_as_bookkeeping(app: Any) -> None:
    """Every message ``app`` publishes (``.delay()``, ``apply_async``, ``send_task``, a retry)
    is Celery's bookkeeping: inside a fenced block, a broker on the database (kombu's
    SQLAlchemy transport, ``broker_url='sqla+...'``) writes its message table on a connection of
    its own, which the fence neither refuses nor flags
    (:func:`celery_fence.body.watch.bookkeeping`)."""
    send = app.send_task
    if getattr(send, "__fence_bookkeeping__", False):
        return

    @functools.wraps(send)
    def send_task(*args: Any, **kwargs: Any) -> Any:
        with watch.bookkeeping():
            return send(*args, **kwargs)

    send_task.__fence_bookkeeping__ = True  # type: ignore[attr-defined]
    app.send_task = send_task


def _connect_receivers() -> None:
    global _connected
    if _connected:
        return
    for signal, receiver in RECEIVERS:
        uid = f"celery_fence:{receiver.__module__}.{receiver.__qualname__}:{signal.name}"
        signal.connect(receiver, weak=False, dispatch_uid=uid)
    _connected = True


def _register_tasks(app: Any) -> None:
    """The beat tasks, on ``app`` only (lazily when the app is not finalized yet, as Celery's
    own ``@app.task`` does)."""
    options: dict[str, Any] = {"bind": True, "ignore_result": True, "shared": False}
    app.task(name=RECOVER_TASK, **options)(recover_task)
    app.task(name=PURGE_TASK, **options)(purge_task)


__all__ = ["RECEIVERS", "install", "installed"]
