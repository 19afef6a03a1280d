"""The values of the settle step: the :class:`Attempt` as far as it got, the :data:`Outcome` it
ended in, and the :data:`CeleryAction` that :func:`celery_fence.settle.settle` returns for it.

Values, no behaviour: the task fills the attempt in as it goes and builds an outcome (frozen), the
settle step reads both, and the task's adapter turns the returned action (frozen) into Celery's
terms (return, raise, re-send).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import FenceConfig
from .errors import ConfigurationError, LeaseLost, StaleGeneration
from .lease import HeldLease
from .records import Effect, JobRecord
from .retry import RetryPolicy
from .store import Store


@dataclass(eq=False)
class Attempt:
    """One execution of one logical job, as far as it got: the claim fills in ``generation`` and
    ``lease``, the registration ``attempts`` (executions counted by the store, this one
    included)."""

    task_name: str
    key: str
    attempt_id: str
    store: Store
    config: FenceConfig
    policy: RetryPolicy
    #: ``emit(action, attempt, reason=None, **extra)``: log, signal and event for a transition.
    emit: Callable[..., None]
    retries: int = 0  # Celery's re-send count of this message: backs off before registration
    generation: int | None = None
    attempts: int = 0
    lease: HeldLease | None = None
    registered: bool = False
    #: A first claim whose registration is deferred (``fence_defer_first_registration``): its row
    #: is written by its completion, or registered late by any other outcome.
    deferred: bool = False
    request_json: str | None = None
    #: ``celery -A <app>`` as the operator types it, for the hints of the errors a job ends with.
    celery_command: str = "celery -A <app>"


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
    error: Exception


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


Outcome = (
    Completed
    | Replayed
    | AlreadyDead
    | Exhausted
    | Failed
    | Lost
    | Stale
    | Busy
    | Unavailable
    | Refused
    | Unkeyed
    | Control
    | Interrupted
    | Unexpected
)


# -- what Celery is told ---------------------------------------------------------------------------


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


CeleryAction = Return | Fail | Reraise | Resend


__all__ = [
    "AlreadyDead",
    "Attempt",
    "Busy",
    "CeleryAction",
    "Completed",
    "Control",
    "Exhausted",
    "Fail",
    "Failed",
    "Interrupted",
    "Lost",
    "Outcome",
    "Refused",
    "Replayed",
    "Reraise",
    "Resend",
    "Return",
    "Stale",
    "Unavailable",
    "Unexpected",
    "Unkeyed",
]
