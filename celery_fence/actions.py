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


__all__ = ["Action"]
