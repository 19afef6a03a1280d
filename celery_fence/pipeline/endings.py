"""The fenced writes the settle step shares between outcomes: an attempt left ``retrying`` for a
re-send, ``dead``, or ``failed`` in the caller's thread; the convergence on a newer generation
when the store fences a write out (``stale``); and the re-send when the store could not record
anything (``unrecorded``). Each takes the execution (who: key, attempt, task, store, settings)
and its :class:`~celery_fence.pipeline.claim.Claim` (what the claim and the registration
decided), and returns the :data:`~celery_fence.pipeline.outcomes.Disposition`.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import time
from typing import TYPE_CHECKING

from celery_fence.actions import Action, LogAction
from celery_fence.errors import ResultNotSerializable, StaleGeneration
from celery_fence.pipeline.claim import Claim
from celery_fence.pipeline.outcomes import Disposition, Fail, Resend, Return, Stale
from celery_fence.pipeline.retry import expected_outage, outage_backoff
from celery_fence.store.records import CallerFailed, Dead, RetryScheduled

if TYPE_CHECKING:
    from celery_fence.pipeline.execution import Execution

logger = logging.getLogger("celery_fence")


def stale(execution: Execution, claim: Claim, outcome: Stale) -> Disposition:
    """A newer generation owns the job: record it, then converge on its result."""
    key, store = execution.key, execution.store
    stored = outcome.error.context.get("stored_generation")
    where = outcome.error.context.get("where") or "completion"
    execution.announce(Action.STALE, reason=f"stored generation {stored}", where=where)
    try:
        store.record(
            key,
            action=Action.STALE,
            generation=claim.generation,
            attempt_id=execution.attempt_id,
            reason=f"stored generation {stored}",
        )
    except Exception:
        logger.warning("could not record the stale rejection for key=%s", key)
    try:
        record = store.get(key)
    except Exception:  # cannot tell whether it completed: come back later and look again
        record = None
    if record is not None and record.status == "completed":
        return Return(record.result)  # every caller of this task id converges on the one result
    # The newer generation is still working: come back and converge on its result (or take over
    # if it dies). Never drop the message.
    config = execution.config
    countdown = config.lease_ttl + random.uniform(0, config.renew_interval)
    reason = f"newer generation {stored} still running"
    execution.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, outcome.error)


def write_retry(
    execution: Execution, claim: Claim, error: BaseException, countdown: float, reason: str
) -> None:
    """``retrying`` (fenced on the claim), due in ``countdown`` seconds."""
    assert claim.generation is not None
    retry_at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=countdown)
    ending = RetryScheduled(claim.generation, execution.attempt_id, error, retry_at, reason)
    execution.store.end(execution.key, ending)
    execution.announce(
        Action.RETRY_SCHEDULED,
        reason=reason,
        countdown=countdown,
        attempts=claim.attempts,
        error=error,
    )


def write_dead(
    execution: Execution,
    claim: Claim,
    error: BaseException,
    reason: str,
    *,
    attempts: int | None = None,
) -> None:
    """``dead`` (fenced on the claim)."""
    assert claim.generation is not None
    ending = Dead(claim.generation, execution.attempt_id, error, reason, attempts=attempts)
    execution.store.end(execution.key, ending)
    execution.announce(
        Action.DEAD,
        reason=reason,
        attempts=claim.attempts if attempts is None else attempts,
        error=error,
    )


def retry(
    execution: Execution, claim: Claim, error: BaseException, countdown: float, reason: str
) -> Disposition:
    """``retrying`` and a re-send; in the caller's thread ``failed`` instead."""
    if execution.in_caller:  # no message to re-send: the caller sees it
        why = f"{reason}, in the caller's thread ({execution.in_caller})"
        return caller_failed(execution, claim, error, why)
    try:
        write_retry(execution, claim, error, countdown, reason)
    except StaleGeneration as fenced_out:
        return stale(execution, claim, Stale(fenced_out))
    return Resend(countdown, reason, error)


def caller_failed(
    execution: Execution, claim: Claim, error: BaseException, reason: str
) -> Disposition:
    """An attempt in the caller's thread raised to its caller: ``failed`` (recovery leaves it;
    the next call or message runs it), then the caller gets the error."""
    assert claim.generation is not None
    ending = CallerFailed(claim.generation, execution.attempt_id, error, reason)
    try:
        execution.store.end(execution.key, ending)
    except StaleGeneration as fenced_out:  # a newer generation owns the job: converge on it
        settled = stale(execution, claim, Stale(fenced_out))
        return settled if isinstance(settled, Return) else Fail(error)
    execution.announce(Action.FAILED, reason=reason, error=error)
    return Fail(error)


def dead(
    execution: Execution,
    claim: Claim,
    error: BaseException,
    reason: str,
    *,
    attempts: int | None = None,
) -> Disposition:
    """``dead`` and a failure for Celery (converging on a newer generation if fenced out)."""
    try:
        write_dead(execution, claim, error, reason, attempts=attempts)
    except StaleGeneration as fenced_out:
        return stale(execution, claim, Stale(fenced_out))
    return Fail(error)


def unrecorded(execution: Execution, claim: Claim, exc: Exception, *, what: str) -> Disposition:
    """The store could not record what happened: re-send; the next delivery decides again."""
    if not expected_outage(exc):
        logger.error(
            "fence could not record %s key=%s generation=%s: %s; the message is re-sent",
            what,
            execution.key,
            claim.generation,
            type(exc).__name__,
            extra={
                "action": LogAction.STORE_ERROR,
                "fence_key": execution.key,
                "generation": claim.generation,
            },
        )
    reason = f"{what} not recorded: store unavailable ({type(exc).__name__})"
    countdown = outage_backoff(max(claim.attempts, 1 + execution.retries), execution.config)
    execution.announce(Action.RETRY_SCHEDULED, reason=reason, countdown=countdown, attempts=None)
    return Resend(countdown, reason, exc)


#: Seconds between the reads of :func:`completion_landed` while the store does not answer.
IN_DOUBT_POLL = 0.25


def completion_landed(execution: Execution, claim: Claim, exc: Exception) -> bool:
    """Whether a completion whose statement failed with a connection error (``exc``) committed
    anyway: a database that crashes or fails over between the COMMIT and its answer leaves the
    attempt in doubt. The job row says: read again (every :data:`IN_DOUBT_POLL` s, up to one
    lease TTL, while the renewal thread keeps the lease) until the store answers. True when the
    row is completed by this attempt's generation and attempt id: the completion counted, and is
    announced (signal, metrics, trace) as any other. False otherwise, or when the store stays
    silent: the caller re-sends, and the next delivery replays the stored result or runs again.
    """
    if not expected_outage(exc):
        return False
    key, store = execution.key, execution.store
    deadline = time.monotonic() + execution.config.lease_ttl
    while True:
        try:
            record = store.get(key)
            break
        except Exception as read_error:
            if not expected_outage(read_error) or time.monotonic() >= deadline:
                return False
            time.sleep(IN_DOUBT_POLL)
    landed = (
        record is not None
        and record.status == "completed"
        and record.generation == claim.generation
        and record.attempt_id == execution.attempt_id
    )
    logger.warning(
        "fence completion in doubt key=%s generation=%s: %s at its commit; the store says it %s",
        key,
        claim.generation,
        type(exc).__name__,
        "counted" if landed else "did not land (re-sent)",
        extra={
            "action": LogAction.STORE_ERROR,
            "fence_key": key,
            "attempt_id": execution.attempt_id,
            "generation": claim.generation,
            "reason": "completion in doubt",
        },
    )
    return landed


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


__all__ = [
    "caller_failed",
    "dead",
    "refused",
    "retry",
    "stale",
    "unrecorded",
    "write_dead",
    "write_retry",
]
