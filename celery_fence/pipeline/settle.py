"""The settle step: one place turns each outcome of a fenced execution into a store state and
one action for Celery.

An execution ends in an :data:`~celery_fence.pipeline.outcomes.Outcome` (a value, not an exit):
completed, replayed, failed, lease lost, stale, busy, store unavailable, refused by the database,
the body's own Celery control flow, anything unexpected, or an exit Celery drives itself (the
hard time limit, a message expired or revoked). :func:`settle` makes the one fenced
store write that outcome needs (an :data:`~celery_fence.store.records.Ending`, applied by the
store's one method ``end``) and returns one :data:`~celery_fence.pipeline.outcomes.Disposition`:
return the result, fail (after the ``dead`` state is durable), re-raise the body's control flow
(after the store says what happened), re-send the message with a countdown, give it back to the
broker, or let Celery ack it. The Celery adapters (:mod:`celery_fence.adapters.task`,
:mod:`celery_fence.adapters.worker`) turn that action into Celery's terms; the message is acked only
after this step, so the ack rule reads in one place:

===================  =======================================  =============================
outcome              store write (fenced on the attempt)      action
===================  =======================================  =============================
Completed            result + ``completed``                   Return (ack)
Replayed             none (already completed)                 Return the stored result (ack)
AlreadyDead          none                                     Fail (ack)
Exhausted            ``dead``, attempts = executions          Fail (ack)
Failed               ``retrying`` or ``dead`` (retry policy)  Resend / Fail
Failed, in the       ``failed`` (no message waits: recovery   Fail (the caller sees it)
caller's thread      leaves it; a new call or message runs
                     it)
Lost                 ``retrying``                             Resend
Stale                transition ``stale`` only                Return stored result / Resend
Busy                 none                                     Resend (never an attempt); in
                                                              the caller's thread the caller
                                                              gets ``Rescheduled``
Limited              transition ``retry_scheduled`` (reason   Resend when a slot / token is
                     ``group_full`` / ``rate_limited``)       due (never an attempt); in the
                                                              caller's thread ``Rescheduled``
Unavailable          none (the store could not be asked)      Resend with backoff
Refused              ``dead``, the request kept encoded       Fail (ack)
Refused, job ended   none (completed or dead already)         Return stored result / Fail
Unkeyed              ``dead`` under ``unkeyed:<task>:<id>``   Fail (ack)
Control              ``retrying`` or ``dead``; in the         Reraise (Celery's own rule)
                     caller's thread ``failed`` (but an eager
                     ``self.retry()``: Celery runs it inline)
Control: retry not   ``retrying``                             Reraise: the message goes back
sent (broker refused)                                         (requeue), never dropped
Interrupted          ``retrying`` if registered               Reraise if Celery needs it
                                                              (process exit, gevent time
                                                              limit or kill), else Resend
Unexpected           ``retrying`` if registered               Resend with backoff
TimeLimited          transition ``time_limit``                Requeue (the message goes back)
Unrun                ``dead`` if the job waits for this       Acknowledge; Requeue when the
                     message, else transition only            store cannot say
===================  =======================================  =============================

An attempt run in the caller's thread (a direct call ``task(...)``, ``.apply()``, an eager run:
``Execution.in_caller``) has no message: whatever would leave its row ``retrying`` for a re-send
(a failure, a lost lease, an interruption, the body's control flow) writes ``failed`` instead and
raises to the caller, as plain Celery does — never a row recovery would re-send and run after the
caller saw the call fail. A caller's process that dies mid-body leaves the row ``running``: the
caller saw no result, and recovery re-sends it (its stored request) once its lease has run out.

Any write that fails (other than a fenced rejection, which means a newer generation owns the
job) turns into a re-send: never an ack without a durable state. An interruption Celery needs
(:func:`propagates`) is re-raised whatever the store said: Celery then gives the message back to
the broker (a lost worker, or the gevent pool's hard time limit), and the next delivery decides.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy import exc as sa_exc

from celery_fence import metrics
from celery_fence.actions import INTERRUPTED_BY, Action, LogAction
from celery_fence.announce import tracing
from celery_fence.errors import (
    JobDead,
    Rescheduled,
    ResultNotSerializable,
    RetryNotSent,
    StaleGeneration,
)
from celery_fence.pipeline.outcomes import (
    Acknowledge,
    AlreadyDead,
    Busy,
    Completed,
    Control,
    Disposition,
    Exhausted,
    Fail,
    Failed,
    Interrupted,
    Limited,
    Lost,
    Outcome,
    Refused,
    Replayed,
    Requeue,
    Reraise,
    Resend,
    Return,
    Stale,
    TimeLimited,
    Unavailable,
    Unexpected,
    Unkeyed,
    Unrun,
)
from celery_fence.pipeline.retry import Decision, backoff, expected_outage, outage_backoff
from celery_fence.schema import COMPLETED, DEAD
from celery_fence.store.records import (
    CallerFailed,
    Completion,
    Dead,
    DeadRefused,
    DeadUnregistered,
    DeadUnrun,
    RetryScheduled,
    dumps_strict,
)

if TYPE_CHECKING:
    from celery_fence.pipeline.execution import Execution

logger = logging.getLogger("celery_fence")


# -- the step ------------------------------------------------------------------------------------


def settle(attempt: Execution, outcome: Outcome) -> Disposition:
    """Make the store write ``outcome`` needs and return the one action for Celery; never raises.

    A write the store could not make (unreachable, refusing, anything but a fenced rejection)
    becomes a re-send with backoff: the next delivery decides again.
    """
    try:
        action = _HANDLERS[type(outcome)](attempt, outcome)
    except Exception as exc:
        action = _unrecorded(attempt, exc, what=type(outcome).__name__.lower())
    if isinstance(outcome, Interrupted) and propagates(outcome.error):
        return Reraise(outcome.error)  # Celery gives the message back; the store said what it could
    return action


def _completed(a: Execution, o: Completed) -> Disposition:
    assert a.generation is not None
    try:
        ending = Completion(
            a.generation, a.attempt_id, o.result, o.effects, clear_steps=a.steps_used
        )
        observer = metrics.active
        started = time.perf_counter() if observer is not None else 0.0
        if a.trace is None:
            a.store.end(a.key, ending)
        else:
            with tracing.child("fence complete", _attempt_attributes(a)):
                a.store.end(a.key, ending)
        if observer is not None:
            observer.committed(a.task_name, "completion", time.perf_counter() - started)
    except StaleGeneration as exc:
        return _stale(a, Stale(exc))
    except ResultNotSerializable as exc:
        return _dead(a, exc, "result is not JSON")
    except sa_exc.DataError as exc:  # e.g. jsonb refuses "\u0000": every retry would too
        return _dead(a, refused(exc, "the task's return value"), "result refused by the database")
    a.announce(Action.COMPLETED)
    if o.effects:  # names and payloads never: they may carry what the body sent
        logger.info(
            "fence outbox recorded key=%s effects=%d run=%d",
            a.key,
            len(o.effects),
            a.run_number,
            extra={
                "action": LogAction.OUTBOX_RECORDED,
                "fence_key": a.key,
                "attempt_id": a.attempt_id,
                "generation": a.generation,
                "reason": f"run {a.run_number}",
            },
        )
    # Every caller sees the stored value: the first one too gets its JSON round trip (a tuple
    # becomes a list, an int key a str), as a replay or a converging duplicate returns it.
    stored = json.loads(dumps_strict(o.result, "task's return value"))
    return Return(stored, deliver=a.key if o.effects else None)


def _attempt_attributes(a: Execution) -> dict[str, Any]:
    return {"fence.key": a.key, "fence.generation": a.generation, "fence.attempt": a.attempt_id}


def _replayed(a: Execution, o: Replayed) -> Disposition:
    a.announce(Action.REPLAYED, reason="already completed")
    return Return(o.record.result, deliver=a.key, replay=True)


def _already_dead(a: Execution, o: AlreadyDead) -> Disposition:
    error = o.record.error_type if o.record else "unknown error"
    return Fail(
        JobDead(
            f"job {a.key!r} is dead ({error}); requeue it with: {a.celery_command} fence "
            f"requeue {a.key}"
        )
    )


def _exhausted(a: Execution, o: Exhausted) -> Disposition:
    executions = a.attempts - 1  # this delivery only found the budget spent: not an execution
    last = a.store.last_exit(a.key)
    why = "time limit" if last == Action.TIME_LIMIT else "attempts exhausted"
    cause = "a hard time limit killed it" if last == Action.TIME_LIMIT else "worker lost?"
    error = JobDead(
        f"{executions} attempts ended without a result ({cause}); "
        f"max_attempts={a.config.max_attempts}"
    )
    return _dead(a, error, why, attempts=executions)


def _failed(a: Execution, o: Failed) -> Disposition:
    if a.in_caller:  # the caller handles it, as in plain Celery: no retry, no dead-letter
        return _caller_failed(a, o.error, f"raised in the caller's thread ({a.in_caller})")
    if o.final is not None:  # Celery's own retry limit: dead now, as plain Celery fails it
        return _dead(a, o.error, o.final)
    try:
        decision = a.policy.decide(o.error, attempts=a.attempts, task_name=a.task_name)
    except Exception as exc:  # the retry budget's Redis is down: retry, never drop
        countdown = backoff(a.attempts, a.config)
        name = type(o.error).__name__
        decision = Decision(
            "retry", countdown, f"error {name}; retry budget unavailable ({type(exc).__name__})"
        )
    if decision.verdict == "dead":
        return _dead(a, o.error, decision.reason)
    return _retry(a, o.error, decision.countdown, decision.reason)


def _lost(a: Execution, o: Lost) -> Disposition:
    return _retry(a, o.error, backoff(a.attempts, a.config), "lease lost")


def _stale(a: Execution, o: Stale) -> Disposition:
    """A newer generation owns the job: record it, then converge on its result."""
    stored = o.error.context.get("stored_generation")
    where = o.error.context.get("where") or "completion"
    a.announce(Action.STALE, reason=f"stored generation {stored}", where=where)
    try:
        a.store.record(
            a.key,
            action=Action.STALE,
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
    a.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, o.error)


def _busy(a: Execution, o: Busy) -> Disposition:
    a.announce(Action.BUSY, reason=f"held for {o.remaining:.3f}s more", remaining=o.remaining)
    jitter = random.uniform(0, max(0.05, a.config.renew_interval / 4))
    error = Rescheduled("lease busy")
    if a.in_caller:  # not re-sent: the caller gets this error
        error = Rescheduled(
            f"lease busy: job {a.key!r} is being run by another attempt (its lease is held "
            f"{o.remaining:.1f}s more); a {a.in_caller} is not re-sent: call it again later, or "
            "send it with .delay()"
        )
    return Resend(o.remaining + jitter, "lease busy", error)


def _limited(a: Execution, o: Limited) -> Disposition:
    """Over a group's slots or a rate limit: the message comes back when a slot or a token is
    due, with jitter; never an attempt, never a retry of the job's. The transitions table says
    so before the ack (a failed write is logged: the re-send itself loses nothing)."""
    countdown = o.wait + random.uniform(0, min(0.25, o.wait / 4))
    reason = o.reason  # the row and the signal say exactly group_full / rate_limited
    if a.in_caller:  # not re-sent: the caller gets this error
        error = Rescheduled(
            f"{reason}: {o.detail}; a {a.in_caller} is not re-sent: call it again in "
            f"{countdown:.1f}s, or send it with .delay()"
        )
        a.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
        return Resend(countdown, o.reason, error)
    try:
        a.store.record(a.key, action=Action.RETRY_SCHEDULED, attempt_id=a.attempt_id, reason=reason)
    except Exception as exc:
        logger.warning(
            "fence could not record %s key=%s: %s; the message is re-sent",
            o.reason,
            a.key,
            type(exc).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": a.key, "reason": o.reason},
        )
    a.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, Rescheduled(f"{reason}: {o.detail}"))


def _unavailable(a: Execution, o: Unavailable) -> Disposition:
    if not expected_outage(o.error):
        logger.error(
            "fence %s key=%s: %s; the message is re-sent with backoff",
            o.reason,
            a.key,
            type(o.error).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": a.key, "reason": o.reason},
        )
    countdown = o.countdown if o.countdown is not None else outage_backoff(1 + a.retries, a.config)
    a.announce(Action.RETRY_SCHEDULED, reason=o.reason, countdown=countdown, attempts=None)
    return Resend(countdown, o.reason, o.error)


def _refused(a: Execution, o: Refused) -> Disposition:
    assert a.generation is not None
    error = refused(o.error, "the task's arguments")
    try:
        a.store.end(
            a.key,
            DeadRefused(
                a.generation,
                a.attempt_id,
                a.task_name,
                o.request_json,
                error,
                reason="arguments refused by the database",
            ),
        )
    except StaleGeneration as stale:  # the job ended already, or a newer generation runs it
        record = a.store.get(a.key)
        if record is not None and record.status == COMPLETED:
            return _replayed(a, Replayed(record))
        if record is not None and record.status == DEAD:
            return _already_dead(a, AlreadyDead(record))
        return _stale(a, Stale(stale))
    a.announce(Action.DEAD, reason="arguments refused by the database", attempts=1)
    return Fail(error)


def _unkeyed(a: Execution, o: Unkeyed) -> Disposition:
    a.store.end(a.key, DeadUnregistered(a.task_name, o.request, o.error, "fence_key failed"))
    a.announce(Action.DEAD, reason="fence_key failed", attempts=0)
    return Fail(o.error)


def _control(a: Execution, o: Control) -> Disposition:
    """The body's own ``Retry``/``Ignore``/``Reject``: Celery keeps its meaning, the row says it."""
    exc = o.error
    if a.in_caller and not (isinstance(exc, Retry) and a.eager):
        # No message to retry, requeue or ack: the caller sees it (an eager self.retry() is run
        # again inline by Celery's apply(), which registers over the retrying row)
        reason = f"{type(exc).__name__} raised in the caller's thread ({a.in_caller})"
        failed = _caller_failed(a, exc, reason)
        return failed if isinstance(failed, Return) else Reraise(exc)
    try:
        if isinstance(exc, Retry):
            when = exc.when
            if isinstance(when, dt.datetime):
                countdown = max(0.0, (when - dt.datetime.now(when.tzinfo)).total_seconds())
            else:
                countdown = float(when or 0.0)
            _write_retry(a, exc, countdown, "the task called self.retry()")
        elif isinstance(exc, RetryNotSent):  # the broker refused it: the message goes back
            _write_retry(a, exc, 0.0, "the task's retry could not be sent; the message goes back")
        elif isinstance(exc, Reject) and exc.requeue:
            _write_retry(a, exc, 0.0, "the task rejected its message with requeue")
        else:
            reason = "ignored by the task" if isinstance(exc, Ignore) else "rejected by the task"
            _write_dead(a, exc, reason)
    except StaleGeneration:
        pass  # a newer generation owns the job; Celery's own rule still applies to this message
    return Reraise(exc)


def _unexpected(a: Execution, o: Unexpected) -> Disposition:
    logger.error(
        "fence unexpected %s in the %s key=%s generation=%s attempt=%s; the message is re-sent",
        type(o.error).__name__,
        o.where,
        a.key,
        a.generation,
        a.attempt_id,
        extra={"action": LogAction.UNEXPECTED, "fence_key": a.key, "generation": a.generation},
    )
    return _again(a, o.error, f"unexpected {type(o.error).__name__} in the {o.where}")


def _interrupted(a: Execution, o: Interrupted) -> Disposition:
    """Not a failure of the job: the attempt was cut short. Retried with backoff (the store
    still counts it against ``fence_max_attempts``); never left ``running``."""
    name = type(o.error).__name__
    logger.warning(
        "fence attempt interrupted by %s key=%s generation=%s attempt=%s",
        name,
        a.key,
        a.generation,
        a.attempt_id,
        extra={"action": LogAction.INTERRUPTED, "fence_key": a.key, "generation": a.generation},
    )
    return _again(a, o.error, f"{INTERRUPTED_BY} {name}")


def _again(a: Execution, error: BaseException, reason: str) -> Disposition:
    """An attempt cut short, not failed: retried with backoff once registered (counted against
    ``fence_max_attempts``), else re-sent as when the store was unavailable."""
    if not a.registered:
        return _unavailable(a, Unavailable(error, reason))
    return _retry(a, error, backoff(max(1, a.attempts), a.config), reason)


def _time_limited(a: Execution, o: TimeLimited) -> Disposition:
    """The pool killed the attempt at its hard time limit: record it (history only) and give the
    message back; the next delivery claims once the killed attempt's lease runs out."""
    reason = f"hard time limit {o.timeout}s"
    try:
        a.store.record(a.key, action=Action.TIME_LIMIT, reason=reason)
    except Exception as exc:  # history only: the message goes back all the same
        logger.warning(
            "fence could not record the hard time limit key=%s: %s",
            a.key,
            type(exc).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": a.key, "reason": "time limit"},
        )
    a.announcer(
        Action.TIME_LIMIT,
        key=a.key,
        reason=f"{reason}, task={a.task_name}: the message goes back to the broker",
    )
    return Requeue(reason)


def _unrun(a: Execution, o: Unrun) -> Disposition:
    """A message Celery acks without running it, or whose running attempt was terminated: the
    job is settled first (:class:`~celery_fence.store.records.DeadUnrun`); a store that cannot say
    gives the message back."""
    try:
        unrun = DeadUnrun(
            a.task_name,
            o.request,
            o.why,
            only_insert=o.shared_key,
            terminated_id=o.message_id if o.terminated else None,
            message_id=o.message_id,
        )
        a.store.end(a.key, unrun)
    except Exception as exc:
        logger.error(
            "fence could not settle the %s task=%s id=%s: %s; the message goes back",
            o.why,
            a.task_name,
            o.message_id,
            type(exc).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": a.key, "reason": o.why},
        )
        return Requeue(f"{o.why}: store unavailable")
    a.announcer(
        Action(o.why),
        key=a.key,
        reason=f"task={a.task_name} id={o.message_id} "
        + ("terminated" if o.terminated else "not run")
        + "; the job is recorded",
    )
    return Acknowledge()


def propagates(error: BaseException) -> bool:
    """Whether Celery needs ``error`` raised on after the settle step: the process is exiting
    (``SystemExit``, ``KeyboardInterrupt`` on the main thread: the solo pool, a direct call), or
    gevent is cutting the greenlet (its ``Timeout``: the gevent pool's hard time limit;
    ``GreenletExit``: ``revoke(terminate=True)``). Anything else is re-sent: a ``SystemExit`` in
    a threads-pool thread or a gevent-pool greenlet exits nothing (Celery 5 fails on it and
    leaves the message unacked), and ``asyncio.CancelledError`` means nothing to Celery."""
    if isinstance(error, (SystemExit, KeyboardInterrupt)):
        return threading.current_thread() is threading.main_thread()
    greenlet = sys.modules.get("greenlet")  # only when loaded: never imported here
    if greenlet is not None and isinstance(error, greenlet.GreenletExit):
        return True
    timeout = sys.modules.get("gevent.timeout")
    return timeout is not None and isinstance(error, timeout.Timeout)


_HANDLERS: dict[type, Callable[[Execution, Any], Disposition]] = {
    Completed: _completed,
    Replayed: _replayed,
    AlreadyDead: _already_dead,
    Exhausted: _exhausted,
    Failed: _failed,
    Lost: _lost,
    Stale: _stale,
    Busy: _busy,
    Limited: _limited,
    Unavailable: _unavailable,
    Refused: _refused,
    Unkeyed: _unkeyed,
    Control: _control,
    Interrupted: _interrupted,
    Unexpected: _unexpected,
    TimeLimited: _time_limited,
    Unrun: _unrun,
}


# -- the fenced writes -----------------------------------------------------------------------------


def _write_retry(a: Execution, error: BaseException, countdown: float, reason: str) -> None:
    assert a.generation is not None
    retry_at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=countdown)
    a.store.end(a.key, RetryScheduled(a.generation, a.attempt_id, error, retry_at, reason))
    a.announce(
        Action.RETRY_SCHEDULED,
        reason=reason,
        countdown=countdown,
        attempts=a.attempts,
        error=error,
    )


def _write_dead(
    a: Execution, error: BaseException, reason: str, *, attempts: int | None = None
) -> None:
    assert a.generation is not None
    a.store.end(a.key, Dead(a.generation, a.attempt_id, error, reason, attempts=attempts))
    a.announce(
        Action.DEAD,
        reason=reason,
        attempts=a.attempts if attempts is None else attempts,
        error=error,
    )


def _retry(a: Execution, error: BaseException, countdown: float, reason: str) -> Disposition:
    if a.in_caller:  # no message to re-send: the caller sees it
        return _caller_failed(a, error, f"{reason}, in the caller's thread ({a.in_caller})")
    try:
        _write_retry(a, error, countdown, reason)
    except StaleGeneration as stale:
        return _stale(a, Stale(stale))
    return Resend(countdown, reason, error)


def _caller_failed(a: Execution, error: BaseException, reason: str) -> Disposition:
    """An attempt in the caller's thread raised to its caller: ``failed`` (recovery leaves it;
    the next call or message runs it), then the caller gets the error."""
    assert a.generation is not None
    try:
        a.store.end(a.key, CallerFailed(a.generation, a.attempt_id, error, reason))
    except StaleGeneration as stale:  # a newer generation owns the job: converge on it
        settled = _stale(a, Stale(stale))
        return settled if isinstance(settled, Return) else Fail(error)
    a.announce(Action.FAILED, reason=reason, error=error)
    return Fail(error)


def _dead(
    a: Execution, error: BaseException, reason: str, *, attempts: int | None = None
) -> Disposition:
    try:
        _write_dead(a, error, reason, attempts=attempts)
    except StaleGeneration as stale:
        return _stale(a, Stale(stale))
    return Fail(error)


def _unrecorded(a: Execution, exc: Exception, *, what: str) -> Disposition:
    """The store could not record what happened: re-send; the next delivery decides again."""
    if not expected_outage(exc):
        logger.error(
            "fence could not record %s key=%s generation=%s: %s; the message is re-sent",
            what,
            a.key,
            a.generation,
            type(exc).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": a.key, "generation": a.generation},
        )
    reason = f"{what} not recorded: store unavailable ({type(exc).__name__})"
    countdown = outage_backoff(max(a.attempts, 1 + a.retries), a.config)
    a.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
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


__all__ = ["propagates", "refused", "settle"]
