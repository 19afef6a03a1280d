"""Transitions as data: one table says, for every :class:`~celery_fence.actions.Action`, which
signal it sends, at which level and on which logger it is logged, which Celery event it becomes
and whether the store writes it as a row of the transitions table; :func:`emit_transition` is
the one way any path (the settle step, the task, the worker's request, the renewal thread, the
recovery and the CLI) announces one.

The action's value is the one word everywhere: the log line's ``action`` field and the table's
row say ``retry_scheduled`` alike. Two public names differ from it: the signal
``job_retry_scheduled`` and the Flower event ``task-fenceretry``.

Never args, kwargs, results or payloads: a transition names the key, the attempt, the generation
and a reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from celery.utils.dispatch import Signal

from celery_fence import metrics, signals
from celery_fence.actions import Action
from celery_fence.announce.events import event_type, send_transition_event

if TYPE_CHECKING:
    from celery_fence.announce.tracing import AttemptTrace

logger = logging.getLogger("celery_fence")

#: (Celery task id, worker hostname) of an attempt, captured at claim time for the renewal
#: thread, which has no Celery request of its own.
Origin = tuple[str | None, str | None]


@dataclass(frozen=True)
class ActionSpec:
    """How one action is seen."""

    #: Sent with ``key``, ``attempt_id``, ``generation``, ``reason`` (and the extras); None: none.
    signal: Signal | None
    level: int
    logger: logging.Logger
    #: The Celery event type a worker sends for it (with ``-E``); None: no event.
    event: str | None
    #: Whether the store writes it as a row of ``fence_transitions``.
    recorded: bool


def _t(
    signal: Signal | None,
    level: int,
    event: str | None,
    *,
    recorded: bool,
    logger_name: str = "celery_fence",
) -> ActionSpec:
    return ActionSpec(signal, level, logging.getLogger(logger_name), event, recorded)


_INFO, _WARNING, _ERROR = logging.INFO, logging.WARNING, logging.ERROR

#: The one table. Operator and recovery actions send no event (no worker saw them); a re-send by
#: the CLI or by recovery is a retry scheduled now, and sends that signal.
TABLE: Mapping[Action, ActionSpec] = MappingProxyType(
    {
        Action.CLAIMED: _t(signals.lease_claimed, _INFO, event_type("claimed"), recorded=True),
        Action.RENEWED: _t(
            signals.lease_renewed,
            logging.DEBUG,
            event_type("renewed"),
            recorded=False,
            logger_name="celery_fence.renewer",
        ),
        Action.LOST: _t(signals.lease_lost, _WARNING, event_type("lost"), recorded=True),
        Action.BUSY: _t(signals.lease_busy, _INFO, event_type("busy"), recorded=False),
        Action.COMPLETED: _t(signals.job_completed, _INFO, event_type("completed"), recorded=True),
        Action.REPLAYED: _t(signals.job_replayed, _INFO, event_type("replayed"), recorded=False),
        Action.STALE: _t(signals.stale_rejected, _WARNING, event_type("stale"), recorded=True),
        Action.RETRY_SCHEDULED: _t(
            signals.job_retry_scheduled, _WARNING, event_type("retry"), recorded=True
        ),
        Action.DEAD: _t(signals.job_dead, _ERROR, event_type("dead"), recorded=True),
        Action.FAILED: _t(None, _WARNING, None, recorded=True),
        Action.TIME_LIMIT: _t(None, _WARNING, None, recorded=True),
        Action.EXPIRED: _t(None, _WARNING, None, recorded=True),
        Action.REVOKED: _t(None, _WARNING, None, recorded=True),
        Action.REQUEUED: _t(signals.job_retry_scheduled, _WARNING, None, recorded=True),
        Action.REQUEUE_REVERTED: _t(None, _WARNING, None, recorded=True),
        Action.RECOVERED: _t(
            signals.job_retry_scheduled,
            _WARNING,
            None,
            recorded=True,
            logger_name="celery_fence.recovery",
        ),
        # Logged at INFO per attempt: the WARNING naming the task and the fix is logged once
        # per task name and process by celery_fence.body.watch.
        Action.UNFENCED_WRITE: _t(signals.unfenced_write, _INFO, None, recorded=True),
        # A claim's detail (the ``claimed`` row is its history): logged, signalled, no row.
        Action.TAKEN_OVER: _t(
            signals.job_taken_over,
            _INFO,
            None,
            recorded=False,
            logger_name="celery_fence.recovery",
        ),
    }
)


def emit_transition(
    action: Action,
    sender: Any,
    *,
    key: str,
    attempt_id: str | None = None,
    generation: int | None = None,
    reason: str | None = None,
    origin: Origin | None = None,
    error: BaseException | None = None,
    **extra: Any,
) -> None:
    """Log ``action``, send its signal and, for a worker's attempt (``origin`` given: the caller
    checked ``fence_send_events``; the worker runs with ``-E``), queue its Celery event; never
    raises.

    ``sender`` is the task (or, from the CLI, its name); ``extra`` holds the signal's and the
    event's additional fields (``remaining``, ``countdown``, ``attempts``), never payloads.
    ``error``, the body's error behind a retry or a dead job, goes to the log line only: its type
    and first line, and its traceback at DEBUG. Recording the table row is the store's part of
    the same state change, not this function's.
    """
    t = TABLE[action]
    observer = metrics.active
    if observer is not None:
        try:
            observer.transition(action, sender, reason, extra)
        except Exception:  # metrics are a view, never a reason to fail
            logger.debug("could not count the fence transition %s", action, exc_info=True)
    if t.logger.isEnabledFor(t.level):
        t.logger.log(
            t.level,
            "fence %s key=%s generation=%s attempt=%s%s%s",
            action.value,
            key,
            generation,
            attempt_id,
            f" reason={reason}" if reason else "",
            "" if error is None else f" error={error_line(error)}",
            extra={
                "action": action.value,
                "fence_key": key,
                "attempt_id": attempt_id,
                "generation": generation,
                "reason": reason,
                **({} if error is None else {"error": error_line(error)}),
            },
        )
        if error is not None and t.logger.isEnabledFor(logging.DEBUG):
            t.logger.debug(
                "fence %s key=%s: traceback of %s",
                action.value,
                key,
                type(error).__name__,
                exc_info=(type(error), error, error.__traceback__),
                extra={"action": action.value, "fence_key": key, "attempt_id": attempt_id},
            )
    if t.signal is not None and t.signal.receivers:
        try:  # Celery's send() already catches and logs each receiver's exception
            t.signal.send(
                sender,
                key=key,
                attempt_id=attempt_id,
                generation=generation,
                reason=reason,
                **extra,
            )
        except Exception:  # a broken receiver never breaks the fenced path
            logger.exception("fence %s: a %s receiver failed key=%s", action, t.signal.name, key)
    if t.event is not None and origin is not None:
        try:
            send_transition_event(
                sender,
                t.event,
                task_id=origin[0],
                hostname=origin[1],
                fence_key=key,
                attempt_id=attempt_id,
                generation=generation,
                reason=reason,
                **extra,
            )
        except Exception:  # events are a view, never a reason to fail
            logger.debug("could not queue the fence event of %s", action, exc_info=True)


#: Characters of an error's first line a log line keeps.
ERROR_LINE_LENGTH = 200


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``, at most :data:`ERROR_LINE_LENGTH` characters. A
    database error gives its driver's first line only (the lines after it can quote the
    statement's parameters)."""
    cause = getattr(error, "orig", None) or error
    lines = str(cause).strip().splitlines()
    first = lines[0].strip() if lines else ""
    text = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return text if len(text) <= ERROR_LINE_LENGTH else text[: ERROR_LINE_LENGTH - 1] + "…"


@dataclass(frozen=True)
class Announcer:
    """How one attempt's transitions are announced: ``sender`` (the task) sends the signals,
    ``origin`` names the Celery message and worker for its events, sent when ``events``;
    ``trace``, the attempt's span (:mod:`celery_fence.announce.tracing`; None: tracing off),
    gets the generation, the outcome and the lease-loss and takeover events."""

    sender: Any
    origin: Origin | None = None
    events: bool = False
    trace: AttemptTrace | None = None

    def __call__(
        self,
        action: Action,
        *,
        key: str,
        attempt_id: str | None = None,
        generation: int | None = None,
        reason: str | None = None,
        error: BaseException | None = None,
        **extra: Any,
    ) -> None:
        emit_transition(
            action,
            self.sender,
            key=key,
            attempt_id=attempt_id,
            generation=generation,
            reason=reason,
            origin=self.origin if self.events else None,
            error=error,
            **extra,
        )
        if self.trace is not None:
            self.trace.transition(action, generation=generation, reason=reason)


__all__ = [
    "TABLE",
    "ActionSpec",
    "Announcer",
    "Origin",
    "emit_transition",
]
