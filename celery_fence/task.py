"""FencedTask: the orchestration of one fenced execution, and nothing else.

claim (Redis, one round trip) -> register (SQL, one statement) -> body -> settle (one fenced
SQL statement: complete, retry, dead) -> release (batched off the critical path by the renewer)
-> Celery acks (late). Every way an execution can end is an outcome that
:func:`celery_fence.settle.settle` turns into a store state and one action; :meth:`_act` is the
only place that speaks Celery (return, fail, re-raise, re-send).
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from celery import Task
from celery.app.task import _task_stack
from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy import exc as sa_exc

from . import outcomes as o
from . import settle as s
from . import transitions
from .actions import Action
from .config import FenceConfig
from .deferred import register_deferred
from .errors import (
    ConfigurationError,
    FenceEagerWarning,
    FenceError,
    LeaseBusy,
    LeaseLost,
    Rescheduled,
    RetryNotSent,
    StaleGeneration,
)
from .fence import Fence
from .lease import HeldLease, LeaseStore
from .outbox import trigger_delivery
from .records import ENQUEUED_HEADER, request_text
from .runtime import Backends, app_state, runtime
from .schema import KEY_LENGTH
from .store.engine import refusal_reason
from .worker import FENCED_REQUEST, celery_command

logger = logging.getLogger("celery_fence")

#: How many times a claim is retried after the store showed Redis had lost its counter.
CLAIM_ROUNDS = 3

#: How JSON writes the NUL character, which PostgreSQL's jsonb refuses.
NUL_ESCAPE = "\\u0000"

#: Seconds before a message is re-sent when the settings are invalid (fix them and restart).
CONFIG_ERROR_COUNTDOWN = 30.0

#: Bounds (seconds) of the pause before a message whose re-send the broker refused goes back to
#: the broker: the re-send's countdown, at least the first, at most the second.
REFUSED_RESEND_PAUSE = (1.0, 10.0)


class FencedTask(Task):
    """Base class for fenced tasks: ``@app.task(base=FencedTask, bind=True, fence_key=...)``.

    Task options: ``fence_key`` (callable given the task's args and kwargs, returning the stable
    logical key; default: the Celery task id), ``lease_ttl``, ``renew_interval``,
    ``max_attempts`` and any ``fence_<setting>`` to override a setting for this task.
    """

    abstract = True
    acks_late = True
    reject_on_worker_lost = True
    max_retries = None  # the store counts attempts (fence_max_attempts); busy reschedules are free
    #: Handles the exits Celery drives in the worker's main process (hard time limit, expiry).
    Request = FENCED_REQUEST
    fence_key: Callable[..., str] | None = None
    lease_ttl: float | None = None
    renew_interval: float | None = None
    max_attempts: int | None = None

    # -- configuration ---------------------------------------------------------------------------

    def fence_config(self) -> FenceConfig:
        return self._fence_backends().config

    def _fence_backends(self) -> Backends:
        """This task's settings and this process's backends for them (made again after a fork)."""
        cache: Backends | None = self.__dict__.get("_fence_cache")
        if cache is None or cache.runtime.forked:
            cache = self.__dict__["_fence_cache"] = runtime().backends(FenceConfig.for_task(self))
        return cache

    def logical_key(self, args: Any, kwargs: Any, task_id: str | None) -> str:
        """The stable logical key of a call: ``fence_key(*args, **kwargs)`` or the task id."""
        fn = None
        for klass in type(self).__mro__:
            if "fence_key" in klass.__dict__:
                raw = klass.__dict__["fence_key"]
                fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
                break
        if fn is None:
            if not task_id:
                raise FenceError(
                    f"task {self.name} was called directly without a fence_key: call it with "
                    ".delay()/.apply_async(), or give the task a fence_key=lambda ...: '...'"
                )
            return str(task_id)
        try:
            key = fn(*(args or ()), **(kwargs or {}))
        except Exception as exc:
            raise ConfigurationError(
                f"fence_key of task {self.name} raised {type(exc).__name__}: {exc}; it is called "
                "with the task's own args and kwargs and must return a str"
            ) from exc
        if not isinstance(key, str) or not key or len(key) > KEY_LENGTH or "\x00" in key:
            raise ConfigurationError(
                f"fence_key of task {self.name} returned a {type(key).__name__} "
                f"({len(key) if isinstance(key, str) else '-'} chars); it must return a non-empty "
                f"str of at most {KEY_LENGTH} characters without NUL (\\x00), e.g. "
                "f'report:{report_id}'"
            )
        return key

    # -- the current attempt ---------------------------------------------------------------------

    @property
    def fence(self) -> Fence:
        fence = getattr(self.request, "fence", None)
        if fence is None:
            raise FenceError(f"self.fence is only available while fenced task {self.name} runs")
        return fence

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request.called_directly:  # a plain function call: set up what the tracer does
            _task_stack.push(self)
            self.push_request(args=args, kwargs=kwargs)
            try:
                return self._run_fenced(args, kwargs)
            finally:
                self.pop_request()
                _task_stack.pop()
        return self._run_fenced(args, kwargs)

    # -- orchestration ---------------------------------------------------------------------------

    def _run_fenced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.request.is_eager:
            warnings.warn(
                FenceEagerWarning(
                    f"fenced task {self.name} ran eagerly (task_always_eager or .apply()): no "
                    "worker, no redelivery — fencing is not exercised here. Test it with the "
                    "fenced_worker / fence_chaos fixtures of celery_fence.testing."
                ),
                stacklevel=3,
            )
        try:
            config, store, leases, policy, renewer, _ = self._fence_backends()
        except ConfigurationError as exc:  # checked at worker start; still, lose nothing
            logger.critical("fence settings invalid for task %s: %s", self.name, exc)
            if self.app.conf.get("fence_unsettled"):  # chaos demonstration: acked as a failure
                raise
            return self._act(o.Resend(CONFIG_ERROR_COUNTDOWN, "invalid fence settings", exc))
        attempt = o.Attempt(
            task_name=self.name,
            key="",
            attempt_id=uuid.uuid4().hex,
            store=store,
            config=config,
            policy=policy,
            emit=self._emit_for,
            retries=self.request.retries or 0,
            celery_command=celery_command(self.app),
        )
        try:
            try:
                outcome = self._execute(attempt, leases, args, kwargs)
            except Exception as exc:  # anything raised in the fenced path settles too
                outcome = o.Unexpected(exc)
            except BaseException as exc:  # SystemExit, CancelledError, gevent's Timeout, ...
                outcome = o.Interrupted(exc)
            action = s.settle(attempt, outcome)
        finally:  # whatever ends the attempt, even an exit raised in the settle step itself
            if attempt.lease is not None:
                renewer.discard(attempt.lease)  # compare-and-delete, batched by the renewer
        return self._act(action)

    def _execute(
        self, attempt: o.Attempt, leases: LeaseStore, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> o.Outcome:
        """Key -> claim -> register -> body, as far as it gets: the outcome, never an exit."""
        try:
            # A recovery or requeue re-sends with the job's key in a header: keep that key.
            override = None if self.request.called_directly else self.request.get("fence_key")
            if isinstance(override, str) and override:
                attempt.key = override
            else:
                attempt.key = self.logical_key(args, kwargs, self.request.id)
        except ConfigurationError as exc:
            if self.request.called_directly:
                raise
            attempt.key = f"unkeyed:{self.name}:{self.request.id}"
            request = self._stored_request(args, kwargs)
            return o.Unkeyed(exc, self.request.id, None if request is None else json.loads(request))
        attempt.policy.budget.record_call(self.name)
        stop = self._claim_and_register(attempt, leases, args, kwargs)
        if stop is not None:
            return stop
        assert attempt.lease is not None and attempt.generation is not None
        fence = Fence(
            key=attempt.key,
            attempt_id=attempt.attempt_id,
            generation=attempt.generation,
            attempts=attempt.attempts,
            lease=attempt.lease,
            store=attempt.store,
            before_block=functools.partial(register_deferred, attempt),
        )
        self.request.fence = fence
        try:
            result = self.run(*args, **kwargs)
        except (Retry, Ignore, Reject) as exc:
            return o.Control(exc)
        except LeaseLost as exc:
            return o.Lost(exc)
        except StaleGeneration as exc:
            return o.Stale(exc)
        except Exception as exc:
            return o.Failed(exc)
        finally:
            self.request.fence = None
        return o.Completed(result, fence.outbox.staged)

    def _claim_and_register(
        self, a: o.Attempt, leases: LeaseStore, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> o.Outcome | None:
        """Claim a generation and register it; None when the body may run, else the outcome."""
        config, renewer = a.config, self._fence_backends().renewer
        on_lost, on_renewed = transitions.lease_observers(
            self, (self.request.id, self.request.hostname)
        )
        request_json: str | None = None
        for _ in range(CLAIM_ROUNDS):
            claimed_at = time.monotonic()
            releases = renewer.take_releases()
            try:
                a.generation = leases.claim(
                    a.key, a.attempt_id, config.lease_ttl_ms, releases=releases
                )
            except LeaseBusy as busy:
                return o.Busy(busy.remaining)
            except BaseException as exc:  # Redis unreachable or refusing: re-send, never drop
                # The claim may have run with its reply lost (a timeout, a dropped connection,
                # an exit raised while it waited): release this attempt's lease by its token,
                # whatever its generation, so the next delivery does not find it busy for a
                # whole TTL; the other attempts' releases it carried go back to the queue.
                lost_claim = (leases.keys_for(a.key).lease, f"{a.attempt_id}:")
                renewer.return_releases([*releases, lost_claim])
                if not isinstance(exc, Exception):
                    raise
                return o.Unavailable(exc, f"lease store unavailable ({type(exc).__name__})")
            a.lease = HeldLease(
                key=a.key,
                lease_key=leases.keys_for(a.key).lease,
                token=a.attempt_id,
                generation=a.generation,
                ttl=config.lease_ttl,
                interval=config.renew_interval,
                margin=config.lease_margin,
                claimed_at=claimed_at,
                max_runtime=self._max_runtime(config),
                on_lost=on_lost,
                on_renewed=on_renewed,
            )
            renewer.add(a.lease)
            self._emit_for(Action.CLAIMED, a)
            if request_json is None:
                request_json = request_text(self.name, args, kwargs, self.request) or ""
            if (
                a.generation == 1
                and config.defer_first_registration
                and self._first_delivery()
                and NUL_ESCAPE not in request_json  # PostgreSQL refuses it: register to know
            ):
                # Nothing to fence out yet: the completion writes the row in one statement.
                a.deferred, a.registered, a.attempts = True, True, 1
                a.request_json = request_json or None
                return None
            try:
                registration = a.store.register(
                    a.key,
                    generation=a.generation,
                    attempt_id=a.attempt_id,
                    task_name=self.name,
                    request_json=request_json or None,
                )
            except sa_exc.DataError as exc:  # the database refuses the request: every time
                if config.unsettled:
                    return o.Unavailable(exc, "store refused registration")
                return o.Refused(exc, request_json or None)
            except sa_exc.ProgrammingError as exc:  # e.g. the tables do not exist
                reason = refusal_reason(exc, "registration")
                return o.Unavailable(exc, reason, max(5.0, config.retry_backoff_max / 10))
            except Exception as exc:  # nothing was registered: re-send, never drop
                return o.Unavailable(exc, f"store unavailable ({type(exc).__name__})")
            a.attempts = registration.attempts
            if registration.outcome == "registered":
                a.registered = True
                return o.Exhausted() if a.attempts > config.max_attempts else None
            if registration.outcome == "completed":
                assert registration.record is not None
                return o.Replayed(registration.record)
            if registration.outcome == "dead":
                return o.AlreadyDead(registration.record)
            # Redis handed out a generation the store already saw (its counter was lost): raise
            # the counter above the store's and claim again. The store stays the authority.
            renewer.discard(a.lease, release=False)
            lease, a.lease = a.lease, None
            leases.release(lease.lease_key, lease.value)  # now, so the re-claim does not meet it
            logger.warning(
                "fence generation regressed key=%s generation=%s stored=%s; raising the counter",
                a.key,
                a.generation,
                registration.stored_generation,
                extra={
                    "action": "regressed",
                    "fence_key": a.key,
                    "attempt_id": a.attempt_id,
                    "generation": a.generation,
                    "reason": "redis counter behind the store",
                },
            )
            leases.raise_generation(a.key, registration.stored_generation)
        return o.Unavailable(
            FenceError(f"could not claim a generation above the store's for {a.key!r}"),
            "generation regressed on every claim round",
        )

    def _first_delivery(self) -> bool:
        """This message's first delivery: not a re-send (Celery's ``retries``: the fence's own,
        the body's ``self.retry()``), not redelivered by the broker, not re-sent by recovery or
        requeue (a ``fence_key`` header without the ``fence_enqueued`` one: :func:`enqueue`'s own
        send is a first delivery). Only then may a first claim defer its registration: a repeat
        may find its job completed, which only a registration sees (Redis may have lost the
        counter). Brokers also flag a message given back unstarted (a consumer cancelled, a
        warm shutdown): it registers first too, one statement more."""
        request = self.request
        redelivered = (request.delivery_info or {}).get("redelivered")
        resent = request.get("fence_key") and not request.get(ENQUEUED_HEADER)
        return not (request.retries or redelivered or resent)

    def _stored_request(self, args: Any, kwargs: Any) -> str | None:
        """The request as the store keeps it for a requeue (JSON text; None if not JSON)."""
        return request_text(self.name, args, kwargs, self.request)

    def _max_runtime(self, config: FenceConfig) -> float | None:
        """``fence_max_runtime``, else the hard time limit of this message or task, else None."""
        if config.max_runtime is not None:
            return config.max_runtime
        limit = (self.request.timelimit or (None, None))[0]
        return limit or self.time_limit or self.app.conf.task_time_limit or None

    # -- Celery's side ---------------------------------------------------------------------------

    def _act(self, action: o.CeleryAction) -> Any:
        """The one adapter from a settled action to Celery's terms (Celery then acks late)."""
        if isinstance(action, o.Return):
            replay_only = action.replay and app_state(self.app).outbox is None
            if action.deliver is not None and not replay_only:
                trigger_delivery(self.app, action.deliver)
            return action.result
        if isinstance(action, (o.Fail, o.Reraise)):
            raise action.error
        return self._resend(action)

    def _resend(self, action: o.Resend) -> Any:
        """Re-send this message (same task id) after the countdown; never drop it. ``expires``
        is not carried over: a message the fence re-sends must arrive."""
        if self.request.called_directly:  # a direct call raises instead of re-sending
            raise action.error
        countdown = max(0.0, action.countdown)
        logger.info(
            "fence re-send task=%s id=%s in %.2fs: %s",
            self.name,
            self.request.id,
            countdown,
            action.reason,
            extra={"action": "reschedule", "reason": action.reason},
        )
        options = {} if self.fence_config().unsettled else {"expires": None}
        # A publish the broker refuses raises RetryNotSent: the message goes back (requeue).
        retry = self.retry(
            exc=Rescheduled(action.reason),
            countdown=countdown,
            max_retries=None,
            throw=False,
            **options,
        )
        raise retry from None

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, except when the broker refuses the retry message: Celery would
        reject the original message for good (``Reject(requeue=False)``, the message dropped);
        here it goes back to the broker instead (:class:`RetryNotSent`, a requeue), and the
        settle step records the job ``retrying``, so the next delivery runs it. The message
        goes back after a pause (the retry's countdown within :data:`REFUSED_RESEND_PAUSE`): a
        broker that refuses every publish must not make the worker redeliver, claim and re-send
        in a tight loop."""
        try:
            return super().retry(*args, **kwargs)
        except Reject as rejected:
            if rejected.requeue:
                raise
            # Celery turns a failed publish of the retry message into Reject(requeue=False).
            countdown = kwargs.get("countdown")
            if countdown is None:
                countdown = (
                    REFUSED_RESEND_PAUSE[1] if kwargs.get("eta") else self.default_retry_delay
                )
            low, high = REFUSED_RESEND_PAUSE
            pause = min(max(float(countdown or 0.0), low), high)
            logger.error(
                "fence could not publish the retry of task=%s id=%s (%s); the original message "
                "goes back to the broker in %.1fs",
                self.name,
                self.request.id,
                type(rejected.reason).__name__,
                pause,
                extra={"action": "requeue", "reason": "retry publish failed"},
            )
            time.sleep(pause)  # the message stays unacked meanwhile; the lease is renewed
            raise RetryNotSent(rejected.reason) from None

    # -- transitions -----------------------------------------------------------------------------

    def _emit_for(
        self, action: Action, attempt: o.Attempt, reason: str | None = None, **extra: Any
    ) -> None:
        transitions.emit_transition(
            action,
            self,
            key=attempt.key,
            attempt_id=attempt.attempt_id,
            generation=attempt.generation,
            reason=reason,
            origin=(self.request.id, self.request.hostname),
            **extra,
        )
