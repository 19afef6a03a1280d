"""The settle step: one place turns each outcome of a fenced execution into a store state and
one action for Celery.

An execution ends in an :data:`Outcome` (a value, not an exit): completed, replayed, failed,
lease lost, stale, busy, store unavailable, refused by the database, the body's own Celery
control flow, or anything unexpected. :func:`settle` makes the one fenced store write that
outcome needs and returns one :data:`Action`: return the result, fail (after the ``dead`` state
is durable), re-raise the body's control flow (after the store says what happened), or re-send
the message with a countdown. The task's adapter turns that action into Celery's terms; the
message is acked only after this step, so the ack rule reads in one place:

===================  =======================================  =============================
outcome              store write (fenced on the attempt)      action
===================  =======================================  =============================
Completed            result + ``completed``                   Return (ack)
Replayed             none (already completed)                 Return the stored result (ack)
AlreadyDead          none                                     Fail (ack)
Exhausted            ``dead``, attempts = executions          Fail (ack)
Failed               ``retrying`` or ``dead`` (retry policy)  Resend / Fail
Lost                 ``retrying``                             Resend
Stale                transition ``stale`` only                Return stored result / Resend
Busy                 none                                     Resend (never an attempt)
Unavailable          none (the store could not be asked)      Resend with backoff
Refused              ``dead``, the request kept encoded       Fail (ack)
Unkeyed              ``dead`` under ``unkeyed:<task>:<id>``   Fail (ack)
Control              ``retrying`` or ``dead``                 Reraise (Celery's own rule)
Unexpected           ``retrying`` if registered               Resend with backoff
===================  =======================================  =============================

Any write that fails (other than a fenced rejection, which means a newer generation owns the
job) turns into a re-send: never an ack without a durable state.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy import exc as sa_exc

from . import signals
from .config import FenceConfig
from .errors import (
    ConfigurationError,
    JobDead,
    LeaseLost,
    Rescheduled,
    ResultNotSerializable,
    StaleGeneration,
)
from .lease import HeldLease
from .records import Effect, JobRecord
from .retry import DEFAULT_TRANSIENT, Decision, RetryPolicy, backoff
from .store import Store

logger = logging.getLogger("celery_fence")

#: Transition action written by the worker's main process when a hard time limit killed an attempt.
TIME_LIMIT = "time_limit"


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
    #: ``emit(signal, attempt, reason=None, **extra)``: log, signal and event for a transition.
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
    | Unexpected
)


# -- actions -------------------------------------------------------------------------------------


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


Action = Return | Fail | Reraise | Resend


# -- the step ------------------------------------------------------------------------------------


def settle(attempt: Attempt, outcome: Outcome) -> Action:
    """Make the store write ``outcome`` needs and return the one action for Celery; never raises.

    A write the store could not make (unreachable, refusing, anything but a fenced rejection)
    becomes a re-send with backoff: the next delivery decides again.
    """
    try:
        if attempt.deferred and not isinstance(outcome, _NO_ROW_NEEDED):
            outcome = _register_late(attempt) or outcome
        return _HANDLERS[type(outcome)](attempt, outcome)
    except Exception as exc:
        return _unrecorded(attempt, exc, what=type(outcome).__name__.lower())


def register_deferred(a: Attempt) -> None:
    """Before a ``fence.transaction()`` block of a deferred first claim: register it now (the
    block's ownership check is a statement on its row). Raises :class:`StaleGeneration` when the
    store says a newer generation (or a completion) got there first: the body stops, and the
    attempt settles as stale, converging on the stored result."""
    if not a.deferred:
        return
    outcome = _register_late(a)
    if isinstance(outcome, Stale):
        raise outcome.error
    if outcome is not None:  # replayed or dead: the job was finished by another attempt
        record = getattr(outcome, "record", None)
        raise StaleGeneration(
            f"generation {a.generation} of {a.key!r} cannot write: the job is already finished",
            stored_generation=None if record is None else record.generation,
        )


def _register_late(a: Attempt) -> Outcome | None:
    """Register a deferred first claim before an outcome that writes its row; None when it
    registered, else the outcome the store's state calls for."""
    assert a.generation is not None
    a.deferred = False
    registration = a.store.register(
        a.key,
        generation=a.generation,
        attempt_id=a.attempt_id,
        task_name=a.task_name,
        request_json=a.request_json,
    )
    a.attempts = registration.attempts
    if registration.outcome == "registered":
        return None
    if registration.outcome == "completed":
        assert registration.record is not None
        return Replayed(registration.record)
    if registration.outcome == "dead":
        return AlreadyDead(registration.record)
    return Stale(
        StaleGeneration(
            f"generation {a.generation} of {a.key!r} was superseded before it registered",
            stored_generation=registration.stored_generation,
        )
    )


def _completed(a: Attempt, o: Completed) -> Action:
    assert a.generation is not None
    try:
        if a.deferred:  # one statement: the row inserted as completed, or nothing
            a.store.complete_first(
                a.key,
                generation=a.generation,
                attempt_id=a.attempt_id,
                task_name=a.task_name,
                request_json=a.request_json,
                result=o.result,
                effects=o.effects,
            )
        else:
            a.store.complete(
                a.key,
                generation=a.generation,
                attempt_id=a.attempt_id,
                result=o.result,
                effects=o.effects,
            )
    except StaleGeneration as exc:
        return _stale(a, Stale(exc))
    except ResultNotSerializable as exc:
        return _dead(a, exc, "result is not JSON")
    except sa_exc.DataError as exc:  # e.g. jsonb refuses "\u0000": every retry would too
        return _dead(a, refused(exc, "the task's return value"), "result refused by the database")
    a.emit(signals.job_completed, a)
    return Return(o.result, deliver=a.key if o.effects else None)


def _replayed(a: Attempt, o: Replayed) -> Action:
    a.emit(signals.job_replayed, a, reason="already completed")
    return Return(o.record.result, deliver=a.key, replay=True)


def _already_dead(a: Attempt, o: AlreadyDead) -> Action:
    error = o.record.error_type if o.record else "unknown error"
    return Fail(
        JobDead(
            f"job {a.key!r} is dead ({error}); requeue it with: celery -A <app> fence requeue "
            f"{a.key}"
        )
    )


def _exhausted(a: Attempt, o: Exhausted) -> Action:
    executions = a.attempts - 1  # this delivery only found the budget spent: not an execution
    last = a.store.last_exit(a.key)
    why = "time limit" if last == TIME_LIMIT else "attempts exhausted"
    cause = "a hard time limit killed it" if last == TIME_LIMIT else "worker lost?"
    error = JobDead(
        f"{executions} attempts ended without a result ({cause}); "
        f"max_attempts={a.config.max_attempts}"
    )
    return _dead(a, error, why, attempts=executions)


def _failed(a: Attempt, o: Failed) -> Action:
    try:
        decision = a.policy.decide(o.error, attempts=a.attempts, task_name=a.task_name)
    except Exception as exc:  # the retry budget's Redis is down: retry, never drop
        countdown = backoff(a.attempts, a.config)
        name = type(o.error).__name__
        decision = Decision(
            "retry", countdown, f"error {name}; retry budget unavailable ({type(exc).__name__})"
        )
    if decision.action == "dead":
        return _dead(a, o.error, decision.reason)
    return _retry(a, o.error, decision.countdown, decision.reason)


def _lost(a: Attempt, o: Lost) -> Action:
    return _retry(a, o.error, backoff(a.attempts, a.config), "lease lost")


def _stale(a: Attempt, o: Stale) -> Action:
    """A newer generation owns the job: record it, then converge on its result."""
    stored = o.error.context.get("stored_generation")
    a.emit(signals.stale_rejected, a, reason=f"stored generation {stored}")
    try:
        a.store.record(
            a.key,
            action="stale",
            generation=a.generation,
            attempt_id=a.attempt_id,
            reason=f"stored generation {stored}",
        )
    except Exception:
        logger.warning("could not record the stale rejection for key=%s", a.key)
    try:
        record = a.store.get(a.key)
    except Exception:  # cannot tell whether it completed: come back later and look again
        record = None
    if record is not None and record.status == "completed":
        return Return(record.result)  # every caller of this task id converges on the one result
    # The newer generation is still working: come back and converge on its result (or take over
    # if it dies). Never drop the message.
    countdown = a.config.lease_ttl + random.uniform(0, a.config.renew_interval)
    reason = f"newer generation {stored} still running"
    a.emit(signals.job_retry_scheduled, a, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, o.error)


def _busy(a: Attempt, o: Busy) -> Action:
    a.emit(signals.lease_busy, a, reason=f"held for {o.remaining:.3f}s more", remaining=o.remaining)
    jitter = random.uniform(0, max(0.05, a.config.renew_interval / 4))
    return Resend(o.remaining + jitter, "lease busy", Rescheduled("lease busy"))


def _unavailable(a: Attempt, o: Unavailable) -> Action:
    if not isinstance(o.error, DEFAULT_TRANSIENT):
        logger.error(
            "fence %s key=%s: %s; the message is re-sent with backoff",
            o.reason,
            a.key,
            type(o.error).__name__,
            extra={"action": "store_error", "fence_key": a.key, "reason": o.reason},
        )
    countdown = o.countdown if o.countdown is not None else backoff(1 + a.retries, a.config)
    a.emit(signals.job_retry_scheduled, a, reason=o.reason, countdown=countdown, attempts=None)
    return Resend(countdown, o.reason, o.error)


def _refused(a: Attempt, o: Refused) -> Action:
    assert a.generation is not None
    error = refused(o.error, "the task's arguments")
    a.store.bury_refused(
        a.key,
        generation=a.generation,
        attempt_id=a.attempt_id,
        task_name=a.task_name,
        request_json=o.request_json,
        error=error,
        reason="arguments refused by the database",
    )
    a.emit(signals.job_dead, a, reason="arguments refused by the database", attempts=1)
    return Fail(error)


def _unkeyed(a: Attempt, o: Unkeyed) -> Action:
    a.store.bury(
        a.key,
        task_name=a.task_name,
        request=o.request,
        error=o.error,
        reason="fence_key failed",
    )
    a.emit(signals.job_dead, a, reason="fence_key failed", attempts=0)
    return Fail(o.error)


def _control(a: Attempt, o: Control) -> Action:
    """The body's own ``Retry``/``Ignore``/``Reject``: Celery keeps its meaning, the row says it."""
    exc = o.error
    try:
        if isinstance(exc, Retry):
            when = exc.when
            if isinstance(when, dt.datetime):
                countdown = max(0.0, (when - dt.datetime.now(when.tzinfo)).total_seconds())
            else:
                countdown = float(when or 0.0)
            _write_retry(a, exc, countdown, "the task called self.retry()")
        elif isinstance(exc, Reject) and exc.requeue:
            _write_retry(a, exc, 0.0, "the task rejected its message with requeue")
        else:
            reason = "ignored by the task" if isinstance(exc, Ignore) else "rejected by the task"
            _write_dead(a, exc, reason)
    except StaleGeneration:
        pass  # a newer generation owns the job; Celery's own rule still applies to this message
    return Reraise(exc)


def _unexpected(a: Attempt, o: Unexpected) -> Action:
    logger.error(
        "fence unexpected %s in the %s key=%s generation=%s attempt=%s; the message is re-sent",
        type(o.error).__name__,
        o.where,
        a.key,
        a.generation,
        a.attempt_id,
        extra={"action": "unexpected", "fence_key": a.key, "generation": a.generation},
    )
    reason = f"unexpected {type(o.error).__name__} in the {o.where}"
    if not a.registered:
        return _unavailable(a, Unavailable(o.error, reason))
    return _retry(a, o.error, backoff(max(1, a.attempts), a.config), reason)


#: Outcomes of a deferred first claim that write no row (the completion writes it itself).
_NO_ROW_NEEDED = (Completed, Busy, Unavailable, Replayed, AlreadyDead, Unkeyed, Refused)

_HANDLERS: dict[type, Callable[[Attempt, Any], Action]] = {
    Completed: _completed,
    Replayed: _replayed,
    AlreadyDead: _already_dead,
    Exhausted: _exhausted,
    Failed: _failed,
    Lost: _lost,
    Stale: _stale,
    Busy: _busy,
    Unavailable: _unavailable,
    Refused: _refused,
    Unkeyed: _unkeyed,
    Control: _control,
    Unexpected: _unexpected,
}


# -- the fenced writes -----------------------------------------------------------------------------


def _write_retry(a: Attempt, error: BaseException, countdown: float, reason: str) -> None:
    assert a.generation is not None
    a.store.schedule_retry(
        a.key,
        generation=a.generation,
        attempt_id=a.attempt_id,
        error=error,
        retry_at=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=countdown),
        reason=reason,
    )
    a.emit(signals.job_retry_scheduled, a, reason=reason, countdown=countdown, attempts=a.attempts)


def _write_dead(
    a: Attempt, error: BaseException, reason: str, *, attempts: int | None = None
) -> None:
    assert a.generation is not None
    a.store.mark_dead(
        a.key,
        generation=a.generation,
        attempt_id=a.attempt_id,
        error=error,
        reason=reason,
        attempts=attempts,
    )
    a.emit(
        signals.job_dead,
        a,
        reason=reason,
        attempts=a.attempts if attempts is None else attempts,
    )


def _retry(a: Attempt, error: BaseException, countdown: float, reason: str) -> Action:
    try:
        _write_retry(a, error, countdown, reason)
    except StaleGeneration as stale:
        return _stale(a, Stale(stale))
    return Resend(countdown, reason, error)


def _dead(a: Attempt, error: BaseException, reason: str, *, attempts: int | None = None) -> Action:
    try:
        _write_dead(a, error, reason, attempts=attempts)
    except StaleGeneration as stale:
        return _stale(a, Stale(stale))
    return Fail(error)


def _unrecorded(a: Attempt, exc: Exception, *, what: str) -> Action:
    """The store could not record what happened: re-send; the next delivery decides again."""
    if not isinstance(exc, DEFAULT_TRANSIENT):
        logger.error(
            "fence could not record %s key=%s generation=%s: %s; the message is re-sent",
            what,
            a.key,
            a.generation,
            type(exc).__name__,
            extra={"action": "store_error", "fence_key": a.key, "generation": a.generation},
        )
    reason = f"{what} not recorded: store unavailable ({type(exc).__name__})"
    countdown = backoff(max(a.attempts, 1 + a.retries), a.config)
    a.emit(signals.job_retry_scheduled, a, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, exc)


def refused(exc: BaseException, what: str) -> ResultNotSerializable:
    """The database refused a value: an error that names the cause and the fix, and only the
    driver's first line (its context lines can quote the value itself)."""
    first_line = (str(getattr(exc, "orig", exc)).splitlines() or [""])[0]
    error = ResultNotSerializable(
        f"the database refused {what} ({first_line}); PostgreSQL's jsonb cannot store the NUL "
        "character (\\u0000): strip it, or pass such data base64-encoded"
    )
    error.__suppress_context__ = True
    return error
