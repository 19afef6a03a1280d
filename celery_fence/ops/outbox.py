"""External effects: staged by a task body, written with its fenced completion, then delivered.

Three objects, one name each:

- ``self.fence.effects`` (:class:`~celery_fence.body.effects.StagedEffects`, one per attempt): what
  the body stages;
- ``store.outbox_rows`` (:class:`~celery_fence.store.OutboxRows`): the rows of the
  ``fence_outbox`` table, written by the fenced completion;
- :class:`Outbox` (this module, one per app): the delivery side, handlers and the tasks that
  deliver the rows.

Staging (:mod:`celery_fence.body.effects`). ``self.fence.effects.add("email", {"to": ...})`` stages
an effect; nothing is written until the completion commits, and then in the same
statement/transaction, so a stale attempt's effects are never recorded and a completed job's are
recorded exactly once. Each row's idempotency key is derived from the logical key and the
effect's name — the same across every retry and redelivery.

Delivery. ``outbox = Outbox(app)`` registers two tasks on the app, :data:`DELIVER_TASK` (sent
right after a completion that committed effects) and :data:`SWEEP_TASK` (put it in beat: it
delivers rows left behind). Handlers are registered per effect name::

    @outbox.handler("email")          # also handles "email:alice", "email:bob", ...
    def send_email(payload, *, idempotency_key):
        provider.send(**payload, headers={"Idempotency-Key": idempotency_key})

A sender claims a row for ``claim_ttl`` seconds (PostgreSQL ``FOR UPDATE SKIP LOCKED``; SQLite a
conditional ``UPDATE`` under ``BEGIN IMMEDIATE``), calls the handler, and marks the row delivered
— conditionally on its own claim. A failure is classified as a task's error is
(``fence_permanent_exceptions`` go ``dead`` at once) and retried with a capped exponential backoff
of its own (:mod:`celery_fence.ops.outbox_backoff`), for hours by default ("equal jitter":
each wait is at least the one before until the cap, and senders of one outage spread out),
until ``fence_outbox_max_attempts`` deliveries failed; then it is ``dead``. Two senders never
hold the same row at once, as long as a handler returns within ``claim_ttl``.

At least once, not exactly once: a sender that crashes (or times out) after the provider accepted
the effect and before the row is marked delivered leaves the row to be claimed again, and the
effect is delivered a second time **with the same idempotency key**. The recipient must dedupe on
that key (most payment and email APIs accept an ``Idempotency-Key`` header for this).

Logs name the key, the effect, the row id and the error type — never payloads.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import current_task

from celery_fence import metrics
from celery_fence.actions import LogAction
from celery_fence.announce import tracing
from celery_fence.app_state import AppSlot
from celery_fence.body.effects import StagedEffects, idempotency_key, storage_key
from celery_fence.config import FenceConfig
from celery_fence.errors import FenceError
from celery_fence.ops.outbox_backoff import retry_delay
from celery_fence.pipeline.backends import store_for
from celery_fence.pipeline.retry import give_up
from celery_fence.store import OutboxRow, Store

logger = logging.getLogger("celery_fence.outbox")

#: The sender task, sent with ``key=`` after a completion that committed effects.
DELIVER_TASK = "celery_fence.outbox.deliver"
#: The periodic sweep: ``beat_schedule = {"fence-outbox": {"task": SWEEP_TASK, "schedule": 30}}``.
SWEEP_TASK = "celery_fence.outbox.sweep"
#: Seconds a sender holds a claimed row; a handler must return well within it.
DEFAULT_CLAIM_TTL = 60.0
#: Rows one run of the sender or the sweep delivers at most (the next run takes the rest).
DEFAULT_BATCH = 100

#: Seconds: a failed effect due again within this is re-sent for by the deliver task itself;
#: one due later is delivered by the sweep (:data:`SWEEP_TASK` in beat).
RETRIGGER_MAX = 300.0

#: ``fn(payload, *, idempotency_key=...)``; its return value is ignored, raising means "failed".
Handler = Callable[..., Any]


# -- delivery ------------------------------------------------------------------------------------


class NoHandler(FenceError):
    """No outbox handler is registered for this effect name."""


@dataclass
class DeliveryReport:
    """What one run of the sender did. ``retry_in``: seconds until a row that failed is due."""

    delivered: int = 0
    failed: int = 0
    dead: int = 0
    lost_claims: int = 0  # the claim expired before the row was marked: it may be sent again
    retry_in: float | None = None


def _count(effect: str, outcome: str) -> None:
    observer = metrics.active
    if observer is not None:
        observer.outbox(effect, outcome)


class Outbox:
    """The delivery side of the outbox, one per Celery app: handlers, the deliver and sweep tasks.

    Create it where the app is defined (workers must import it): ``outbox = Outbox(app)``.
    Keyword-only options: ``claim_ttl`` (seconds a claimed row is held, default
    :data:`DEFAULT_CLAIM_TTL`), ``batch`` (rows per run), ``queue`` (for the deliver task;
    default: the app's routing), ``max_attempts`` (default ``fence_outbox_max_attempts``).
    """

    def __init__(
        self,
        app: Any,
        *,
        claim_ttl: float = DEFAULT_CLAIM_TTL,
        batch: int = DEFAULT_BATCH,
        queue: str | None = None,
        max_attempts: int | None = None,
    ) -> None:
        if claim_ttl <= 0:
            raise FenceError(f"Outbox(claim_ttl={claim_ttl}) must be a positive number of seconds")
        if batch < 1:
            raise FenceError(f"Outbox(batch={batch}) must be at least 1")
        if max_attempts is not None and max_attempts < 1:
            raise FenceError(f"Outbox(max_attempts={max_attempts}) must be at least 1")
        existing = registered_outbox(app)
        self.app = app
        self.claim_ttl = float(claim_ttl)
        self.batch = batch
        self.queue = queue
        self._max_attempts = max_attempts
        self.handlers: dict[str, Handler] = dict(existing.handlers) if existing else {}
        _APP_OUTBOX.set(app, self)
        self._register_tasks()

    # -- handlers --------------------------------------------------------------------------------

    def handler(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: ``@outbox.handler("email")`` handles effects ``email`` and ``email:<any>``."""

        def decorate(fn: Handler) -> Handler:
            self.register(name, fn)
            return fn

        return decorate

    def register(self, name: str, fn: Handler) -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise FenceError(
                f"outbox handler name {name!r} must be a non-empty str without ':' (a handler "
                "for 'email' also handles 'email:alice')"
            )
        if not callable(fn):
            raise FenceError(f"outbox handler for {name!r} is not callable")
        self.handlers[name] = fn

    def handler_for(self, name: str) -> Handler | None:
        """The handler of effect ``name``: the one registered for its part before any ':'."""
        return self.handlers.get(name.split(":", 1)[0])

    # -- settings --------------------------------------------------------------------------------

    @property
    def config(self) -> FenceConfig:
        return FenceConfig.from_app(self.app)

    @property
    def store(self) -> Store:
        return store_for(self.config)

    @property
    def max_attempts(self) -> int:
        return self._max_attempts or self.config.outbox_max_attempts

    # -- sending ---------------------------------------------------------------------------------

    def trigger(self, key: str | None = None, *, countdown: float | None = None) -> None:
        """Ask a worker to deliver ``key``'s due rows now (or after ``countdown`` seconds)."""
        if self.app.conf.task_always_eager and not countdown:
            self.deliver(key=key)
            return
        options: dict[str, Any] = {}
        if self.queue:
            options["queue"] = self.queue
        if countdown:
            options["countdown"] = countdown
        headers: dict[str, Any] = {}
        tracing.inject(headers)  # the delivery continues the completing attempt's trace
        if headers:
            options["headers"] = headers
        self.app.send_task(DELIVER_TASK, kwargs={"key": key}, **options)

    def sweep(self) -> DeliveryReport:
        """Deliver every due row, whatever its key (rows left behind by a crash or a lost send)."""
        return self.deliver(key=None)

    def deliver(self, *, key: str | None = None, limit: int | None = None) -> DeliveryReport:
        """Claim and deliver due rows (of ``key``, or all) one at a time, up to ``limit``.

        One pass in id order: a row that fails is not tried again in the same run (``retry_in``
        says when it is due; the deliver task re-sends itself for it, the sweep also finds it).
        """
        store = self.store
        report = DeliveryReport()
        for row in store.outbox_rows.dead_exhausted(max_attempts=self.max_attempts, key=key):
            report.dead += 1  # its handler never returned (a killed or hung sender)
            _count(row.name, "dead")
            logger.error(
                "outbox dead key=%s effect=%s id=%s after %s claims that never finished",
                row.key,
                row.name,
                row.id,
                row.attempts,
                extra=_extra(row, LogAction.OUTBOX_DEAD, reason="claims exhausted"),
            )
        cursor = 0
        for _ in range(limit or self.batch):
            claimer = _claim_token()
            rows = store.outbox_rows.claim(
                claimer=claimer, claim_ttl=self.claim_ttl, key=key, after_id=cursor
            )
            if not rows:
                break
            cursor = rows[0].id
            self._deliver_one(store, rows[0], claimer, report)
        return report

    def _deliver_one(
        self, store: Store, row: OutboxRow, claimer: str, report: DeliveryReport
    ) -> None:
        started = time.monotonic()
        try:
            fn = self.handler_for(row.name)
            if fn is None:
                raise NoHandler(
                    f"no outbox handler for effect {row.name!r}: register one with "
                    f"@outbox.handler({row.name.split(':', 1)[0]!r}) where the app is defined"
                )
            with tracing.delivery(row.name, row.key, row.id, _current_request()):
                fn(row.payload, idempotency_key=row.idempotency_key)
        except Exception as exc:
            self._failed(store, row, claimer, exc, report)
            return
        elapsed = time.monotonic() - started
        if store.outbox_rows.mark_delivered(row.id, claimer=claimer):
            report.delivered += 1
            _count(row.name, "delivered")
            logger.info(
                "outbox delivered key=%s effect=%s id=%s attempt=%s",
                row.key,
                row.name,
                row.id,
                row.attempts,
                extra=_extra(row, LogAction.OUTBOX_DELIVERED),
            )
            return
        report.lost_claims += 1
        logger.warning(
            "outbox claim expired during delivery key=%s effect=%s id=%s (%.1fs, claim_ttl=%.1fs):"
            " it will be delivered again with the same idempotency key",
            row.key,
            row.name,
            row.id,
            elapsed,
            self.claim_ttl,
            extra=_extra(row, LogAction.OUTBOX_CLAIM_LOST),
        )

    def _failed(
        self,
        store: Store,
        row: OutboxRow,
        claimer: str,
        exc: Exception,
        report: DeliveryReport,
    ) -> None:
        config = self.config
        _, dead = give_up(
            exc,
            config,
            attempts=row.attempts,
            max_attempts=self.max_attempts,
            retry_unknown=config.retry_unknown_errors or isinstance(exc, NoHandler),
        )
        retry_in = None
        if dead is None:
            retry_in = retry_delay(row.attempts, config)
            report.retry_in = (
                retry_in if report.retry_in is None else min(report.retry_in, retry_in)
            )
        if not store.outbox_rows.fail(row.id, claimer=claimer, error=exc, retry_in=retry_in):
            report.lost_claims += 1
            return
        if dead is not None:
            report.dead += 1
            _count(row.name, "dead")
            logger.error(
                "outbox dead key=%s effect=%s id=%s after %s attempts: %s",
                row.key,
                row.name,
                row.id,
                row.attempts,
                type(exc).__name__,
                extra=_extra(row, LogAction.OUTBOX_DEAD, reason=type(exc).__name__),
            )
        else:
            report.failed += 1
            _count(row.name, "failed")
            logger.warning(
                "outbox retry key=%s effect=%s id=%s attempt=%s: %s",
                row.key,
                row.name,
                row.id,
                row.attempts,
                type(exc).__name__,
                extra=_extra(row, LogAction.OUTBOX_RETRY, reason=type(exc).__name__),
            )

    # -- the Celery tasks ------------------------------------------------------------------------

    def _register_tasks(self) -> None:
        app = self.app

        @app.task(name=DELIVER_TASK, ignore_result=True, shared=False, lazy=False)
        def deliver(key: str | None = None) -> None:
            outbox = outbox_for(app)
            report = outbox.deliver(key=key)
            # A failed row due soon: come back for it. A later one is the sweep's (an
            # hours-long countdown would sit in a worker's memory, and past the Redis
            # broker's visibility timeout it is delivered twice).
            retry_in = report.retry_in
            if key is not None and retry_in is not None and retry_in <= RETRIGGER_MAX:
                outbox.trigger(key, countdown=max(0.05, retry_in))

        @app.task(name=SWEEP_TASK, ignore_result=True, shared=False, lazy=False)
        def sweep() -> None:
            outbox_for(app).sweep()


#: The app's :class:`Outbox` (its handler registry), kept on the app once one is made.
_APP_OUTBOX: AppSlot[Outbox] = AppSlot("outbox")


def registered_outbox(app: Any) -> Outbox | None:
    """The app's :class:`Outbox`, None when none was made."""
    return _APP_OUTBOX.get(app)


def outbox_for(app: Any) -> Outbox:
    """The app's :class:`Outbox` (created with default options when there is none yet)."""
    return registered_outbox(app) or Outbox(app)


def register_handler(app: Any, name: str, fn: Handler) -> None:
    """``register_handler(app, "email", send_email)``: the same as ``@Outbox(app).handler(...)``."""
    outbox_for(app).register(name, fn)


def sweep(app: Any) -> DeliveryReport:
    """Deliver every due outbox row of ``app`` now (for a cron job or a management command)."""
    return outbox_for(app).sweep()


def trigger_delivery(app: Any, key: str) -> None:
    """Called after a completion committed effects: send the deliver task. Never raises."""
    outbox = registered_outbox(app)
    if outbox is None:
        logger.warning(
            "outbox rows committed for key=%s but the app has no Outbox: create "
            "celery_fence.ops.outbox.Outbox(app) where the app is defined; the rows stay pending",
            key,
            extra={"action": LogAction.OUTBOX_NO_SENDER, "fence_key": key},
        )
        return
    try:
        outbox.trigger(key)
    except Exception as exc:  # the job is complete; the sweep delivers what this could not send
        logger.warning(
            "could not trigger outbox delivery key=%s: %s; the sweep will deliver it",
            key,
            type(exc).__name__,
            extra={"action": LogAction.OUTBOX_TRIGGER_FAILED, "fence_key": key},
        )


def _current_request() -> Any:
    """The Celery request of the deliver task running in this thread (None: none): its
    ``traceparent`` names the trace its deliveries continue."""
    task = current_task._get_current_object() if current_task else None
    return None if task is None else task.request


def _claim_token() -> str:
    return f"{socket.gethostname()[:30]}:{os.getpid()}:{uuid.uuid4().hex[:16]}"


def _extra(row: OutboxRow, action: LogAction, reason: str | None = None) -> dict[str, Any]:
    return {
        "action": action,
        "fence_key": row.key,
        "effect": row.name,
        "outbox_id": row.id,
        "attempts": row.attempts,
        "reason": reason,
    }


__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_CLAIM_TTL",
    "DELIVER_TASK",
    "SWEEP_TASK",
    "DeliveryReport",
    "NoHandler",
    "Outbox",
    "StagedEffects",
    "idempotency_key",
    "outbox_for",
    "register_handler",
    "registered_outbox",
    "storage_key",
    "sweep",
    "trigger_delivery",
]
