"""One transition, everywhere it is seen: a log line and a signal (:mod:`celery_fence.signals`),
a Celery event for Flower (:mod:`celery_fence.events`), and, for the lease's own transitions
noticed off the task's path (lost), a row in the transitions table.

Never args, kwargs, results or payloads: a transition names the key, the attempt, the generation
and a reason.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import signals
from .events import send_transition_event
from .lease import HeldLease
from .renewer import RENEWER_THREAD_NAME
from .runtime import runtime

logger = logging.getLogger("celery_fence")

#: (Celery task id, worker hostname) of an attempt, captured at claim time for the renewal
#: thread, which has no Celery request of its own.
Origin = tuple[str | None, str | None]


def emit(
    task: Any,
    signal: Any,
    key: str,
    attempt_id: str | None,
    generation: int | None,
    reason: str | None = None,
    *,
    origin: Origin | None = None,
    **extra: Any,
) -> None:
    """Log, signal and (with ``-E``) send a Celery event for one transition; never raises."""
    signals.emit(
        signal,
        task,
        key=key,
        attempt_id=attempt_id,
        generation=generation,
        reason=reason,
        **extra,
    )
    if task.fence_config().send_events:
        task_id, hostname = origin or (task.request.id, task.request.hostname)
        send_transition_event(
            task,
            signals.ACTIONS[signal][0],
            task_id=task_id,
            hostname=hostname,
            fence_key=key,
            attempt_id=attempt_id,
            generation=generation,
            reason=reason,
            **extra,
        )


def lease_observers(
    task: Any, origin: Origin
) -> tuple[Callable[[HeldLease, str], None], Callable[[HeldLease], None]]:
    """``(on_lost, on_renewed)`` callbacks of one attempt's :class:`HeldLease`."""
    return (
        functools.partial(_on_lost, task, origin),
        functools.partial(_on_renewed, task, origin),
    )


def _on_lost(task: Any, origin: Origin, lease: HeldLease, reason: str) -> None:
    emit(task, signals.lease_lost, lease.key, lease.token, lease.generation, reason, origin=origin)
    if threading.current_thread().name != RENEWER_THREAD_NAME:
        _record_lost(task, lease, reason)  # the task noticed: record before it goes on
        return
    # The renewal thread noticed: write the history row off that thread, so a slow database
    # never delays the renewal of the process's other leases.
    runtime().writer.submit(_record_lost, task, lease, reason)


def _record_lost(task: Any, lease: HeldLease, reason: str) -> None:
    try:
        task._fence_backends()[1].record(
            lease.key,
            action="lost",
            generation=lease.generation,
            attempt_id=lease.token,
            reason=reason,
        )
    except Exception as exc:  # the loss is already in force locally; the record is history
        logger.warning(
            "could not record lease loss key=%s generation=%s: %s",
            lease.key,
            lease.generation,
            type(exc).__name__,
        )


def _on_renewed(task: Any, origin: Origin, lease: HeldLease) -> None:
    emit(task, signals.lease_renewed, lease.key, lease.token, lease.generation, origin=origin)
