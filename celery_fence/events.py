"""Celery events for fence transitions (``task-fence-<action>``), so Flower can show them."""

from __future__ import annotations

import contextlib
from typing import Any


def send_transition_event(task: Any, action: str, **fields: Any) -> None:
    """Send one ``task-fence-<action>`` event when the worker sends task events (``-E``)."""
    app = task.app
    if not app.conf.worker_send_task_events:
        return
    with contextlib.suppress(Exception):  # events are a view, never a reason to fail
        task.send_event(f"task-fence-{action}", retry=False, **fields)
