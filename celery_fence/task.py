"""FencedTask: the orchestration of one fenced execution, and nothing else.

claim (Redis, one round trip) -> register (SQL, one statement) -> body -> complete (SQL, one
statement) -> release (batched off the critical path by the renewer) -> Celery acks (late).
Every failure path ends in a fenced state change before the message is acked: completed, retry
scheduled (the retry message published first), dead — or, when a newer generation owns the key,
nothing, because the newer attempt is responsible for it.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

from celery import Task
from celery.app.task import _task_stack
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import worker_process_shutdown
from sqlalchemy import exc as sa_exc

from . import signals
from .config import FenceConfig
from .errors import (
    ConfigurationError,
    FenceError,
    JobDead,
    LeaseBusy,
    LeaseLost,
    ResultNotSerializable,
    StaleGeneration,
)
from .events import send_transition_event
from .fence import Fence
from .lease import LeaseStore, make_redis_client
from .redis_client import client_identity
from .renewer import RENEWER_THREAD_NAME, HeldLease, Renewer, renewer_for
from .renewer import shutdown as shutdown_renewers
from .retry import DEFAULT_TRANSIENT, RetryBudget, RetryPolicy, backoff
from .schema import KEY_LENGTH
from .store import Registration, Store, store_for

logger = logging.getLogger("celery_fence")

#: How many times a claim is retried after the store showed Redis had lost its counter.
CLAIM_ROUNDS = 3

_lease_stores: dict[tuple[Any, ...], LeaseStore] = {}


def lease_store_for(config: FenceConfig) -> LeaseStore:
    ident = (client_identity(config), config.key_prefix)
    store = _lease_stores.get(ident)
    if store is None:
        store = _lease_stores[ident] = LeaseStore(
            make_redis_client(config), prefix=config.key_prefix
        )
    return store


def _json_or_none(value: Any) -> str | None:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


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
    fence_key: Callable[..., str] | None = None
    lease_ttl: float | None = None
    renew_interval: float | None = None
    max_attempts: int | None = None

    _fence_cache: tuple[FenceConfig, Store, LeaseStore, RetryPolicy] | None = None

    # -- configuration ---------------------------------------------------------------------------

    def fence_config(self) -> FenceConfig:
        return self._fence_backends()[0]

    def _fence_backends(self) -> tuple[FenceConfig, Store, LeaseStore, RetryPolicy]:
        cache = self.__dict__.get("_fence_cache")
        if cache is None:
            config = FenceConfig.from_app(self.app)
            overrides: dict[str, Any] = {}
            for name in ("lease_ttl", "renew_interval", "max_attempts"):
                value = getattr(self, name, None)
                if value is not None:
                    overrides[name] = value
            for name in dir(type(self)):
                if name.startswith("fence_") and name not in ("fence_key", "fence_config"):
                    short = name[len("fence_") :]
                    if short in config.__dataclass_fields__:
                        overrides[short] = getattr(self, name)
            if overrides:
                try:
                    config = FenceConfig.from_mapping({}, **{**_as_settings(config), **overrides})
                except ConfigurationError as exc:
                    raise ConfigurationError(f"task {self.name}: {exc}") from None
            leases = lease_store_for(config)
            budget = RetryBudget(config, redis_client=leases.client)  # shares the lease pool
            cache = (config, store_for(config), leases, RetryPolicy(config, budget=budget))
            self.__dict__["_fence_cache"] = cache
        return cache

    def _raw_fence_key(self) -> Callable[..., Any] | None:
        for klass in type(self).__mro__:
            if "fence_key" in klass.__dict__:
                raw = klass.__dict__["fence_key"]
                return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        return None

    def _logical_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        fn = self._raw_fence_key()
        if fn is None:
            key = self.request.id
            if not key:
                raise FenceError(
                    f"task {self.name} was called directly without a fence_key: call it with "
                    ".delay()/.apply_async(), or give the task a fence_key=lambda ...: '...'"
                )
            return str(key)
        try:
            key = fn(*args, **kwargs)
        except Exception as exc:
            raise ConfigurationError(
                f"fence_key of task {self.name} raised {type(exc).__name__}: {exc}; it is called "
                "with the task's own args and kwargs and must return a str"
            ) from exc
        if not isinstance(key, str) or not key or len(key) > KEY_LENGTH:
            raise ConfigurationError(
                f"fence_key of task {self.name} returned a {type(key).__name__} "
                f"({len(key) if isinstance(key, str) else '-'} chars); it must return a non-empty "
                f"str of at most {KEY_LENGTH} characters, e.g. f'report:{{report_id}}'"
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

    def _emit(
        self,
        signal: Any,
        fence_key: str,
        attempt_id: str | None,
        generation: int | None,
        reason: str | None = None,
        *,
        origin: tuple[str | None, str | None] | None = None,
        **extra: Any,
    ) -> None:
        """Log, signal and (with ``-E``) send a Celery event for one transition; never raises.

        ``origin`` is the (Celery task id, worker hostname) of the attempt, captured at claim
        time for the renewal thread, which has no Celery request of its own.
        """
        signals.emit(
            signal,
            self,
            key=fence_key,
            attempt_id=attempt_id,
            generation=generation,
            reason=reason,
            **extra,
        )
        config = self._fence_backends()[0]
        if config.send_events:
            task_id, hostname = origin or (self.request.id, self.request.hostname)
            send_transition_event(
                self,
                signals.ACTIONS[signal][0],
                task_id=task_id,
                hostname=hostname,
                fence_key=fence_key,
                attempt_id=attempt_id,
                generation=generation,
                reason=reason,
                **extra,
            )

    def _request_info(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The request as stored for a requeue (task, args, kwargs, routing), or None if it is
        not JSON."""
        text = self._request_json(args, kwargs)
        return None if text is None else dict(json.loads(text))

    def _request_json(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        delivery = self.request.delivery_info or {}
        return _json_or_none(
            {
                "task": self.name,
                "args": list(args),
                "kwargs": kwargs,
                "options": {
                    "queue": delivery.get("routing_key") or None,
                    "exchange": delivery.get("exchange") or None,
                    "priority": delivery.get("priority"),
                },
            }
        )

    def _run_fenced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        config, store, leases, policy = self._fence_backends()
        try:
            key = self._logical_key(args, kwargs)
        except ConfigurationError as exc:
            return self._bury_unkeyed(store, exc, args, kwargs)
        attempt_id = uuid.uuid4().hex
        renewer = renewer_for(leases)
        policy.budget.record_call(self.name)

        lease, registration = self._claim_and_register(
            key, attempt_id, config, store, leases, renewer, args, kwargs
        )
        try:
            return self._execute(
                key, attempt_id, lease, registration, config, store, policy, args, kwargs
            )
        finally:
            renewer.discard(lease)  # compare-and-delete, batched by the renewer thread

    def _bury_unkeyed(
        self, store: Store, exc: ConfigurationError, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A message whose logical key cannot be computed is kept as a dead job, not lost."""
        if self.request.called_directly:
            raise exc
        key = f"unkeyed:{self.name}:{self.request.id}"
        try:
            store.bury(
                key,
                task_name=self.name,
                request=self._request_info(args, kwargs),
                error=exc,
                reason="fence_key failed",
            )
        except Exception as db_exc:
            if isinstance(db_exc, DEFAULT_TRANSIENT):
                self._reschedule(
                    db_exc, countdown=backoff(1 + self.request.retries, self._fence_backends()[0])
                )
            raise
        self._emit(signals.job_dead, key, None, None, reason="fence_key failed", attempts=0)
        raise exc

    def _claim_and_register(
        self,
        key: str,
        attempt_id: str,
        config: FenceConfig,
        store: Store,
        leases: LeaseStore,
        renewer: Renewer,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[HeldLease, Registration]:
        request_json: str | None = None
        origin = (self.request.id, self.request.hostname)  # for events sent by the renewer thread
        for _ in range(CLAIM_ROUNDS):
            claimed_at = time.monotonic()
            releases = renewer.take_releases()
            try:
                generation = leases.claim(key, attempt_id, config.lease_ttl_ms, releases=releases)
            except LeaseBusy as busy:
                self._emit(
                    signals.lease_busy,
                    key,
                    attempt_id,
                    None,
                    reason=f"held for {busy.remaining:.3f}s more",
                    remaining=busy.remaining,
                )
                jitter = random.uniform(0, max(0.05, config.renew_interval / 4))
                self._reschedule(busy, countdown=busy.remaining + jitter)
            except Exception as exc:  # Redis unreachable or refusing: re-send, never drop
                # The claim may have run with its reply lost (a timeout, a dropped connection):
                # release this attempt's lease by its token, whatever its generation, so the
                # re-sent message does not find it busy for a whole TTL.
                lost_claim = (leases.keys_for(key).lease, f"{attempt_id}:")
                renewer.return_releases([*releases, lost_claim])
                if not isinstance(exc, DEFAULT_TRANSIENT):
                    logger.error(
                        "fence claim failed key=%s: %s; the message is re-sent with backoff",
                        key,
                        type(exc).__name__,
                        extra={"action": "claim_error", "fence_key": key, "reason": str(exc)},
                    )
                self._retry_unrecorded(
                    exc,
                    key,
                    attempt_id,
                    None,
                    countdown=backoff(1 + self.request.retries, config),
                    reason=f"lease store unavailable ({type(exc).__name__})",
                )
            lease = HeldLease(
                key=key,
                lease_key=leases.keys_for(key).lease,
                token=attempt_id,
                generation=generation,
                ttl=config.lease_ttl,
                interval=config.renew_interval,
                margin=config.lease_margin,
                claimed_at=claimed_at,
                on_lost=functools.partial(self._on_lease_lost, origin=origin),
                on_renewed=functools.partial(self._on_lease_renewed, origin=origin),
            )
            renewer.add(lease)
            self._emit(signals.lease_claimed, key, attempt_id, generation)
            if request_json is None:
                request_json = self._request_json(args, kwargs) or ""
            try:
                registration = store.register(
                    key,
                    generation=generation,
                    attempt_id=attempt_id,
                    task_name=self.name,
                    request_json=request_json or None,
                )
            except Exception as exc:  # nothing was registered: re-send, never drop
                renewer.discard(lease)
                if isinstance(exc, sa_exc.ProgrammingError):  # e.g. the tables do not exist
                    logger.error(
                        "fence store refused registration (%s); is the schema created? run: "
                        "celery -A <app> fence init-db. The message is re-sent, not dropped.",
                        str(exc.orig),
                        extra={"action": "store_error", "fence_key": key},
                    )
                    self._reschedule(exc, countdown=max(5.0, config.retry_backoff_max / 10))
                if not isinstance(exc, DEFAULT_TRANSIENT):
                    logger.error(
                        "fence registration failed key=%s: %s; the message is re-sent with backoff",
                        key,
                        type(exc).__name__,
                        extra={"action": "store_error", "fence_key": key},
                    )
                self._retry_unrecorded(
                    exc,
                    key,
                    attempt_id,
                    generation,
                    countdown=backoff(1 + self.request.retries, config),
                    reason=f"store unavailable ({type(exc).__name__})",
                )
            if registration.outcome != "stale":
                return lease, registration
            # Redis handed out a generation the store already saw (its counter was lost):
            # raise the counter above the store's and claim again. The store stays the authority.
            renewer.discard(lease, release=False)
            leases.release(lease.lease_key, lease.value)  # now, so the re-claim does not meet it
            logger.warning(
                "fence generation regressed key=%s generation=%s stored=%s; raising the counter",
                key,
                generation,
                registration.stored_generation,
                extra={
                    "action": "regressed",
                    "fence_key": key,
                    "attempt_id": attempt_id,
                    "generation": generation,
                    "reason": "redis counter behind the store",
                },
            )
            leases.raise_generation(key, registration.stored_generation)
        raise FenceError(f"could not claim a generation above the store's for {key!r}")

    def _reschedule(self, exc: BaseException, *, countdown: float, reason: str = "") -> NoReturn:
        """Re-send this message (same task id) after ``countdown`` seconds; never drop it."""
        if self.request.called_directly:
            raise exc
        if reason:
            logger.warning(
                "fence reschedule task=%s id=%s in %.2fs: %s",
                self.name,
                self.request.id,
                countdown,
                reason,
                extra={"action": "reschedule", "reason": reason},
            )
        try:
            raise self.retry(exc=exc, countdown=max(0.0, countdown), max_retries=None)
        except Reject as rejected:
            # Celery turns a failed publish of the retry message into Reject(requeue=False),
            # which would drop the message: give it back to the broker instead.
            logger.error(
                "fence could not re-send task=%s id=%s (%s); requeueing the original message",
                self.name,
                self.request.id,
                type(rejected.reason).__name__,
                extra={"action": "requeue", "reason": "retry publish failed"},
            )
            raise Reject(rejected.reason, requeue=True) from None

    def _retry_unrecorded(
        self,
        exc: BaseException,
        key: str,
        attempt_id: str,
        generation: int | None,
        *,
        countdown: float,
        reason: str,
    ) -> NoReturn:
        """Re-send the message (a retry the store could not record: it says why) and signal it."""
        if not self.request.called_directly:  # a direct call raises instead of re-sending
            self._emit(
                signals.job_retry_scheduled,
                key,
                attempt_id,
                generation,
                reason=reason,
                countdown=countdown,
                attempts=None,
            )
        self._reschedule(exc, countdown=countdown, reason=reason)

    def _on_lease_lost(
        self, lease: HeldLease, reason: str, *, origin: tuple[str | None, str | None] | None = None
    ) -> None:
        self._emit(
            signals.lease_lost,
            lease.key,
            lease.token,
            lease.generation,
            reason=reason,
            origin=origin,
        )
        if threading.current_thread().name != RENEWER_THREAD_NAME:
            self._record_lost(lease, reason)  # the task noticed: record before it goes on
            return
        # The renewal thread noticed: write the history row off that thread, so a slow database
        # never delays the renewal of the process's other leases.
        threading.Thread(
            target=self._record_lost, args=(lease, reason), name="celery-fence-record", daemon=True
        ).start()

    def _record_lost(self, lease: HeldLease, reason: str) -> None:
        try:
            self._fence_backends()[1].record(
                lease.key,
                action="lost",
                generation=lease.generation,
                attempt_id=lease.token,
                reason=reason,
            )
        except Exception as exc:  # the loss is already in force locally; the record is history
            logger.warning(
                "could not record lease loss key=%s generation=%s: %s",
                lease.key,
                lease.generation,
                type(exc).__name__,
            )

    def _on_lease_renewed(
        self, lease: HeldLease, *, origin: tuple[str | None, str | None] | None = None
    ) -> None:
        self._emit(signals.lease_renewed, lease.key, lease.token, lease.generation, origin=origin)

    def _execute(
        self,
        key: str,
        attempt_id: str,
        lease: HeldLease,
        registration: Registration,
        config: FenceConfig,
        store: Store,
        policy: RetryPolicy,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        generation = lease.generation
        if registration.outcome == "completed":
            assert registration.record is not None
            self._emit(
                signals.job_replayed, key, attempt_id, generation, reason="already completed"
            )
            return registration.record.result
        if registration.outcome == "dead":
            record = registration.record
            raise JobDead(
                f"job {key!r} is dead ({record.error_type if record else 'unknown error'}); "
                f"requeue it with: celery -A <app> fence requeue {key}"
            )
        if registration.attempts > config.max_attempts:
            # The message kept coming back without finishing (a crash, a lost worker): stop.
            error = JobDead(
                f"{registration.attempts - 1} attempts ended without a result "
                f"(worker lost?); max_attempts={config.max_attempts}"
            )
            return self._dead(
                key,
                attempt_id,
                generation,
                store,
                error,
                reason="attempts exhausted",
                attempts=registration.attempts,
            )

        fence = Fence(
            key=key,
            attempt_id=attempt_id,
            generation=generation,
            attempts=registration.attempts,
            lease=lease,
            store=store,
        )
        self.request.fence = fence
        try:
            result = self.run(*args, **kwargs)
        except (Retry, Ignore, Reject):
            raise  # the body's own Celery control flow
        except LeaseLost as exc:
            return self._after_lost(fence, store, config, exc)
        except StaleGeneration as exc:  # a fenced commit (fence.transaction()) was refused
            return self._after_stale(key, attempt_id, generation, store, exc)
        except Exception as exc:
            return self._after_error(fence, store, policy, exc)
        finally:
            self.request.fence = None
        return self._complete(fence, store, config, result)

    def _complete(self, fence: Fence, store: Store, config: FenceConfig, result: Any) -> Any:
        key, attempt_id, generation = fence.key, fence.attempt_id, fence.generation
        try:
            store.complete(
                key,
                generation=generation,
                attempt_id=attempt_id,
                result=result,
                effects=fence.outbox.staged,
            )
        except StaleGeneration as exc:
            return self._after_stale(key, attempt_id, generation, store, exc)
        except ResultNotSerializable as exc:
            return self._dead(
                key,
                attempt_id,
                generation,
                store,
                exc,
                reason="result is not JSON",
                attempts=fence.attempts,
            )
        except sa_exc.DataError as exc:
            # The database refuses this value (e.g. PostgreSQL's jsonb refuses "\u0000"): the
            # same result would be refused on every retry, so the job goes dead at once. Only the
            # driver's first line is kept: its context lines can quote the value itself.
            first_line = (str(exc.orig).splitlines() or [""])[0]
            refused = ResultNotSerializable(
                f"the database refused the task's return value ({first_line}); return values "
                "it can store as JSON"
            )
            refused.__suppress_context__ = True  # the driver's error may quote the value
            return self._dead(
                key,
                attempt_id,
                generation,
                store,
                refused,
                reason="result refused by the database",
                attempts=fence.attempts,
            )
        except Exception as exc:
            # The result is not known to be stored, so the message is not acked as done: it is
            # re-sent, and the next attempt converges (on the stored result if this commit did
            # land before the connection broke). The attempt count bounds a repeat.
            transient = isinstance(exc, DEFAULT_TRANSIENT)
            if not transient:
                logger.error(
                    "fence completion failed key=%s generation=%s: %s; the message is re-sent",
                    key,
                    generation,
                    type(exc).__name__,
                    extra={"action": "store_error", "fence_key": key, "generation": generation},
                )
            what = "store unavailable at completion" if transient else "completion failed"
            self._retry_unrecorded(
                exc,
                key,
                attempt_id,
                generation,
                countdown=backoff(fence.attempts, config),
                reason=f"{what} ({type(exc).__name__})",
            )
        self._emit(signals.job_completed, key, attempt_id, generation)
        if fence.outbox.staged:
            self._after_commit_effects(fence)
        return result

    def _after_commit_effects(self, fence: Fence) -> None:
        """The completion committed outbox rows: send the outbox's deliver task (never raises;
        rows it could not announce are delivered by the sweep)."""
        from .outbox import trigger_delivery

        trigger_delivery(self.app, fence.key)

    def _after_stale(
        self, key: str, attempt_id: str, generation: int, store: Store, exc: StaleGeneration
    ) -> Any:
        """This attempt lost to a newer generation: record it, then converge on its result."""
        self._emit(
            signals.stale_rejected,
            key,
            attempt_id,
            generation,
            reason=f"stored generation {exc.context.get('stored_generation')}",
        )
        try:
            store.record(
                key,
                action="stale",
                generation=generation,
                attempt_id=attempt_id,
                reason=f"stored generation {exc.context.get('stored_generation')}",
            )
        except Exception:
            logger.exception("could not record the stale rejection for key=%s", key)
        try:
            record = store.get(key)
        except Exception:  # cannot tell whether it completed: come back later and look again
            record = None
        if record is not None and record.status == "completed":
            return record.result  # every caller of this task id converges on the one result
        # The newer generation is still working: come back later and converge on its result
        # (or take over, if it dies). Never drop the message.
        config = self._fence_backends()[0]
        countdown = config.lease_ttl + random.uniform(0, config.renew_interval)
        self._emit(
            signals.job_retry_scheduled,
            key,
            attempt_id,
            generation,
            reason=f"newer generation {exc.context.get('stored_generation')} still running",
            countdown=countdown,
            attempts=None,
        )
        self._reschedule(exc, countdown=countdown)

    def _after_lost(self, fence: Fence, store: Store, config: FenceConfig, exc: LeaseLost) -> Any:
        """The body stopped on a lost lease. Unless a newer attempt owns the job, re-send it."""
        countdown = backoff(fence.attempts, config)
        try:
            store.schedule_retry(
                fence.key,
                generation=fence.generation,
                attempt_id=fence.attempt_id,
                error=exc,
                retry_at=_at(countdown),
                reason="lease lost",
            )
        except StaleGeneration as stale:
            return self._after_stale(fence.key, fence.attempt_id, fence.generation, store, stale)
        except Exception as db_exc:  # the store could not say: re-send, never drop
            self._retry_unrecorded(
                exc,
                fence.key,
                fence.attempt_id,
                fence.generation,
                countdown=countdown,
                reason=f"lease lost; store unavailable ({type(db_exc).__name__})",
            )
        self._emit(
            signals.job_retry_scheduled,
            fence.key,
            fence.attempt_id,
            fence.generation,
            reason="lease lost",
            countdown=countdown,
            attempts=fence.attempts,
        )
        self._reschedule(exc, countdown=countdown)

    def _after_error(self, fence: Fence, store: Store, policy: RetryPolicy, exc: Exception) -> Any:
        key, attempt_id, generation = fence.key, fence.attempt_id, fence.generation
        decision = policy.decide(exc, attempts=fence.attempts, task_name=self.name)
        if decision.action == "dead":
            return self._dead(
                key,
                attempt_id,
                generation,
                store,
                exc,
                reason=decision.reason,
                attempts=fence.attempts,
            )
        try:
            store.schedule_retry(
                key,
                generation=generation,
                attempt_id=attempt_id,
                error=exc,
                retry_at=_at(decision.countdown),
                reason=decision.reason,
            )
        except StaleGeneration as stale:
            return self._after_stale(fence.key, fence.attempt_id, fence.generation, store, stale)
        except Exception as db_exc:  # the store could not record it: re-send all the same
            logger.warning(
                "could not record the retry of key=%s generation=%s (%s); re-sending anyway",
                key,
                generation,
                type(db_exc).__name__,
                extra={"action": "retry", "fence_key": key, "generation": generation},
            )
            reason = f"{decision.reason}; not recorded ({type(db_exc).__name__})"
        else:
            reason = decision.reason
        self._emit(
            signals.job_retry_scheduled,
            key,
            attempt_id,
            generation,
            reason=reason,
            countdown=decision.countdown,
            attempts=fence.attempts,
        )
        self._reschedule(exc, countdown=decision.countdown)

    def _dead(
        self,
        key: str,
        attempt_id: str,
        generation: int,
        store: Store,
        error: BaseException,
        *,
        reason: str,
        attempts: int,
    ) -> Any:
        try:
            store.mark_dead(
                key, generation=generation, attempt_id=attempt_id, error=error, reason=reason
            )
        except StaleGeneration as stale:
            return self._after_stale(key, attempt_id, generation, store, stale)
        except Exception as exc:
            # Not acked until the store says ``dead``: re-send; the next delivery decides again.
            self._retry_unrecorded(
                exc,
                key,
                attempt_id,
                generation,
                countdown=backoff(attempts, self._fence_backends()[0]),
                reason=f"dead state not recorded ({type(exc).__name__})",
            )
        self._emit(signals.job_dead, key, attempt_id, generation, reason=reason, attempts=attempts)
        raise error  # Celery records FAILURE and, with acks_late, acks after this durable write


@worker_process_shutdown.connect(weak=False)
def _release_on_shutdown(**_: Any) -> None:
    """A pool process (or a solo worker) that exits sends its queued releases first."""
    shutdown_renewers()


def _at(countdown: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=countdown)


def _as_settings(config: FenceConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def get_store(app: Any) -> Store:
    """The store an app's fenced tasks write to: ``get_store(app).get(key)``."""
    return store_for(FenceConfig.from_app(app))
