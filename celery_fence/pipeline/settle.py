"""The settle step: one place turns each outcome of a fenced execution into a store state and
one action for Celery.

An execution ends in an :data:`~celery_fence.pipeline.outcomes.Outcome` (a value, not an exit):
completed, replayed, failed, lease lost, stale, busy, store unavailable, refused by the database,
the body's own Celery control flow, anything unexpected. ``settle(execution, claim, outcome)``
(who ran it; what its :class:`~celery_fence.pipeline.claim.Claim` decided; how it ended) makes
the one fenced store write that outcome needs (an :data:`~celery_fence.store.records.Ending`,
applied by the store's ``end``) and returns one :data:`~celery_fence.pipeline.outcomes.Disposition`:
return the result, fail (after the ``dead`` state is durable), re-raise the body's control flow
(after the store says what happened), re-send the message with a countdown, give it back to the
broker, or let Celery ack it. The Celery adapters (:mod:`celery_fence.adapters.task`,
:mod:`celery_fence.adapters.worker`) turn that action into Celery's terms; the message is acked only
after this step, so the ack rule reads in one place (the exits Celery drives in the worker's
main process, where nothing was claimed, have their own table in
:mod:`celery_fence.pipeline.exits`):

===================  =======================================  =============================
outcome              store write (fenced on the attempt)      action
===================  =======================================  =============================
Completed            result + ``completed``                   Return (ack)
Completed, its       read the row again (up to a TTL)         Return if the row is this
answer lost                                                   attempt's, else Resend
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
from celery_fence.pipeline import endings
from celery_fence.pipeline.claim import Claim
from celery_fence.pipeline.outcomes import (
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
    Reraise,
    Resend,
    Return,
    Stale,
    Unavailable,
    Unexpected,
    Unkeyed,
)
from celery_fence.pipeline.retry import Decision, backoff, expected_outage, outage_backoff
from celery_fence.schema import COMPLETED, DEAD
from celery_fence.store.records import Completion, DeadRefused, DeadUnregistered, dumps_strict

if TYPE_CHECKING:
    from celery_fence.pipeline.execution import Execution

logger = logging.getLogger("celery_fence")


# -- the step ------------------------------------------------------------------------------------


def settle(execution: Execution, claim: Claim, outcome: Outcome) -> Disposition:
    """Make the store write ``outcome`` needs and return the one action for Celery; never raises.

    A write the store could not make (unreachable, refusing, anything but a fenced rejection)
    becomes a re-send with backoff: the next delivery decides again.
    """
    try:
        action = _HANDLERS[type(outcome)](execution, claim, outcome)
    except Exception as exc:
        action = endings.unrecorded(execution, claim, exc, what=type(outcome).__name__.lower())
    if isinstance(outcome, Interrupted) and propagates(outcome.error):
        return Reraise(outcome.error)  # Celery gives the message back; the store said what it could
    return action


def _completed(execution: Execution, claim: Claim, outcome: Completed) -> Disposition:
    assert claim.generation is not None
    key, store = execution.key, execution.store
    try:
        ending = Completion(
            claim.generation,
            execution.attempt_id,
            outcome.result,
            outcome.effects,
            clear_steps=execution.steps_used,
        )
        observer = metrics.active
        started = time.perf_counter() if observer is not None else 0.0
        if execution.trace is None:
            store.end(key, ending)
        else:
            ids = {"fence.key": key, "fence.generation": claim.generation}
            with tracing.child("fence complete", {**ids, "fence.attempt": execution.attempt_id}):
                store.end(key, ending)
        if observer is not None:
            observer.committed(execution.task_name, "completion", time.perf_counter() - started)
    except StaleGeneration as exc:
        return endings.stale(execution, claim, Stale(exc))
    except ResultNotSerializable as exc:
        return endings.dead(execution, claim, exc, "result is not JSON")
    except sa_exc.DataError as exc:  # e.g. jsonb refuses "\u0000": every retry would too
        error = endings.refused(exc, "the task's return value")
        return endings.dead(execution, claim, error, "result refused by the database")
    except Exception as exc:  # the COMMIT's answer lost (a crash): did it land?
        if not endings.completion_landed(execution, claim, exc):
            raise
    execution.announce(Action.COMPLETED)
    if outcome.effects:  # names and payloads never: they may carry what the body sent
        logger.info(
            "fence outbox recorded key=%s effects=%d run=%d",
            key,
            len(outcome.effects),
            claim.run_number,
            extra={
                "action": LogAction.OUTBOX_RECORDED,
                "fence_key": key,
                "attempt_id": execution.attempt_id,
                "generation": claim.generation,
                "reason": f"run {claim.run_number}",
            },
        )
    # Every caller sees the stored value: the first one too gets its JSON round trip (a tuple
    # becomes a list, an int key a str), as a replay or a converging duplicate returns it.
    stored = json.loads(dumps_strict(outcome.result, "task's return value"))
    return Return(stored, deliver=key if outcome.effects else None)


def _replayed(execution: Execution, claim: Claim, outcome: Replayed) -> Disposition:
    execution.announce(Action.REPLAYED, reason="already completed")
    return Return(outcome.record.result, deliver=execution.key, replay=True)


def _already_dead(execution: Execution, claim: Claim, outcome: AlreadyDead) -> Disposition:
    error = outcome.record.error_type if outcome.record else "unknown error"
    return Fail(
        JobDead(
            f"job {execution.key!r} is dead ({error}); requeue it with: "
            f"{execution.celery_command} fence requeue {execution.key}"
        )
    )


def _exhausted(execution: Execution, claim: Claim, outcome: Exhausted) -> Disposition:
    executions = claim.attempts - 1  # this delivery only found the budget spent: not an execution
    last = execution.store.transitions.last_exit(execution.key)
    why = "time limit" if last == Action.TIME_LIMIT else "attempts exhausted"
    cause = "a hard time limit killed it" if last == Action.TIME_LIMIT else "worker lost?"
    error = JobDead(
        f"{executions} attempts ended without a result ({cause}); "
        f"max_attempts={execution.config.max_attempts}"
    )
    return endings.dead(execution, claim, error, why, attempts=executions)


def _failed(execution: Execution, claim: Claim, outcome: Failed) -> Disposition:
    error = outcome.error
    if execution.in_caller:  # the caller handles it, as in plain Celery: no retry, no dead-letter
        reason = f"raised in the caller's thread ({execution.in_caller})"
        return endings.caller_failed(execution, claim, error, reason)
    if outcome.final is not None:  # Celery's own retry limit: dead now, as plain Celery fails it
        return endings.dead(execution, claim, error, outcome.final)
    try:
        decision = execution.policy.decide(
            error, attempts=claim.attempts, task_name=execution.task_name
        )
    except Exception as exc:  # the retry budget's Redis is down: retry, never drop
        countdown = backoff(claim.attempts, execution.config)
        why = f"error {type(error).__name__}; retry budget unavailable ({type(exc).__name__})"
        decision = Decision("retry", countdown, why)
    if decision.verdict == "dead":
        return endings.dead(execution, claim, error, decision.reason)
    return endings.retry(execution, claim, error, decision.countdown, decision.reason)


def _lost(execution: Execution, claim: Claim, outcome: Lost) -> Disposition:
    countdown = backoff(claim.attempts, execution.config)
    return endings.retry(execution, claim, outcome.error, countdown, "lease lost")


def _busy(execution: Execution, claim: Claim, outcome: Busy) -> Disposition:
    remaining = outcome.remaining
    execution.announce(Action.BUSY, reason=f"held for {remaining:.3f}s more", remaining=remaining)
    jitter = random.uniform(0, max(0.05, execution.config.renew_interval / 4))
    error = Rescheduled("lease busy")
    if execution.in_caller:  # not re-sent: the caller gets this error
        error = Rescheduled(
            f"lease busy: job {execution.key!r} is being run by another attempt (its lease is "
            f"held {remaining:.1f}s more); a {execution.in_caller} is not re-sent: call it again "
            "later, or send it with .delay()"
        )
    return Resend(remaining + jitter, "lease busy", error)


def _limited(execution: Execution, claim: Claim, outcome: Limited) -> Disposition:
    """Over a group's slots or a rate limit: the message comes back when a slot or a token is
    due, with jitter; never an attempt, never a retry of the job's. The transitions table says
    so before the ack (a failed write is logged: the re-send itself loses nothing)."""
    countdown = outcome.wait + random.uniform(0, min(0.25, outcome.wait / 4))
    reason = outcome.reason  # the row and the signal say exactly group_full / rate_limited
    if execution.in_caller:  # not re-sent: the caller gets this error
        error = Rescheduled(
            f"{reason}: {outcome.detail}; a {execution.in_caller} is not re-sent: call it again "
            f"in {countdown:.1f}s, or send it with .delay()"
        )
        execution.announce(
            Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None
        )
        return Resend(countdown, reason, error)
    key = execution.key
    try:
        execution.store.record(
            key, action=Action.RETRY_SCHEDULED, attempt_id=execution.attempt_id, reason=reason
        )
    except Exception as exc:
        logger.warning(
            "fence could not record %s key=%s: %s; the message is re-sent",
            reason,
            key,
            type(exc).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": key, "reason": reason},
        )
    execution.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, Rescheduled(f"{reason}: {outcome.detail}"))


def _unavailable(execution: Execution, claim: Claim, outcome: Unavailable) -> Disposition:
    reason = outcome.reason
    if not expected_outage(outcome.error):
        logger.error(
            "fence %s key=%s: %s; the message is re-sent with backoff",
            reason,
            execution.key,
            type(outcome.error).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": execution.key, "reason": reason},
        )
    countdown = outcome.countdown
    if countdown is None:
        countdown = outage_backoff(1 + execution.retries, execution.config)
    execution.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, outcome.error)


def _refused(execution: Execution, claim: Claim, outcome: Refused) -> Disposition:
    assert claim.generation is not None
    error = endings.refused(outcome.error, "the task's arguments")
    reason = "arguments refused by the database"
    ending = DeadRefused(
        claim.generation,
        execution.attempt_id,
        execution.task_name,
        outcome.request_json,
        error,
        reason=reason,
    )
    try:
        execution.store.end(execution.key, ending)
    except StaleGeneration as fenced_out:  # the job ended already, or a newer generation runs it
        record = execution.store.get(execution.key)
        if record is not None and record.status == COMPLETED:
            return _replayed(execution, claim, Replayed(record))
        if record is not None and record.status == DEAD:
            return _already_dead(execution, claim, AlreadyDead(record))
        return endings.stale(execution, claim, Stale(fenced_out))
    execution.announce(Action.DEAD, reason=reason, attempts=1)
    return Fail(error)


def _unkeyed(execution: Execution, claim: Claim, outcome: Unkeyed) -> Disposition:
    ending = DeadUnregistered(
        execution.task_name, outcome.request, outcome.error, "fence_key failed"
    )
    execution.store.end(execution.key, ending)
    execution.announce(Action.DEAD, reason="fence_key failed", attempts=0)
    return Fail(outcome.error)


def _control(execution: Execution, claim: Claim, outcome: Control) -> Disposition:
    """The body's own ``Retry``/``Ignore``/``Reject``: Celery keeps its meaning, the row says it."""
    exc = outcome.error
    if execution.in_caller and not (isinstance(exc, Retry) and execution.eager):
        # No message to retry, requeue or ack: the caller sees it (an eager self.retry() is run
        # again inline by Celery's apply(), which registers over the retrying row)
        reason = f"{type(exc).__name__} raised in the caller's thread ({execution.in_caller})"
        failed = endings.caller_failed(execution, claim, exc, reason)
        return failed if isinstance(failed, Return) else Reraise(exc)
    try:
        if isinstance(exc, Retry):
            when = exc.when
            if isinstance(when, dt.datetime):
                countdown = max(0.0, (when - dt.datetime.now(when.tzinfo)).total_seconds())
            else:
                countdown = float(when or 0.0)
            endings.write_retry(execution, claim, exc, countdown, "the task called self.retry()")
        elif isinstance(exc, RetryNotSent):  # the broker refused it: the message goes back
            reason = "the task's retry could not be sent; the message goes back"
            endings.write_retry(execution, claim, exc, 0.0, reason)
        elif isinstance(exc, Reject) and exc.requeue:
            reason = "the task rejected its message with requeue"
            endings.write_retry(execution, claim, exc, 0.0, reason)
        else:
            reason = "ignored by the task" if isinstance(exc, Ignore) else "rejected by the task"
            endings.write_dead(execution, claim, exc, reason)
    except StaleGeneration:
        pass  # a newer generation owns the job; Celery's own rule still applies to this message
    return Reraise(exc)


def _unexpected(execution: Execution, claim: Claim, outcome: Unexpected) -> Disposition:
    name, key, generation = type(outcome.error).__name__, execution.key, claim.generation
    logger.error(
        "fence unexpected %s in the %s key=%s generation=%s attempt=%s; the message is re-sent",
        name,
        outcome.where,
        key,
        generation,
        execution.attempt_id,
        extra={"action": LogAction.UNEXPECTED, "fence_key": key, "generation": generation},
    )
    return _again(execution, claim, outcome.error, f"unexpected {name} in the {outcome.where}")


def _interrupted(execution: Execution, claim: Claim, outcome: Interrupted) -> Disposition:
    """Not a failure of the job: the attempt was cut short. Retried with backoff (the store
    still counts it against ``fence_max_attempts``); never left ``running``."""
    name, key, generation = type(outcome.error).__name__, execution.key, claim.generation
    logger.warning(
        "fence attempt interrupted by %s key=%s generation=%s attempt=%s",
        name,
        key,
        generation,
        execution.attempt_id,
        extra={"action": LogAction.INTERRUPTED, "fence_key": key, "generation": generation},
    )
    return _again(execution, claim, outcome.error, f"{INTERRUPTED_BY} {name}")


def _again(execution: Execution, claim: Claim, error: BaseException, reason: str) -> Disposition:
    """An attempt cut short, not failed: retried with backoff once registered (counted against
    ``fence_max_attempts``), else re-sent as when the store was unavailable."""
    if not claim.registered:
        return _unavailable(execution, claim, Unavailable(error, reason))
    countdown = backoff(max(1, claim.attempts), execution.config)
    return endings.retry(execution, claim, error, countdown, reason)


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


_HANDLERS: dict[type, Callable[[Execution, Claim, Any], Disposition]] = {
    Completed: _completed,
    Replayed: _replayed,
    AlreadyDead: _already_dead,
    Exhausted: _exhausted,
    Failed: _failed,
    Lost: _lost,
    Stale: endings.stale,
    Busy: _busy,
    Limited: _limited,
    Unavailable: _unavailable,
    Refused: _refused,
    Unkeyed: _unkeyed,
    Control: _control,
    Interrupted: _interrupted,
    Unexpected: _unexpected,
}


__all__ = ["propagates", "settle"]
