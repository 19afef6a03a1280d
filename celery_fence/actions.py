"""The one vocabulary of transitions: what logs, signals, Celery events and the transitions table
call each step of a job's life. How each is seen (signal, log level, event, table row) is the
table in :mod:`celery_fence.transitions`."""

from __future__ import annotations

from enum import Enum


class Action(str, Enum):
    """A transition's name; the value is what the transitions table stores and logs print."""

    CLAIMED = "claimed"
    RENEWED = "renewed"
    LOST = "lost"
    BUSY = "busy"
    COMPLETED = "completed"
    REPLAYED = "replayed"
    STALE = "stale"
    RETRY_SCHEDULED = "retry_scheduled"
    DEAD = "dead"
    TIME_LIMIT = "time_limit"
    EXPIRED = "expired"
    REVOKED = "revoked"
    REQUEUED = "requeued"
    REQUEUE_REVERTED = "requeue_reverted"
    RECOVERED = "recovered"

    def __str__(self) -> str:
        return self.value


class LogEvent(str, Enum):
    """What a log line's ``action`` field says when the line announces no transition: a failure
    of a background step, or an operator's or the task's own event. With :class:`Action`, the
    whole vocabulary of that field."""

    DB_TIMEOUT = "db_timeout"
    ENQUEUE_UNSENT = "enqueue_unsent"
    INTERRUPTED = "interrupted"
    OUTBOX_NO_SENDER = "outbox_no_sender"
    OUTBOX_TRIGGER_FAILED = "outbox_trigger_failed"
    PURGE = "purge"
    RECOVER_FAILED = "recover_failed"
    REGRESSED = "regressed"
    RELEASE_FAILED = "release_failed"
    RENEW_FAILED = "renew_failed"
    REQUEUE = "requeue"
    RESCHEDULE = "reschedule"
    STORE_ERROR = "store_error"
    UNEXPECTED = "unexpected"
    WRITE_DROPPED = "write_dropped"

    def __str__(self) -> str:
        return self.value


#: How the reason of a ``retry_scheduled`` row written for an exit that is not an ``Exception``
#: starts (``interrupted by SystemExit``): a symptom, like a lease loss — in a prefork child the
#: pool's hard time limit first raises ``SystemExit`` in the body, and the ``time_limit`` row the
#: worker wrote just before says why.
INTERRUPTED_BY = "interrupted by"

__all__ = ["INTERRUPTED_BY", "Action", "LogEvent"]
