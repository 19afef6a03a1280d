"""What a fenced task does with its message in Celery's terms (:class:`FencedResending`, a base of
:class:`~celery_fence.adapters.task.FencedTask`): a settled disposition carried out (return,
raise, give the message back, re-send it with the same task id), the body's own ``retry()``
(the lease given back before its publish, the broker's refusal turned into a requeue), and
``update_state`` as Celery's bookkeeping."""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Reject, Retry

from celery_fence.actions import LogAction
from celery_fence.adapters.request import message_publish_options
from celery_fence.adapters.sending import RELEASE_BEFORE_SEND, RESENDS_HEADER
from celery_fence.body import watch
from celery_fence.errors import Rescheduled, RetryNotSent
from celery_fence.ops.outbox import registered_outbox, trigger_delivery
from celery_fence.pipeline import outcomes as o
from celery_fence.store.records import ENQUEUED_HEADER

logger = logging.getLogger("celery_fence")

#: Bounds (seconds) of the pause before a message whose re-send the broker refused goes back to
#: the broker: the re-send's countdown, at least the first, at most the second.
REFUSED_RESEND_PAUSE = (1.0, 10.0)

#: Request slot: the exception the body's ``retry()`` raised because ``max_retries`` is reached.
RETRIES_EXCEEDED = "fence_retries_exceeded"


class FencedResending(Task):
    """The message side of a fenced task: a base of
    :class:`~celery_fence.adapters.task.FencedTask`, never used alone."""

    def _resends(self) -> int:
        """How many times the fence itself re-sent this message
        (:data:`~celery_fence.adapters.sending.RESENDS_HEADER`)."""
        count = self.request.get(RESENDS_HEADER)
        return count if isinstance(count, int) and count > 0 else 0

    def _carry_out(self, disposition: o.Disposition) -> Any:
        """A settled disposition in Celery's terms, for the body's side (Celery then acks late);
        the exits the worker drives are applied by
        :meth:`~celery_fence.adapters.worker.FencedRequest._apply`."""
        if isinstance(disposition, o.Return):
            replay_only = disposition.replay and registered_outbox(self.app) is None
            if disposition.deliver is not None and not replay_only:
                trigger_delivery(self.app, disposition.deliver)
            return disposition.result
        if isinstance(disposition, (o.Fail, o.Reraise)):
            raise disposition.error
        if isinstance(disposition, o.Requeue):
            raise Reject(disposition.reason, requeue=True)
        if isinstance(disposition, o.Acknowledge):
            return None
        return self._resend(disposition)

    def _resend(self, disposition: o.Resend) -> Any:
        """Re-send this message (same task id) after the countdown; never drop it. ``expires``
        is not carried over: a message the fence re-sends must arrive.

        The fence's own re-send does not count as a Celery retry: the message keeps its
        ``retries`` (so the task's ``max_retries`` counts the body's own ``self.retry()`` and
        ``autoretry_for`` only, as in plain Celery; no ``MaxRetriesExceededError`` and no
        ``FAILURE: Rescheduled`` for a busy lease) and counts its fence re-sends in the
        :data:`~celery_fence.adapters.sending.RESENDS_HEADER` header instead (a re-send is no
        first delivery; store outages back off on it)."""
        request = self.request
        if request.called_directly or request.is_eager:
            # In the caller's thread there is no message to re-send: the caller gets the error
            # (an eager retry would run again at once, inline and nested, until the recursion
            # limit while another attempt holds the lease)
            raise disposition.error
        countdown = max(0.0, disposition.countdown)
        logger.info(
            "fence re-send task=%s id=%s in %.2fs: %s",
            self.name,
            request.id,
            countdown,
            disposition.reason,
            extra={"action": LogAction.RESCHEDULE, "reason": disposition.reason},
        )
        headers = {
            name: value
            for name, value in dict(request.headers or {}).items()
            if name not in ("x-death", ENQUEUED_HEADER)  # a re-send is not the first delivery
        }
        headers[RESENDS_HEADER] = self._resends() + 1
        signature = self.signature_from_request(
            request,
            countdown=countdown,
            retries=request.retries or 0,
            headers=headers,
            # the message's serializer and compression (Celery's signature keeps neither), then
            # the options of this task's re-sends
            **{**message_publish_options(request), **self._resend_options()},
        )
        error = Rescheduled(disposition.reason)
        retry = Retry(exc=error, when=countdown, is_eager=request.is_eager, sig=signature)
        if not request.is_eager:  # eagerly, Celery's apply() runs the signature itself
            try:
                signature.apply_async()
            except Exception as exc:  # the broker refused it: the message goes back (requeue)
                self._publish_refused(exc, countdown)
        raise retry from None

    def _resend_options(self) -> dict[str, Any]:
        """Options of the fence's own re-send: ``expires`` is not carried over."""
        return {"expires": None}

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Celery's ``update_state``: the result backend's write is Celery's bookkeeping, never
        the task's (with the database result backend, inside a fenced block too:
        :func:`celery_fence.body.watch.bookkeeping`)."""
        with watch.bookkeeping():
            super().update_state(*args, **kwargs)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, with four differences for a fenced attempt:

        - The retry message is published with the message's serializer, compression and
          delivery mode (:func:`~celery_fence.adapters.request.message_publish_options`), as the
          fence's own re-send is; options given to ``retry`` win.
        - The attempt gives its lease back (token-compared) right before the retry message is
          published, so an immediate retry (``countdown=0``, ``autoretry_for``) runs at once
          instead of meeting this attempt's lease and waiting a whole lease TTL.
        - When ``max_retries`` is reached, the exception Celery's ``retry`` raises
          (``MaxRetriesExceededError``, or the ``exc`` given) ends the job ``dead`` and reaches
          the caller as in plain Celery: the fence's retry policy does not retry it again.
        - When the broker refuses the retry message, Celery would reject the original message
          for good (``Reject(requeue=False)``, the message dropped); here it goes back to the
          broker instead (:class:`RetryNotSent`, a requeue), and the settle step records the job
          ``retrying``, so the next delivery runs it. The message goes back after a pause (the
          retry's countdown within :data:`REFUSED_RESEND_PAUSE`): a broker that refuses every
          publish must not make the worker redeliver, claim and re-send in a tight loop."""
        request = self.request
        throw = kwargs.get("throw", args[3] if len(args) > 3 else True)
        fenced = request.get("fence") is not None
        setattr(request, RELEASE_BEFORE_SEND, bool(fenced and throw and not request.is_eager))
        if not request.called_directly and not request.is_eager:
            # the message's serializer and compression, as the fence's own re-send keeps them
            # (Celery's signature keeps neither); options the body passes win
            kwargs = {**message_publish_options(request), **kwargs}
        try:
            return super().retry(*args, **kwargs)
        except (Retry, RetryNotSent):
            raise
        except Reject as rejected:
            if rejected.requeue:
                raise
            # Celery turns a failed publish of the retry message into Reject(requeue=False).
            countdown = kwargs.get("countdown")
            if countdown is None:
                countdown = (
                    REFUSED_RESEND_PAUSE[1] if kwargs.get("eta") else self.default_retry_delay
                )
            self._publish_refused(rejected.reason, countdown)
        except Exception as exc:  # max_retries reached: Celery's final exception for this job
            if fenced and not request.called_directly:
                setattr(request, RETRIES_EXCEEDED, exc)
            raise
        finally:
            setattr(request, RELEASE_BEFORE_SEND, False)

    def _publish_refused(self, reason: Any, countdown: Any) -> NoReturn:
        """The broker refused a retry or re-send message: the original message goes back to the
        broker after a pause (:class:`RetryNotSent`), never dropped."""
        low, high = REFUSED_RESEND_PAUSE
        pause = min(max(float(countdown or 0.0), low), high)
        logger.error(
            "fence could not publish the retry of task=%s id=%s (%s); the original message "
            "goes back to the broker in %.1fs",
            self.name,
            self.request.id,
            type(reason).__name__,
            pause,
            extra={"action": LogAction.REQUEUE, "reason": "retry publish failed"},
        )
        time.sleep(pause)  # the message stays unacked meanwhile; the lease is renewed
        raise RetryNotSent(reason) from None
