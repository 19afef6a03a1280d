"""The values of the settle step: the :data:`Outcome` an execution ended in, and the
:data:`Disposition` that :func:`celery_fence.pipeline.settle.settle` returns for it: what is done
with the message (the word AMQP uses for accept, reject, release).

Values, no behaviour: the :class:`~celery_fence.pipeline.execution.Execution` builds an outcome
(frozen), the settle step reads it, and the Celery adapters (the task, the worker's request) turn
the returned disposition (frozen) into Celery's terms (return, raise, re-send, give the message
back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_fence.errors import ConfigurationError, LeaseLost, StaleGeneration
from celery_fence.store.records import Effect, JobRecord

# -- outcomes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completed:
    result: Any
    effects: tuple[Effect, ...] = ()


@dataclass(frozen=True)
class Replayed:
    record: JobRecord


@dataclass(frozen=True)
class AlreadyDead:
    record: JobRecord | None


@dataclass(frozen=True)
class Exhausted:
    """The registration counted one attempt more than ``max_attempts``: earlier executions
    ended without a result (their worker died, a hard time limit killed them)."""


@dataclass(frozen=True)
class Failed:
    """The body raised ``error``. ``final``: why it ends the job now, whatever the retry policy
    says (Celery's own retry limit was reached: ``self.retry()`` or ``autoretry_for`` raised it
    after ``max_retries``), else None."""

    error: Exception
    final: str | None = None


class Final(Exception):
    """Raised by the body's side around ``error``, the exception that ends the job now (Celery's
    retry limit was reached: ``retry()`` raised it after ``max_retries``): the execution settles
    it as :class:`Failed` with ``final=reason``, so the job goes ``dead`` and the caller gets
    ``error`` itself, as plain Celery gives it."""

    def __init__(self, error: Exception, reason: str) -> None:
        super().__init__(reason)
        self.error = error
        self.reason = reason


@dataclass(frozen=True)
class Lost:
    error: LeaseLost


@dataclass(frozen=True)
class Stale:
    error: StaleGeneration


@dataclass(frozen=True)
class Busy:
    remaining: float


@dataclass(frozen=True)
class Limited:
    """Over a cluster-wide limit before the claim: ``reason`` is ``group_full`` (every slot of
    the group is held) or ``rate_limited`` (the bucket is empty); ``wait``: seconds until a slot
    or a token is due. Never an attempt: the message is re-sent."""

    reason: str
    wait: float
    detail: str


@dataclass(frozen=True)
class Unavailable:
    error: BaseException
    reason: str
    countdown: float | None = None


@dataclass(frozen=True)
class Refused:
    """The database refuses the stored request (e.g. PostgreSQL's jsonb refuses ``\\u0000``)."""

    error: Exception
    request_json: str | None


@dataclass(frozen=True)
class Unkeyed:
    error: ConfigurationError
    celery_id: str | None
    request: Mapping[str, Any] | None


@dataclass(frozen=True)
class Control:
    """The body raised Celery's own control flow: ``Retry``, ``Ignore`` or ``Reject``."""

    error: Exception


@dataclass(frozen=True)
class Interrupted:
    """A ``BaseException`` that is not an ``Exception`` ended the attempt: ``SystemExit``,
    ``KeyboardInterrupt``, ``asyncio.CancelledError``, gevent's ``Timeout`` (the gevent pool's
    time limit) or ``GreenletExit`` (``revoke(terminate=True)`` under gevent)."""

    error: BaseException


@dataclass(frozen=True)
class Unexpected:
    error: BaseException
    where: str = "fenced path"


@dataclass(frozen=True)
class TimeLimited:
    """The pool killed the attempt at its hard time limit (seen by the worker's main process)."""

    timeout: float | None


@dataclass(frozen=True)
class Unrun:
    """Celery acks the message without running it (``why``: ``expired`` or ``revoked``), or,
    ``terminated``, after ``revoke(terminate=True)`` killed its running attempt.
    ``shared_key``: other messages may share the job's key (a ``fence_key``)."""

    why: str
    message_id: str | None
    request: Mapping[str, Any] | None
    terminated: bool
    shared_key: bool


Outcome = (
    Completed
    | Replayed
    | AlreadyDead
    | Exhausted
    | Failed
    | Lost
    | Stale
    | Busy
    | Limited
    | Unavailable
    | Refused
    | Unkeyed
    | Control
    | Interrupted
    | Unexpected
    | TimeLimited
    | Unrun
)


# -- dispositions: what Celery is told ------------------------------------------------------


@dataclass(frozen=True)
class Return:
    """Return ``result``: Celery records SUCCESS and acks. ``deliver``: the key whose outbox rows
    this completion committed (their delivery is triggered after the return)."""

    result: Any
    deliver: str | None = None
    #: A replay: re-trigger delivery of the job's outbox rows still undelivered, if the app has
    #: an outbox (the completing attempt may have died before it triggered them).
    replay: bool = False


@dataclass(frozen=True)
class Fail:
    """Raise ``error``: the job is ``dead`` (durable); Celery records FAILURE and acks."""

    error: BaseException


@dataclass(frozen=True)
class Reraise:
    """Re-raise the body's Celery control flow; the store already says what happened."""

    error: BaseException


@dataclass(frozen=True)
class Resend:
    """Re-send the message (same task id) after ``countdown`` seconds; never an attempt lost."""

    countdown: float
    reason: str
    error: BaseException = field(compare=False)


@dataclass(frozen=True)
class Requeue:
    """Give the message back to the broker unacked (the worker's request: a hard time limit, or a
    job the store could not settle); the next delivery decides."""

    reason: str


@dataclass(frozen=True)
class Acknowledge:
    """Let Celery ack the message as it would: the store already says what happened."""


Disposition = Return | Fail | Reraise | Resend | Requeue | Acknowledge


__all__ = [
    "Acknowledge",
    "AlreadyDead",
    "Busy",
    "Completed",
    "Control",
    "Disposition",
    "Exhausted",
    "Fail",
    "Failed",
    "Final",
    "Interrupted",
    "Limited",
    "Lost",
    "Outcome",
    "Refused",
    "Replayed",
    "Requeue",
    "Reraise",
    "Resend",
    "Return",
    "Stale",
    "TimeLimited",
    "Unavailable",
    "Unexpected",
    "Unkeyed",
    "Unrun",
]
