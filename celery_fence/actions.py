"""The one vocabulary of the ``action`` field: the name of what happened, as the transitions
table's ``action`` column and a log line's ``action`` key (``extra``) carry it.

- :class:`Action`: the actions that are transitions of a job's life; how each is seen (signal,
  log level, Celery event, table row) is the table in :mod:`celery_fence.announce.transitions`.
- :class:`LogAction`: the actions only log lines carry (a background step that failed, an
  operator's command, an outbox delivery).

"Action" means nothing else in celery-fence: what Celery is told to do with a message after the
settle step is a *disposition* (:data:`celery_fence.pipeline.outcomes.Disposition`).
"""

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
    FAILED = "failed"
    TIME_LIMIT = "time_limit"
    EXPIRED = "expired"
    REVOKED = "revoked"
    REQUEUED = "requeued"
    REQUEUE_REVERTED = "requeue_reverted"
    RECOVERED = "recovered"
    UNFENCED_WRITE = "unfenced_write"
    TAKEN_OVER = "taken_over"

    def __str__(self) -> str:
        return self.value


class LogAction(str, Enum):
    """What a log line's ``action`` field says when the line announces no transition: a failure
    of a background step, an outbox delivery, or an operator's or the task's own step. With
    :class:`Action`, the whole vocabulary of that field."""

    DB_TIMEOUT = "db_timeout"
    ENQUEUE_UNSENT = "enqueue_unsent"
    BEAT_SENT = "beat_sent"  # the beat scheduler enqueued a tick, or found it enqueued
    BEAT_SEND_FAILED = "beat_send_failed"  # it could not send or record one; sent on a later pass
    ENQUEUE_ROLLED_BACK = "enqueue_rolled_back"
    INTERRUPTED = "interrupted"
    OUTBOX_CLAIM_LOST = "outbox_claim_lost"
    OUTBOX_DEAD = "outbox_dead"
    OUTBOX_DELIVERED = "outbox_delivered"
    OUTBOX_NO_SENDER = "outbox_no_sender"
    OUTBOX_RECORDED = "outbox_recorded"
    OUTBOX_RETRY = "outbox_retry"
    OUTBOX_TRIGGER_FAILED = "outbox_trigger_failed"
    PURGE = "purge"
    RECOVER_CHECK = "recover_check"
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

__all__ = ["INTERRUPTED_BY", "Action", "LogAction"]
