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


#: How the reason of a ``retry_scheduled`` row written for an exit that is not an ``Exception``
#: starts (``interrupted by SystemExit``): a symptom, like a lease loss — in a prefork child the
#: pool's hard time limit first raises ``SystemExit`` in the body, and the ``time_limit`` row the
#: worker wrote just before says why.
INTERRUPTED_BY = "interrupted by"

__all__ = ["INTERRUPTED_BY", "Action"]
