"""What the worker's main process settles: the exits Celery drives there, where no attempt of
this process claimed anything (:class:`~celery_fence.adapters.worker.FencedRequest`).

===================  =======================================  =============================
outcome              store write                              action
===================  =======================================  =============================
TimeLimited          transition ``time_limit``                Requeue (the message goes back)
Unrun                ``dead`` if the job waits for this       Acknowledge; Requeue when the
                     message, else transition only            store cannot say
===================  =======================================  =============================

``TimeLimited``: the pool killed the child running the attempt at its hard time limit (the
child's own settle step never ran; the next delivery claims once the killed lease runs out).
``Unrun``: Celery acks a message without running it (expired, revoked), or after
``revoke(terminate=True)`` killed its attempt. A child lost some other way (SIGKILL, the OOM
killer) has nothing to settle here: Celery gives its message back (``reject_on_worker_lost``)
and the row it left ``running`` is the next delivery's, or recovery's, to take over.

The attempt's own endings, in the child (or the thread) that ran it, are
:func:`celery_fence.pipeline.settle.settle`'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery_fence.actions import Action, LogAction
from celery_fence.pipeline.endings import unrecorded
from celery_fence.pipeline.outcomes import Acknowledge, Disposition, Requeue, TimeLimited, Unrun
from celery_fence.store.records import DeadUnrun

if TYPE_CHECKING:
    from celery_fence.pipeline.execution import Execution

logger = logging.getLogger("celery_fence")


def settle_exit(execution: Execution, outcome: TimeLimited | Unrun) -> Disposition:
    """Make the store write an exit of the worker's main process needs (``execution`` names
    the job: it claimed nothing) and return the action for the message; never raises."""
    try:
        if isinstance(outcome, TimeLimited):
            return _time_limited(execution, outcome)
        return _unrun(execution, outcome)
    except Exception as exc:
        return unrecorded(execution, execution.claim, exc, what=type(outcome).__name__.lower())


def _time_limited(execution: Execution, outcome: TimeLimited) -> Disposition:
    """The pool killed the attempt at its hard time limit: record it (history only) and give the
    message back; the next delivery claims once the killed attempt's lease runs out."""
    key = execution.key
    reason = f"hard time limit {outcome.timeout}s"
    try:
        execution.store.record(key, action=Action.TIME_LIMIT, reason=reason)
    except Exception as exc:  # history only: the message goes back all the same
        logger.warning(
            "fence could not record the hard time limit key=%s: %s",
            key,
            type(exc).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": key, "reason": "time limit"},
        )
    execution.announcer(
        Action.TIME_LIMIT,
        key=key,
        reason=f"{reason}, task={execution.task_name}: the message goes back to the broker",
    )
    return Requeue(reason)


def _unrun(execution: Execution, outcome: Unrun) -> Disposition:
    """A message Celery acks without running it, or whose running attempt was terminated: the
    job is settled first (:class:`~celery_fence.store.records.DeadUnrun`); a store that cannot say
    gives the message back."""
    key, task_name, why = execution.key, execution.task_name, outcome.why
    try:
        ending = DeadUnrun(
            task_name,
            outcome.request,
            why,
            only_insert=outcome.shared_key,
            terminated_id=outcome.message_id if outcome.terminated else None,
            message_id=outcome.message_id,
        )
        execution.store.end(key, ending)
    except Exception as exc:
        logger.error(
            "fence could not settle the %s task=%s id=%s: %s; the message goes back",
            why,
            task_name,
            outcome.message_id,
            type(exc).__name__,
            extra={"action": LogAction.STORE_ERROR, "fence_key": key, "reason": why},
        )
        return Requeue(f"{why}: store unavailable")
    execution.announcer(
        Action(why),
        key=key,
        reason=f"task={task_name} id={outcome.message_id} "
        + ("terminated" if outcome.terminated else "not run")
        + "; the job is recorded",
    )
    return Acknowledge()


__all__ = ["settle_exit"]
