"""Celery events for fence transitions, so Flower shows them and counts them in ``/metrics``.

One event per transition a worker sees, of the type :data:`celery_fence.announce.transitions.TABLE`
names: ``task-fence<subject>`` (``task-fenceclaimed``, ``task-fencerenewed``, ``task-fencelost``,
``task-fencebusy``, ``task-fencecompleted``, ``task-fencereplayed``, ``task-fencestale``,
``task-fenceretry`` for ``retry_scheduled``, ``task-fencedead``), with the
Celery task id as ``uuid`` and the fields ``fence_key``, ``attempt_id``, ``generation`` and
``reason`` (plus ``remaining``, ``countdown`` or ``attempts`` where they fit) — never args, kwargs,
results or payloads.

Why one word after the dash: Celery's event state (which Flower uses) splits the type at the
*first* dash, looks the subject up among its own task events and otherwise takes
``subject.upper()`` as the task's state. ``task-fence-claimed`` would read ``FENCE-CLAIMED``;
``task-claimed`` would read ``CLAIMED`` but lives in Celery's own namespace, where ``retry``
becomes Celery's real ``RETRY`` state and any future Celery event may collide.
``task-fence<action>`` reads ``FENCECLAIMED``, ``FENCESTALE``, ... and every fence event matches
one Prometheus selector: ``flower_events_total{type=~"task-fence.*"}``.

Events are cheap and never in the way: the fenced path (and the renewal thread) only put the
event on a bounded in-memory queue; one daemon thread per process and app (and worker name) owns
its dispatcher (one broker connection) and publishes without retrying. When the broker is slow
or down, events are dropped, never buffered without bound and never raised. They are sent only
when the worker sends task events (``celery worker -E`` or ``worker_send_task_events=True``) and
``fence_send_events`` is on (the default).

The two signal receivers here (:data:`RECEIVERS`) are connected by :func:`celery_fence.install`,
not by importing this module; each acts only for an installed app.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from celery import signals as celery_signals
from celery.utils.dispatch import Signal

from celery_fence.app_state import app_state, installed
from celery_fence.process.background import Background
from celery_fence.process.runtime import runtime

logger = logging.getLogger("celery_fence.events")

#: Event types are ``EVENT_PREFIX + subject``: ``task-fenceclaimed``, ``task-fencestale``, ...
EVENT_PREFIX = "task-fence"
#: Events waiting for the sender thread; beyond this they are dropped (the broker lags behind).
MAX_PENDING = 10_000


def event_type(subject: str) -> str:
    """The Celery event type of a subject: ``event_type("stale") == "task-fencestale"``."""
    return f"{EVENT_PREFIX}{subject}"


def _remember_task_events(sender: Any = None, **_: Any) -> None:
    """``celery worker -E`` sets the worker's ``task_events``, not ``app.conf``: remember it here.

    Runs in the worker's main process before the pool forks, so prefork children inherit it.
    """
    app: Any = getattr(sender, "app", None)
    if installed(app):
        app_state(app).task_events = bool(getattr(sender, "task_events", False))


def task_events_enabled(app: Any) -> bool:
    """Whether this process's worker sends task events (``-E`` or ``worker_send_task_events``)."""
    enabled = app_state(app).task_events
    if enabled is None:
        return bool(app.conf.worker_send_task_events)
    return enabled


class EventSender(Background):
    """One dispatcher, one connection and one daemon thread per (process, app, worker name)."""

    thread_name = "celery-fence-events"

    def __init__(self, app: Any, hostname: str) -> None:
        super().__init__()
        self.app = app
        self.hostname = hostname
        self.pending: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue(MAX_PENDING)
        self.sent = 0
        self.dropped = 0
        self._dispatcher: Any = None

    def submit(self, type_: str, fields: dict[str, Any]) -> None:
        try:
            self.pending.put_nowait((type_, fields))
        except queue.Full:
            self.dropped += 1
            return
        self.start()

    def flush(self, timeout: float) -> None:
        """Wait (bounded) until the queued events were handed to the broker or dropped."""
        end = time.monotonic() + timeout
        while self.pending.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)

    def shutdown(self, timeout: float) -> None:
        """The events queued so far go out, then the thread stops (bounded; a later event starts
        it again)."""
        end = time.monotonic() + timeout
        self.flush(timeout)
        if self.running:
            try:
                self.pending.put(None, timeout=max(0.0, end - time.monotonic()))
            except queue.Full:
                return
            self.join(end - time.monotonic())

    def _run(self) -> None:
        while True:
            item = self.pending.get()
            try:
                if item is None:
                    return
                self._send(*item)
            finally:
                self.pending.task_done()

    def _send(self, type_: str, fields: dict[str, Any]) -> None:
        try:
            if self._dispatcher is None:
                self._dispatcher = self.app.events.Dispatcher(
                    self.app.connection_for_write(),
                    hostname=self.hostname,
                    enabled=True,
                    buffer_while_offline=False,
                )
            self._dispatcher.send(type_, retry=False, **fields)
            self.sent += 1
        except Exception as exc:  # events are a view: drop this one, reconnect for the next
            self.dropped += 1
            logger.debug("could not send fence event %s: %s", type_, type(exc).__name__)
            self._close()

    def _close(self) -> None:
        dispatcher, self._dispatcher = self._dispatcher, None
        if dispatcher is not None:
            try:
                dispatcher.close()
                dispatcher.connection.release()
            except Exception:  # already broken
                logger.debug("closing the fence event dispatcher failed", exc_info=True)


def send_transition_event(
    task: Any,
    type_: str,
    *,
    task_id: str | None,
    hostname: str | None,
    **fields: Any,
) -> None:
    """Queue one event of type ``type_`` (``task-fence<subject>``, named by the transitions table)
    for Celery task ``task_id``; never raises.

    ``fields`` are the transition's (``fence_key``, ``attempt_id``, ``generation``, ``reason``,
    numbers such as ``countdown``): JSON scalars, never payloads. ``task_id`` and ``hostname``
    are passed explicitly because the renewal thread has no Celery request of its own.
    """
    try:
        if not task_id or not hostname or not getattr(task, "send_events", True):
            return
        app = task.app
        if not task_events_enabled(app):
            return
        sender = runtime().get("events", (id(app), hostname), lambda: EventSender(app, hostname))
        sender.submit(type_, {"uuid": task_id, **fields})
    except Exception:  # events are a view, never a reason to fail
        logger.debug("could not queue fence event %s", type_, exc_info=True)


def flush(timeout: float = 2.0) -> None:
    """Wait (bounded) until this process's queued fence events were published (or dropped)."""
    end = time.monotonic() + timeout
    for sender in runtime().items("events"):
        sender.flush(max(0.0, end - time.monotonic()))


def _flush_at_shutdown(sender: Any = None, **_: Any) -> None:
    if installed(getattr(sender, "app", None)):
        flush(timeout=1.0)


#: The process-wide receivers :func:`celery_fence.install` connects, once.
RECEIVERS: tuple[tuple[Signal, Any], ...] = (
    (celery_signals.worker_init, _remember_task_events),
    (celery_signals.worker_shutdown, _flush_at_shutdown),
)


__all__ = [
    "EVENT_PREFIX",
    "RECEIVERS",
    "EventSender",
    "event_type",
    "flush",
    "send_transition_event",
    "task_events_enabled",
]
