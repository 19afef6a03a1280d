"""One :class:`Execution` per attempt of a fenced task: claim -> register -> body -> settle.

Built with the message's key and what the message says, it claims a generation (Redis, one
script call) and registers it (SQL, one statement), each step giving a new frozen
:class:`~celery_fence.pipeline.claim.Claim`; runs the body with ``self.fence`` bound to it; and
settles what happened with ``settle(execution, claim, outcome)``
(:mod:`celery_fence.pipeline.settle`): one fenced store state, one
:data:`~celery_fence.pipeline.outcomes.Disposition`. It never calls Celery:
:class:`~celery_fence.adapters.task.FencedTask` carries out the disposition. The exits Celery
drives in the worker's main process (hard time limit, expiry, revoke) have no claim:
:func:`celery_fence.pipeline.exits.settle_exit` settles them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from sqlalchemy import exc as sa_exc

from celery_fence import metrics
from celery_fence.actions import Action
from celery_fence.announce import tracing
from celery_fence.announce.transitions import Announcer
from celery_fence.body import sqla, watch
from celery_fence.body.fence import Fence
from celery_fence.body.transaction import watch_django
from celery_fence.config import FenceConfig
from celery_fence.errors import FenceError, LeaseBusy, LeaseLost, StaleGeneration
from celery_fence.leases.lease import HeldLease
from celery_fence.leases.limits import Limits
from celery_fence.leases.ports import LeaseBackend
from celery_fence.leases.renewer import Renewer
from celery_fence.pipeline import outcomes
from celery_fence.pipeline.claim import (
    Claim,
    SlotClaim,
    announce_takeover,
    claim_in_group,
    count_takeover,
    regressed,
    slot_rides_claim,
    take_limits,
)
from celery_fence.pipeline.observers import lease_observers
from celery_fence.pipeline.outcomes import Disposition, Outcome
from celery_fence.pipeline.ports import JobStore
from celery_fence.pipeline.retry import RetryPolicy
from celery_fence.pipeline.settle import settle
from celery_fence.process.background import BackgroundWriter
from celery_fence.process.runtime import runtime
from celery_fence.store import Store
from celery_fence.store.driver_errors import refusal_reason

logger = logging.getLogger("celery_fence")

#: How many times a claim is retried after the store showed Redis had lost its counter.
CLAIM_ROUNDS = 3


class Execution:
    """One execution of one logical job (``key``), built with what the message says; ``claim``:
    what the claim and the registration decided, a frozen value each step replaces."""

    #: The class of ``self.fence`` (the chaos harness's ``--unfenced-steps`` arm replaces it).
    fence_class: type[Fence] = Fence
    #: Whether the body used fenced steps or a checkpoint: its completion then clears them.
    steps_used = False

    def __init__(
        self,
        key: str,
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
        group: str | None = None,
        run_number: int = 0,
        takeover: tuple[int, float] | None = None,
        published_at: float | None = None,
        in_caller: str = "",
        eager: bool = False,
    ) -> None:
        if not key:
            raise FenceError(f"an execution of task {task_name} needs the key of its job")
        self.key, self.task_name, self.config = key, task_name, config
        self.store, self.leases, self.renewer = store, leases, renewer
        self.policy, self.announcer = policy, announcer
        #: Celery's re-send count of this message: backs off before a registration.
        self.retries = retries
        #: ``celery -A <app>`` as the operator types it, for the hints of a job's errors.
        self.celery_command = celery_command
        self.attempt_id = attempt_id or uuid.uuid4().hex
        #: The attempt's span (:mod:`celery_fence.announce.tracing`); None: tracing is off.
        self.trace = trace
        #: The cluster-wide limits' scripts (None: the task has no group limit or rate limit).
        self.limits = limits
        #: This message's concurrency group (``fence_group``), or None.
        self.group = group
        #: A recovery's takeover of this job (the message's ``fence_takeover`` header): the
        #: generation taken over and when its row last moved (epoch seconds); None otherwise.
        self.takeover = takeover
        #: When the message was published (or its ETA), epoch seconds: the metrics' queue wait.
        self.published_at = published_at
        #: How the attempt runs in the caller's thread, with no message behind it (``"direct
        #: call"``, ``"eager run"``), else empty: the settle step never leaves its row for a
        #: re-send (:mod:`celery_fence.pipeline.settle`).
        self.in_caller = in_caller
        #: An eager run (``.apply()``, ``task_always_eager``): Celery runs ``self.retry()`` inline.
        self.eager = eager
        #: What the claim and the registration decided, as far as they got. ``run_number`` starts
        #: as the message's re-run (its ``fence_run`` header; 0: the key's first run).
        self.claim = Claim(self.attempt_id, run_number=run_number)
        #: The lease was given back before the attempt ended (:meth:`release_before_retry`).
        self.released = False
        #: The body's write outside every fenced block was announced (once per attempt).
        self.unfenced_reported = False

    # -- the path ----------------------------------------------------------------------------------

    def run(
        self,
        body: Callable[[Fence], Any],
        *,
        request_json: Callable[[], str | None],
        max_runtime: float | None,
    ) -> Disposition:
        """Claim, register, run ``body(fence)`` and settle: the disposition for Celery. Every
        exit of the path is settled; the lease and the slot are given back whatever happens."""
        try:
            try:
                outcome = self._execute(body, request_json, max_runtime)
            except Exception as exc:  # anything raised in the fenced path settles too
                outcome = outcomes.Unexpected(exc)
            except BaseException as exc:  # SystemExit, CancelledError, gevent's Timeout, ...
                outcome = outcomes.Interrupted(exc)
            return self.settle(outcome)
        finally:  # whatever ends the attempt, even an exit raised in the settle step itself
            claim = self.claim
            if claim.lease is not None and not self.released:
                self.renewer.discard(claim.lease)  # compare-and-delete, batched by the renewer
            if claim.slot is not None:
                self.renewer.discard(claim.slot)  # the group's slot, the same way
            observer = metrics.active
            if observer is not None and claim.claimed_at is not None:
                observer.attempt(self.task_name, time.monotonic() - claim.claimed_at)

    def settle(self, outcome: Outcome) -> Disposition:
        """The one step every ending of this attempt passes through, with the claim as far as it
        got: see :mod:`celery_fence.pipeline.settle`."""
        return settle(self, self.claim, outcome)

    def announce(self, action: Action, reason: str | None = None, **extra: Any) -> None:
        """Log, signal and (with events on) queue the Celery event of one transition."""
        self.announcer(
            action,
            key=self.key,
            attempt_id=self.attempt_id,
            generation=self.claim.generation,
            reason=reason,
            **extra,
        )

    def _execute(
        self,
        body: Callable[[Fence], Any],
        request_json: Callable[[], str | None],
        max_runtime: float | None,
    ) -> Outcome:
        """Claim -> register -> body, as far as it gets: the outcome, never an exit."""
        self.policy.budget.record_call(self.task_name)
        if self.trace is None:
            claimed = self._claim_and_register(request_json, max_runtime)
        else:
            attributes = {"fence.key": self.key, "fence.attempt": self.attempt_id}
            with tracing.child("fence claim", attributes) as span:
                claimed = self._claim_and_register(request_json, max_runtime)
                generation = self.claim.generation
                if span is not None and generation is not None:
                    span.set_attribute("fence.generation", generation)
        if not isinstance(claimed, Claim):
            return claimed
        assert claimed.lease is not None and claimed.generation is not None
        fence = self.fence_class(
            key=self.key,
            attempt_id=self.attempt_id,
            generation=claimed.generation,
            attempts=claimed.attempts,
            lease=claimed.lease,
            # the fenced blocks run SQL on the store's database: a store double has none
            store=self.store if isinstance(self.store, Store) else None,
            execution=self,
            run=claimed.run_number,
            idempotency_namespace=self.config.idempotency_namespace,
        )
        sqla.install()  # once per process: every SQLAlchemy write of the body is seen
        watch_django()  # and, with Django configured, every Django ORM write
        try:
            with watch.running(fence):  # its writes on any connection are attributed to it
                result = body(fence)
        except (Retry, Ignore, Reject) as exc:
            return outcomes.Control(exc)
        except LeaseLost as exc:
            return outcomes.Lost(exc)
        except StaleGeneration as exc:
            return outcomes.Stale(exc)
        except outcomes.Final as final:
            return outcomes.Failed(final.error, final=final.reason)
        except Exception as exc:
            return outcomes.Failed(exc)
        return outcomes.Completed(result, fence.effects.staged)

    def _claim_and_register(
        self,
        request_json: Callable[[], str | None],
        max_runtime: float | None,
    ) -> Claim | Outcome:
        """Claim a generation and register it: the registered claim when the body may run, else
        the outcome. ``self.claim`` follows each step (the lease and the slot are given back
        from it whatever happens)."""
        config, leases, renewer = self.config, self.leases, self.renewer
        on_lost, on_renewed = lease_observers(self.announcer, self.store)
        with_slot = slot_rides_claim(self.limits, leases, config, self.group)
        slot = SlotClaim(
            self.key, self.attempt_id, self.group, max_runtime, self._hold_slot, self._slot_lost
        )
        if self.limits is not None:
            limited = take_limits(
                self.limits, config, renewer, slot, task_name=self.task_name, in_claim=with_slot
            )
            if limited is not None:
                return limited
        request: str | None = None
        for _ in range(CLAIM_ROUNDS):
            claimed_at = time.monotonic()
            releases = renewer.take_releases()
            try:
                if with_slot and self.limits is not None:
                    with_slot = False
                    generation = claim_in_group(
                        self.limits, leases, config, renewer, slot, releases, claimed_at
                    )
                    if isinstance(generation, outcomes.Limited):
                        return generation
                else:
                    generation = leases.claim(
                        self.key, self.attempt_id, config.lease_ttl_ms, releases=releases
                    )
            except LeaseBusy as busy:
                return outcomes.Busy(busy.remaining)
            except BaseException as exc:  # Redis unreachable or refusing: re-send, never drop
                # The claim may have run with its reply lost (a timeout, a dropped connection,
                # an exit raised while it waited): release this attempt's lease by its token,
                # whatever its generation, so the next delivery does not find it busy for a
                # whole TTL; the other attempts' releases it carried go back to the queue.
                lost_claim = (leases.keys_for(self.key).lease, f"{self.attempt_id}:")
                renewer.return_releases([*releases, lost_claim])
                if not isinstance(exc, Exception):
                    raise
                return outcomes.Unavailable(exc, f"lease store unavailable ({type(exc).__name__})")
            lease = HeldLease(
                key=self.key,
                lease_key=leases.keys_for(self.key).lease,
                token=self.attempt_id,
                generation=generation,
                ttl=config.lease_ttl,
                interval=config.renew_interval,
                margin=config.lease_margin,
                claimed_at=claimed_at,
                max_runtime=max_runtime,
                on_lost=on_lost,
                on_renewed=on_renewed,
            )
            self.claim = replace(
                self.claim, generation=generation, lease=lease, claimed_at=claimed_at
            )
            renewer.add(lease)
            self.announce(Action.CLAIMED)
            observer = metrics.active
            if observer is not None and self.published_at is not None:
                observer.waited(self.task_name, time.time() - self.published_at)
            if request is None:
                request = request_json() or ""
            try:
                outcome = self._register(self.claim, request or None)
            except sa_exc.DataError as exc:  # the database refuses the request: every time
                return self.refused_registration(exc, request or None)
            except sa_exc.ProgrammingError as exc:  # e.g. the tables do not exist
                reason = refusal_reason(exc, "registration")
                return outcomes.Unavailable(exc, reason, max(5.0, config.retry_backoff_max / 10))
            except Exception as exc:  # nothing was registered: re-send, never drop
                return outcomes.Unavailable(exc, f"store unavailable ({type(exc).__name__})")
            if outcome is None:
                claim = self.claim
                return outcomes.Exhausted() if claim.attempts > config.max_attempts else claim
            if not isinstance(outcome, outcomes.Stale):
                return outcome
            # Redis handed out a generation the store already saw (its counter was lost): raise
            # the counter above the store's and claim again. The store stays the authority.
            stored = outcome.error.context.get("stored_generation")
            stored = stored if isinstance(stored, int) else 0
            renewer.discard(lease, release=False)
            self.claim = replace(self.claim, lease=None)
            leases.release(lease.lease_key, lease.value)  # now, so the re-claim does not meet it
            regressed(self.key, self.attempt_id, generation, stored)
            leases.raise_generation(self.key, stored)
        return outcomes.Unavailable(
            FenceError(f"could not claim a generation above the store's for {self.key!r}"),
            "generation regressed on every claim round",
        )

    def _hold_slot(self, slot: HeldLease) -> None:
        """The group slot is taken: the claim holds it (given back when the attempt ends)."""
        self.claim = replace(self.claim, slot=slot)

    def _slot_lost(self, slot: HeldLease, reason: str) -> None:
        """The group slot expired or was taken over: the attempt may no longer count as one of
        the group's running ones, so its lease is lost too (``fence.check()`` raises)."""
        lease = self.claim.lease
        if lease is not None:
            lease.mark_lost(f"group slot lost: {reason}")

    def refused_registration(self, error: sa_exc.DataError, request: str | None) -> Outcome:
        """The database refused the registration's request: it would every time."""
        return outcomes.Refused(error, request)

    def _register(self, claim: Claim, request: str | None) -> Outcome | None:
        """Register ``claim`` with the message's ``request`` (JSON): None when it registered
        (``self.claim`` then says so), else the outcome the store's state calls for (replayed,
        already dead, or stale: a newer generation got there first)."""
        generation = claim.generation
        assert generation is not None
        observer = metrics.active
        registration = self.store.register(
            self.key,
            generation=generation,
            attempt_id=self.attempt_id,
            task_name=self.task_name,
            request_json=request,
            took_over=observer is not None,
        )
        attempts = registration.attempts
        if registration.outcome == "registered":
            if observer is not None and registration.took_over_from is not None:
                count_takeover(registration.took_over_from, self.task_name, observer)
            took_over = None
            if self.takeover is not None:  # a recovery's re-send
                took_over = announce_takeover(self.announce, self.takeover, generation)
            # the row's stored request says which re-run this is, also when the message does not
            # (the key's first message redelivered late, after a requeue --completed)
            run = max(claim.run_number, registration.run)
            self.claim = replace(
                claim, attempts=attempts, registered=True, run_number=run, took_over=took_over
            )
            return None
        self.claim = replace(claim, attempts=attempts)
        if registration.outcome == "completed":
            assert registration.record is not None
            return outcomes.Replayed(registration.record)
        if registration.outcome == "dead":
            return outcomes.AlreadyDead(registration.record)
        return outcomes.Stale(
            StaleGeneration(
                f"generation {generation} of {self.key!r} was superseded before it registered",
                stored_generation=registration.stored_generation,
                where="registration",
            )
        )

    # -- the body's side ---------------------------------------------------------------------------

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
        record = functools.partial(
            self.store.record,
            self.key,
            action=Action.UNFENCED_WRITE,
            generation=self.claim.generation,
            attempt_id=self.attempt_id,
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
                "fence.generation": self.claim.generation,
                "fence.attempt": self.attempt_id,
                "fence.block": where,
            },
        )

    def release_before_retry(self) -> bool:
        """The body's own retry is about to be sent (``self.retry()``, ``autoretry_for``): give
        the lease back now, compared on its token, so the retry does not find this attempt's
        lease busy and wait a whole TTL. True when the lease was given back; False leaves it to
        the end of the attempt (the store's fencing, not the lease, decides whose writes count
        either way)."""
        lease = self.claim.lease
        if lease is None or self.released:
            return False
        self.renewer.discard(lease, release=False)
        self.released = True
        try:
            self.leases.release(lease.lease_key, lease.value)
        except Exception:  # Redis unreachable: the renewer's thread sends it (or the TTL ends it)
            self.renewer.return_releases([(lease.lease_key, lease.value)])
        return True


__all__ = ["CLAIM_ROUNDS", "Execution"]
