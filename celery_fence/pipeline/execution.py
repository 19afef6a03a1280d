"""One :class:`Execution` per attempt of a fenced task: claim -> register -> body -> settle.

The execution owns the attempt from its first step to the disposition Celery is given, in one
direction: it claims a generation (Redis, one script call), registers it (SQL, one statement),
runs the body with ``self.fence`` bound to it, and settles
whatever happened through :func:`celery_fence.pipeline.settle.settle`, which writes the one fenced
store state the outcome needs and returns one :data:`~celery_fence.pipeline.outcomes.Disposition`.
It never calls Celery: :class:`~celery_fence.adapters.task.FencedTask` (the body's side) and
:class:`~celery_fence.adapters.worker.FencedRequest` (the exits Celery drives in the worker: the
hard time limit, an expired or revoked message) build one and carry out the disposition it returns.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy import exc as sa_exc

from celery_fence import metrics
from celery_fence.actions import Action, LogAction
from celery_fence.announce import tracing
from celery_fence.announce.transitions import Announcer, lease_observers
from celery_fence.body import sqla, watch
from celery_fence.body.fence import Fence
from celery_fence.body.transaction import watch_django
from celery_fence.config import FenceConfig
from celery_fence.errors import (
    ConfigurationError,
    FenceError,
    LeaseBusy,
    LeaseLost,
    StaleGeneration,
)
from celery_fence.leases.lease import HeldLease, LeaseStore
from celery_fence.leases.limits import Limits, Slot
from celery_fence.leases.renewer import Renewer
from celery_fence.pipeline import outcomes as o
from celery_fence.pipeline.ports import JobStore, LeaseBackend
from celery_fence.pipeline.retry import RetryPolicy
from celery_fence.pipeline.settle import settle
from celery_fence.process.background import BackgroundWriter
from celery_fence.process.runtime import runtime
from celery_fence.schema import RUNNING
from celery_fence.store import Store
from celery_fence.store.engine import refusal_reason
from celery_fence.store.records import JobRecord

logger = logging.getLogger("celery_fence")

#: How many times a claim is retried after the store showed Redis had lost its counter.
CLAIM_ROUNDS = 3

#: Seconds a message over its group's limit waits at most before it looks again (less when the
#: soonest slot expires sooner); a slot usually frees long before its lease would expire.
GROUP_POLL = 1.0

#: The re-send reasons of a message over a limit (the ``retry_scheduled`` row's reason).
GROUP_FULL, RATE_LIMITED = "group_full", "rate_limited"


class Execution:
    """One execution of one logical job, as far as it got: the claim fills in ``generation`` and
    ``lease``, the registration ``attempts`` (executions counted by the store, this one
    included)."""

    #: The class of ``self.fence`` (the chaos harness's ``--unfenced-steps`` arm replaces it).
    fence_class: type[Fence] = Fence
    #: Whether the body used fenced steps or a checkpoint: its completion then clears them.
    steps_used = False

    def __init__(
        self,
        *,
        task_name: str,
        config: FenceConfig,
        store: JobStore,
        leases: LeaseBackend,
        renewer: Renewer,
        policy: RetryPolicy,
        announcer: Announcer,
        retries: int = 0,
        celery_command: str = "celery -A <app>",
        attempt_id: str | None = None,
        trace: tracing.AttemptTrace | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.task_name = task_name
        self.config = config
        self.store = store
        self.leases = leases
        self.renewer = renewer
        self.policy = policy
        self.announcer = announcer
        #: Celery's re-send count of this message: backs off before a registration.
        self.retries = retries
        #: ``celery -A <app>`` as the operator types it, for the hints of the errors a job ends
        #: with.
        self.celery_command = celery_command
        self.attempt_id = attempt_id or uuid.uuid4().hex
        #: The attempt's span (:mod:`celery_fence.announce.tracing`); None: tracing is off.
        self.trace = trace
        self.key = ""
        self.generation: int | None = None
        self.attempts = 0
        self.lease: HeldLease | None = None
        self.registered = False
        self.request_json: str | None = None
        #: The lease was given back before the attempt ended (:meth:`release_before_retry`).
        self.released = False
        #: The body's write outside every fenced block was announced (once per attempt).
        self.unfenced_reported = False
        #: The operator's re-run this message belongs to (its ``fence_run`` header; 0: the key's
        #: first run): its outbox effects get idempotency keys of their own.
        self.run_number = 0
        #: A recovery's takeover of this job (the message's ``fence_takeover`` header): the
        #: generation taken over and when its row last moved (epoch seconds); None otherwise.
        self.takeover: tuple[int, float] | None = None
        #: How the attempt runs in the caller's thread, with no message behind it (``"direct
        #: call"``, ``"eager run"``), else empty: the settle step never leaves its row for a
        #: re-send (:mod:`celery_fence.pipeline.settle`).
        self.in_caller = ""
        #: An eager run (``.apply()``, ``task_always_eager``): Celery runs a ``self.retry()``
        #: inline.
        self.eager = False
        #: The cluster-wide limits' scripts (None: the task has no group limit or rate limit).
        self.limits = limits
        #: This message's concurrency group (``fence_group``), or None.
        self.group: str | None = None
        #: The group slot this attempt holds, renewed with its lease.
        self.slot: HeldLease | None = None
        #: Wall-clock time the message was published (or its ETA, when later): the metrics'
        #: queue wait runs from it to the claim. None: unknown.
        self.published_at: float | None = None
        #: ``time.monotonic()`` of the claim that got a lease (the metrics' attempt duration).
        self.claimed_at: float | None = None

    # -- the path ----------------------------------------------------------------------------------

    def run(
        self,
        key: str,
        body: Callable[[Fence], Any],
        *,
        request_json: Callable[[], str | None],
        max_runtime: float | None,
    ) -> o.Disposition:
        """Claim, register, run ``body(fence)`` and settle: the disposition for Celery. Every
        exit of the path, an exception or not, is settled; the lease is given back whatever
        happens."""
        self.key = key
        try:
            try:
                outcome = self._execute(body, request_json, max_runtime)
            except Exception as exc:  # anything raised in the fenced path settles too
                outcome = o.Unexpected(exc)
            except BaseException as exc:  # SystemExit, CancelledError, gevent's Timeout, ...
                outcome = o.Interrupted(exc)
            return self.settle(outcome)
        finally:  # whatever ends the attempt, even an exit raised in the settle step itself
            if self.lease is not None and not self.released:
                self.renewer.discard(self.lease)  # compare-and-delete, batched by the renewer
            if self.slot is not None:
                self.renewer.discard(self.slot)  # the group's slot, the same way
            observer = metrics.active
            if observer is not None and self.claimed_at is not None:
                observer.attempt(self.task_name, time.monotonic() - self.claimed_at)

    def settle(self, outcome: o.Outcome) -> o.Disposition:
        """The one step every ending passes through: see :mod:`celery_fence.pipeline.settle`."""
        return settle(self, outcome)

    def run_unkeyed(
        self, error: ConfigurationError, message_id: str | None, request: Mapping[str, Any] | None
    ) -> o.Disposition:
        """``fence_key`` failed for this message: the job is recorded ``dead`` under
        ``unkeyed:<task>:<message id>`` so nothing is lost silently."""
        self.key = f"unkeyed:{self.task_name}:{message_id}"
        return self.settle(o.Unkeyed(error, message_id, request))

    def settle_time_limit(self, key: str, timeout: float | None) -> o.Disposition:
        """The pool killed this message's attempt at its hard time limit: record it; the message
        goes back to the broker (the next delivery claims once the killed lease runs out)."""
        self.key = key
        return self.settle(o.TimeLimited(timeout))

    def settle_unrun(
        self,
        key: str,
        *,
        why: str,
        message_id: str | None,
        request: Mapping[str, Any] | None,
        terminated: bool,
    ) -> o.Disposition:
        """Celery acks this message without running it (``why``: expired or revoked), or after
        ``revoke(terminate=True)`` killed its attempt: the job is settled first."""
        self.key = key
        shared_key = key != message_id
        return self.settle(o.Unrun(why, message_id, request, terminated, shared_key=shared_key))

    def announce(self, action: Action, reason: str | None = None, **extra: Any) -> None:
        """Log, signal and (with events on) queue the Celery event of one transition."""
        self.announcer(
            action,
            key=self.key,
            attempt_id=self.attempt_id,
            generation=self.generation,
            reason=reason,
            **extra,
        )

    def _execute(
        self,
        body: Callable[[Fence], Any],
        request_json: Callable[[], str | None],
        max_runtime: float | None,
    ) -> o.Outcome:
        """Claim -> register -> body, as far as it gets: the outcome, never an exit."""
        self.policy.budget.record_call(self.task_name)
        if self.trace is None:
            stop = self._claim_and_register(request_json, max_runtime)
        else:
            claim = {"fence.key": self.key, "fence.attempt": self.attempt_id}
            with tracing.child("fence claim", claim) as span:
                stop = self._claim_and_register(request_json, max_runtime)
                if span is not None and self.generation is not None:
                    span.set_attribute("fence.generation", self.generation)
        if stop is not None:
            return stop
        assert self.lease is not None and self.generation is not None
        fence = self.fence_class(
            key=self.key,
            attempt_id=self.attempt_id,
            generation=self.generation,
            attempts=self.attempts,
            lease=self.lease,
            # the fenced blocks run SQL on the store's database: a store double has none
            store=self.store if isinstance(self.store, Store) else None,
            execution=self,
            run=self.run_number,
            idempotency_namespace=self.config.idempotency_namespace,
        )
        sqla.install()  # once per process: every SQLAlchemy write of the body is seen
        watch_django()  # and, with Django configured, every Django ORM write
        try:
            with watch.running(fence):  # its writes on any connection are attributed to it
                result = body(fence)
        except (Retry, Ignore, Reject) as exc:
            return o.Control(exc)
        except LeaseLost as exc:
            return o.Lost(exc)
        except StaleGeneration as exc:
            return o.Stale(exc)
        except o.Final as final:
            return o.Failed(final.error, final=final.reason)
        except Exception as exc:
            return o.Failed(exc)
        return o.Completed(result, fence.effects.staged)

    def _claim_and_register(
        self,
        request_json: Callable[[], str | None],
        max_runtime: float | None,
    ) -> o.Outcome | None:
        """Claim a generation and register it; None when the body may run, else the outcome."""
        config, leases, renewer = self.config, self.leases, self.renewer
        on_lost, on_renewed = lease_observers(self.announcer, self.store)
        limited = self._take_limits(max_runtime)
        if limited is not None:
            return limited
        request: str | None = None
        with_slot = self._slot_rides_claim()  # the group's slot taken in the first claim's trip
        for _ in range(CLAIM_ROUNDS):
            claimed_at = time.monotonic()
            releases = renewer.take_releases()
            try:
                if with_slot:
                    with_slot = False
                    claimed = self._claim_in_group(releases, claimed_at, max_runtime)
                    if isinstance(claimed, o.Limited):
                        return claimed
                    self.generation = claimed
                else:
                    self.generation = leases.claim(
                        self.key, self.attempt_id, config.lease_ttl_ms, releases=releases
                    )
            except LeaseBusy as busy:
                return o.Busy(busy.remaining)
            except BaseException as exc:  # Redis unreachable or refusing: re-send, never drop
                # The claim may have run with its reply lost (a timeout, a dropped connection,
                # an exit raised while it waited): release this attempt's lease by its token,
                # whatever its generation, so the next delivery does not find it busy for a
                # whole TTL; the other attempts' releases it carried go back to the queue.
                lost_claim = (leases.keys_for(self.key).lease, f"{self.attempt_id}:")
                renewer.return_releases([*releases, lost_claim])
                if not isinstance(exc, Exception):
                    raise
                return o.Unavailable(exc, f"lease store unavailable ({type(exc).__name__})")
            self.lease = HeldLease(
                key=self.key,
                lease_key=leases.keys_for(self.key).lease,
                token=self.attempt_id,
                generation=self.generation,
                ttl=config.lease_ttl,
                interval=config.renew_interval,
                margin=config.lease_margin,
                claimed_at=claimed_at,
                max_runtime=max_runtime,
                on_lost=on_lost,
                on_renewed=on_renewed,
            )
            renewer.add(self.lease)
            self.claimed_at = claimed_at
            self.announce(Action.CLAIMED)
            observer = metrics.active
            if observer is not None and self.published_at is not None:
                observer.waited(self.task_name, time.time() - self.published_at)
            if request is None:
                request = request_json() or ""
            self.request_json = request or None
            # With metrics on, a repeat claim reads the row first: a takeover is a registration
            # over a row a previous generation left running.
            previous = self._previous() if observer is not None and self.generation > 1 else None
            try:
                outcome = self._register()
            except sa_exc.DataError as exc:  # the database refuses the request: every time
                return self.refused_registration(exc)
            except sa_exc.ProgrammingError as exc:  # e.g. the tables do not exist
                reason = refusal_reason(exc, "registration")
                return o.Unavailable(exc, reason, max(5.0, config.retry_backoff_max / 10))
            except Exception as exc:  # nothing was registered: re-send, never drop
                return o.Unavailable(exc, f"store unavailable ({type(exc).__name__})")
            if outcome is None:
                self.registered = True
                if previous is not None and observer is not None:
                    self._count_takeover(previous, observer)
                return o.Exhausted() if self.attempts > config.max_attempts else None
            if not isinstance(outcome, o.Stale):
                return outcome
            # Redis handed out a generation the store already saw (its counter was lost): raise
            # the counter above the store's and claim again. The store stays the authority.
            stored = outcome.error.context.get("stored_generation")
            stored = stored if isinstance(stored, int) else 0
            renewer.discard(self.lease, release=False)
            lease, self.lease = self.lease, None
            leases.release(lease.lease_key, lease.value)  # now, so the re-claim does not meet it
            logger.warning(
                "fence generation regressed key=%s generation=%s stored=%s; raising the counter",
                self.key,
                self.generation,
                stored,
                extra={
                    "action": LogAction.REGRESSED,
                    "fence_key": self.key,
                    "attempt_id": self.attempt_id,
                    "generation": self.generation,
                    "reason": "redis counter behind the store",
                },
            )
            leases.raise_generation(self.key, stored)
        return o.Unavailable(
            FenceError(f"could not claim a generation above the store's for {self.key!r}"),
            "generation regressed on every claim round",
        )

    def _take_limits(self, max_runtime: float | None) -> o.Outcome | None:
        """Before the claim: a slot of the group (``fence_group_limit``), then a token of the
        rate limit (``fence_rate_limit``; the group's bucket when a group is set). None when the
        attempt may claim, else the outcome (over a limit, or Redis unavailable). The slot is a
        lease renewed with the key's; losing it loses the key's lease too."""
        config, limits = self.config, self.limits
        if limits is None:
            return None
        group, limit, rate = self.group, config.group_limit, config.rate
        try:
            if group is not None and limit is not None and not self._slot_rides_claim():
                claimed_at = time.monotonic()
                # the process's queued releases ride in this round trip, as in the key's claim
                releases = self.renewer.take_releases() if limits.carries_releases else []
                try:
                    taken = limits.claim_slot(
                        group,
                        limit,
                        f"{self.attempt_id}/slot",
                        config.lease_ttl_ms,
                        releases=releases,
                    )
                except BaseException:
                    self.renewer.return_releases(releases)
                    raise
                if not isinstance(taken, Slot):
                    detail = f"all {limit} slots of group {group!r} are taken"
                    return o.Limited(GROUP_FULL, min(taken, GROUP_POLL), detail)
                self._hold_slot(taken, claimed_at, max_runtime)
            if rate is not None:
                bucket = f"group:{group}" if group is not None else f"task:{self.task_name}"
                wait = limits.take_token(bucket, rate)
                if wait > 0:
                    detail = f"{rate.text} reached for {bucket!r}"
                    return o.Limited(RATE_LIMITED, wait, detail)
        except Exception as exc:  # Redis unreachable or refusing: re-send, never drop
            return o.Unavailable(exc, f"lease store unavailable ({type(exc).__name__})")
        return None

    def _slot_rides_claim(self) -> bool:
        """Whether the group's slot is taken in the key's claim, one round trip
        (:meth:`Limits.claim_in_group`): a group limit and no rate limit (whose token is taken
        between the two), on one Redis (not a Cluster), the leases' own client."""
        limits, leases, config = self.limits, self.leases, self.config
        return (
            limits is not None
            and self.group is not None
            and config.group_limit is not None
            and config.rate is None
            and limits.carries_releases
            and isinstance(leases, LeaseStore)
            and leases.client is limits.client
        )

    def _claim_in_group(
        self,
        releases: list[tuple[str, str]],
        claimed_at: float,
        max_runtime: float | None,
    ) -> int | o.Limited:
        """Claim the key and a slot of its group in one round trip: the new generation (the
        slot held and renewed), or group_full; raises :class:`LeaseBusy` when the key's lease
        is live (no slot was taken)."""
        limits, config = self.limits, self.config
        assert limits is not None and self.group is not None and config.group_limit is not None
        assert isinstance(self.leases, LeaseStore)
        keys = self.leases.keys_for(self.key)
        limit = config.group_limit
        answer = limits.claim_in_group(
            keys.lease,
            keys.generation,
            self.group,
            limit,
            self.attempt_id,
            config.lease_ttl_ms,
            self.leases.generation_ttl_ms,
            releases=releases,
        )
        if answer.status == "busy":
            raise LeaseBusy(
                f"lease for {self.key!r} is held by another attempt", remaining=answer.wait
            )
        if answer.status == "full" or answer.slot is None:
            detail = f"all {limit} slots of group {self.group!r} are taken"
            return o.Limited(GROUP_FULL, min(answer.wait, GROUP_POLL), detail)
        self._hold_slot(answer.slot, claimed_at, max_runtime)
        return answer.generation

    def _hold_slot(self, taken: Slot, claimed_at: float, max_runtime: float | None) -> None:
        """Keep the group slot ``taken``: renewed with the lease, released when the attempt
        ends (its release rides in a later claim or renewal)."""
        config = self.config
        self.slot = HeldLease(
            key=self.key,
            lease_key=taken.lease_key,
            token=taken.token,
            generation=taken.index,
            ttl=config.lease_ttl,
            interval=config.renew_interval,
            margin=config.lease_margin,
            claimed_at=claimed_at,
            max_runtime=max_runtime,
            on_lost=self._slot_lost,
        )
        self.renewer.add(self.slot)

    def _slot_lost(self, slot: HeldLease, reason: str) -> None:
        """The group slot expired or was taken over: the attempt may no longer count as one of
        the group's running ones, so its lease is lost too (``fence.check()`` raises)."""
        if self.lease is not None:
            self.lease.mark_lost(f"group slot lost: {reason}")

    def _previous(self) -> JobRecord | None:
        """The job's row before this claim registers (metrics only; None when unreadable)."""
        try:
            return self.store.get(self.key)
        except Exception:  # the registration will say what is wrong
            return None

    def _count_takeover(self, previous: JobRecord, observer: metrics.Metrics) -> None:
        """Count a takeover when ``previous`` (the row this claim registered over) was left
        ``running`` by an older generation of another attempt: with the seconds since that
        row last moved (its registration, or its last fenced commit)."""
        if previous.status != RUNNING or previous.attempt_id == self.attempt_id:
            return
        if not 0 < previous.generation < (self.generation or 0):
            return
        moved = previous.updated_at
        if moved.tzinfo is None:
            moved = moved.replace(tzinfo=dt.timezone.utc)
        seconds = (dt.datetime.now(dt.timezone.utc) - moved).total_seconds()
        observer.took_over(self.task_name, seconds)

    def refused_registration(self, error: sa_exc.DataError) -> o.Outcome:
        """The database refused the registration's request: it would every time."""
        return o.Refused(error, self.request_json)

    def unfenced_write(self, *, where: str, table: str | None, refused: bool) -> None:
        """The body committed (or, ``refused``, tried to commit) a write no fenced block covers
        (:func:`celery_fence.body.watch.unfenced_write`): announced (INFO line, the
        ``unfenced_write`` signal) and recorded as a transition row, once per attempt. The row is
        written off this thread: the write's own transaction may hold the database's write lock
        (SQLite) until it commits."""
        if self.unfenced_reported:
            return
        self.unfenced_reported = True
        reason = f"{'refused' if refused else 'committed'} on {where}"
        if table:
            reason += f", table {table}"
        self.announce(Action.UNFENCED_WRITE, reason=reason, where=where, table=table)
        store, key, generation, attempt = self.store, self.key, self.generation, self.attempt_id
        record = functools.partial(
            store.record,
            key,
            action=Action.UNFENCED_WRITE,
            generation=generation,
            attempt_id=attempt,
            reason=reason,
        )
        runtime().get("writer", None, BackgroundWriter).submit(record)

    def committing(self, where: str) -> contextlib.AbstractContextManager[Any]:
        """Around a fenced block's commit (``where``: ``sqlalchemy`` for ``fence.transaction()``
        and ``session()``, ``django:<alias>`` for ``fence.atomic()``): its ``fence commit`` span
        under the attempt's, with tracing on."""
        if self.trace is None:
            return contextlib.nullcontext()
        return tracing.child(
            "fence commit",
            {
                "fence.key": self.key,
                "fence.generation": self.generation,
                "fence.attempt": self.attempt_id,
                "fence.block": where,
            },
        )

    # -- registration ------------------------------------------------------------------------------

    def _announce_takeover(self) -> None:
        """``job_taken_over``, when this registration took over a generation recovery found
        stranded: the seconds from that attempt's last move to now."""
        if self.takeover is None or self.generation is None:
            return
        previous, moved = self.takeover
        if not previous < self.generation:
            return
        seconds = max(0.0, time.time() - moved)
        self.announce(
            Action.TAKEN_OVER,
            f"generation {previous} taken over after {seconds:.1f}s",
            previous_generation=previous,
            seconds=seconds,
        )

    def _register(self) -> o.Outcome | None:
        """Register this claim: None when it registered, else the outcome the store's state
        calls for (replayed, already dead, or stale: a newer generation got there first)."""
        assert self.generation is not None
        registration = self.store.register(
            self.key,
            generation=self.generation,
            attempt_id=self.attempt_id,
            task_name=self.task_name,
            request_json=self.request_json,
        )
        self.attempts = registration.attempts
        if registration.outcome == "registered":
            # The row's stored request says which re-run this is, also when the message does
            # not (the key's first message redelivered late, after a requeue --completed).
            self.run_number = max(self.run_number, registration.run)
            self._announce_takeover()
            return None
        if registration.outcome == "completed":
            assert registration.record is not None
            return o.Replayed(registration.record)
        if registration.outcome == "dead":
            return o.AlreadyDead(registration.record)
        return o.Stale(
            StaleGeneration(
                f"generation {self.generation} of {self.key!r} was superseded before it registered",
                stored_generation=registration.stored_generation,
                where="registration",
            )
        )

    def release_before_retry(self) -> bool:
        """The body's own retry is about to be sent (``self.retry()``, ``autoretry_for``): give
        the lease back now, compared on its token, so the retry does not find this attempt's
        lease busy and wait a whole TTL. True when
        the lease was given back; False leaves it to the end of the attempt (the store's
        fencing, not the lease, decides whose writes count either way)."""
        lease = self.lease
        if lease is None or self.released:
            return False
        self.renewer.discard(lease, release=False)
        self.released = True
        try:
            self.leases.release(lease.lease_key, lease.value)
        except Exception:  # Redis unreachable: the renewer's thread sends it (or the TTL ends it)
            self.renewer.return_releases([(lease.lease_key, lease.value)])
        return True


__all__ = ["CLAIM_ROUNDS", "GROUP_FULL", "GROUP_POLL", "RATE_LIMITED", "Execution"]
