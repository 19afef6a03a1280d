"""Retry policy: classify an error, back off with full jitter, spend a retry budget.

Classification (:func:`classify`):

- ``PermanentError``, ``ResultNotSerializable``, ``ConfigurationError`` (a fence API used in a
  way that can never work, e.g. a ``bind=`` on another database) and
  ``fence_permanent_exceptions`` are *permanent*: the job goes straight to ``dead``, after one
  attempt.
- ``fence_transient_exceptions`` (default: :data:`DEFAULT_TRANSIENT`, the connection errors and
  timeouts of Redis, SQLAlchemy, the DB-API drivers, kombu and the standard library) are
  *transient*: retried until ``fence_max_attempts``.
- Anything else is *unknown* and, by default (``fence_retry_unknown_errors=True``), retried like a
  transient error: an unexpected error is already bounded by ``fence_max_attempts`` and the
  budget, and it ends ``dead`` where an operator can inspect it and requeue it once fixed. Set
  ``fence_retry_unknown_errors=False`` to send unknown errors straight to ``dead``.

The attempt count is the store's (one per claimed execution, counted at registration), so a crash
that loses the worker counts too. Backoff is "full jitter" (AWS Architecture Blog, "Exponential
Backoff And Jitter"): retry ``n`` waits ``uniform(0, min(cap, base * 2 ** (n - 1)))`` seconds,
with ``base = fence_retry_backoff`` and ``cap = fence_retry_backoff_max``.

The retry budget is a token bucket per task name: each call deposits ``fence_retry_budget_ratio``
tokens, ``fence_retry_budget_floor`` tokens come back every ``fence_retry_budget_window``
seconds, and the bucket holds at most ``floor + ratio * recent calls`` (calls decay with a time
constant of one window). Each retry spends one token. A retry that finds the bucket empty is
**delayed, never dropped**: it waits until the bucket would hold a token again (at most
``fence_retry_backoff_max``) plus its jittered backoff.

Where the budget lives — a decision: it is **shared through the lease Redis**, one hash per task
name (``<prefix>:budget:<task name>``), updated by one Lua script (``lua/retry_budget.lua``).
A per-process bucket would multiply the budget by the number of worker processes (prefork
children x hosts), which is exactly the retry storm a budget exists to stop. The success path
pays nothing for it: :meth:`RetryBudget.record_call` only bumps a process-local counter, and the
calls counted since the last report ride along in the one round trip a *failure* makes anyway.
Calls made by a process that never fails are not reported, so the shared budget errs on the
strict side by at most those deposits (the floor covers quiet processes). When that Redis is
unreachable — often the very failure being retried — the decision falls back to a per-process
bucket with the same rules, so a retry is never blocked on the budget's own storage.
"""

from __future__ import annotations

import importlib
import math
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import kombu.exceptions
import redis.exceptions
import sqlalchemy.exc
from celery.exceptions import SoftTimeLimitExceeded

from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError, LeaseBusy, PermanentError, ResultNotSerializable
from celery_fence.leases.redis_client import client_identity, make_client
from celery_fence.leases.scripts import LuaScript
from celery_fence.process.runtime import runtime


def _dbapi_transient() -> tuple[type[BaseException], ...]:
    """Connection-level errors of the DB-API drivers celery-fence supports (psycopg 3 and
    psycopg2), those installed."""
    errors: list[type[BaseException]] = []
    for module in ("psycopg", "psycopg2"):
        try:
            driver = importlib.import_module(module)
        except ImportError:  # pragma: no cover - both are in the postgres extra
            continue
        errors += [driver.OperationalError, driver.InterfaceError]
    return tuple(errors)


#: Errors that may resolve on their own: retried.
DEFAULT_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ClusterError,  # also ClusterDownError, MasterDownError
    redis.exceptions.TryAgainError,  # a slot migration in progress
    redis.exceptions.ReadOnlyError,  # a replica just before/after a failover
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.DisconnectionError,
    sqlalchemy.exc.TimeoutError,
    *_dbapi_transient(),
    kombu.exceptions.OperationalError,
    ConnectionError,
    TimeoutError,
    socket.timeout,
    LeaseBusy,
    SoftTimeLimitExceeded,  # the next attempt may be faster; max_attempts bounds it
)

#: Errors that need corrected input or code: never retried, whatever the settings say.
ALWAYS_PERMANENT: tuple[type[BaseException], ...] = (
    PermanentError,
    ResultNotSerializable,
    ConfigurationError,
)

Kind = Literal["transient", "permanent", "unknown"]


def classify(exc: BaseException, config: FenceConfig) -> Kind:
    """``permanent`` wins over ``transient``; anything in neither list is ``unknown``."""
    if isinstance(exc, ALWAYS_PERMANENT + config.permanent_exceptions):
        return "permanent"
    transient = (
        DEFAULT_TRANSIENT if config.transient_exceptions is None else config.transient_exceptions
    )
    if isinstance(exc, transient):
        return "transient"
    return "unknown"


def expected_outage(exc: BaseException) -> bool:
    """Whether an error of celery-fence's own calls (its store, its Redis, the broker) is one
    that passes on its own. The task body's errors are never judged by this: :func:`classify`
    judges them, with the task's settings."""
    return isinstance(exc, DEFAULT_TRANSIENT)


def give_up(
    exc: BaseException,
    config: FenceConfig,
    *,
    attempts: int,
    max_attempts: int,
    retry_unknown: bool | None = None,
) -> tuple[Kind, str | None]:
    """The one give-up rule, for tasks and outbox effects alike: ``exc``'s kind, and why it ends
    the job after ``attempts`` of ``max_attempts`` (None: retry it). ``retry_unknown``
    overrides ``fence_retry_unknown_errors``."""
    kind = classify(exc, config)
    name = type(exc).__name__
    if kind == "permanent":
        return kind, f"permanent error {name}"
    if kind == "unknown" and not (
        config.retry_unknown_errors if retry_unknown is None else retry_unknown
    ):
        return kind, f"unclassified error {name} (retry_unknown_errors off)"
    if attempts >= max_attempts:
        return kind, f"{kind} error {name} after {attempts} of {max_attempts} attempts"
    return kind, None


def ceiling(attempt: int, config: FenceConfig) -> float:
    """The largest delay, in seconds, before retry number ``attempt`` (1-based): the capped
    exponential ``min(fence_retry_backoff_max, fence_retry_backoff * 2 ** (attempt - 1))``."""
    exponent = min(max(0, attempt - 1), 64)  # 2**64 * base is past any sane cap already
    return min(config.retry_backoff_max, config.retry_backoff * (2.0**exponent))


def backoff(attempt: int, config: FenceConfig, rng: random.Random | None = None) -> float:
    """Full-jitter delay in seconds before retry number ``attempt``: ``uniform(0, ceiling)``."""
    return (rng or random).uniform(0, ceiling(attempt, config))


def outage_backoff(resends: int, config: FenceConfig, rng: random.Random | None = None) -> float:
    """The delay before a message's re-send number ``resends`` (1-based) when celery-fence's own
    store or Redis could not be reached: ``uniform(ceiling / 2, ceiling)`` (equal jitter), so
    each re-send of one message waits longer than the one before until the cap
    (``fence_retry_backoff_max``) — an outage is waited out with a few re-sends, not a burst —
    while messages of one outage still spread out. Bounded: never more than the cap; never a
    drop (the fence's re-sends consume no retries)."""
    top = ceiling(resends, config)
    return (rng or random).uniform(top / 2, top)


# -- the budget -----------------------------------------------------------------------------------


#: Float slack: 10 calls x ratio 0.1 must buy one retry although 0.1 * 10 < 1.0 in binary.
EPSILON = 1e-9


class TokenBucket:
    """The budget's rules for one task name, in process (the shared script's twin).

    ``now`` is in seconds on any clock that does not go backwards between calls.
    """

    __slots__ = ("calls", "floor", "ratio", "tokens", "ts", "window")

    def __init__(self, *, floor: float, ratio: float, window: float, now: float) -> None:
        self.floor = floor
        self.ratio = ratio
        self.window = window
        self.tokens = float(floor)
        self.calls = 0.0
        self.ts = now

    def _advance(self, now: float, new_calls: float) -> None:
        elapsed = max(0.0, now - self.ts)
        self.ts = max(self.ts, now)
        self.calls = self.calls * math.exp(-elapsed / self.window) + new_calls
        self.tokens = min(
            self.tokens + self.floor * elapsed / self.window + self.ratio * new_calls,
            self.floor + self.ratio * self.calls,
        )

    def deposit(self, now: float, calls: float = 1.0) -> None:
        self._advance(now, calls)

    def spend(self, now: float) -> float:
        """Spend one token: 0.0 when granted, else the seconds until the bucket holds one."""
        self._advance(now, 0.0)
        if self.tokens >= 1.0 - EPSILON:
            self.tokens = max(0.0, self.tokens - 1.0)
            return 0.0
        if self.floor > 0:
            return (1.0 - self.tokens) * self.window / self.floor
        return self.window


RETRY_BUDGET = LuaScript("retry_budget")

#: Seconds the per-process budget stands in after the shared bucket could not be reached.
SHARED_COOLDOWN = 10.0


class RetryBudget:
    """Retry budgets per task name, shared through Redis (see the module docstring).

    Thread-safe. ``clock`` returns wall-clock seconds (it is shared between processes and hosts,
    so a monotonic clock would not do); ``redis_client`` defaults to a client for
    ``fence_redis_url``; pass ``shared=False`` for a per-process budget only.
    """

    def __init__(
        self,
        config: FenceConfig,
        *,
        redis_client: Any = None,
        shared: bool = True,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config
        self.ratio = config.retry_budget_ratio
        self.floor = config.retry_budget_floor
        self.window = config.retry_budget_window
        self.shared = shared
        self._client = redis_client
        self._clock = clock or time.time
        self._lock = threading.Lock()
        self._local: dict[str, TokenBucket] = {}
        self._unreported: dict[str, tuple[float, float]] = {}  # name -> (decayed calls, at)
        self._shared_down_until = 0.0  # monotonic: skip the shared bucket until then

    def key(self, name: str) -> str:
        return f"{self.config.key_prefix}:budget:{name}"

    def _bucket(self, name: str, now: float) -> TokenBucket:
        bucket = self._local.get(name)
        if bucket is None:
            bucket = self._local[name] = TokenBucket(
                floor=self.floor, ratio=self.ratio, window=self.window, now=now
            )
        return bucket

    def _decayed(self, name: str, now: float) -> float:
        calls, at = self._unreported.get(name, (0.0, now))
        return calls * math.exp(-max(0.0, now - at) / self.window)

    def record_call(self, name: str) -> None:
        """Count one call of task ``name``: in-process only, no I/O (the success path)."""
        now = self._clock()
        with self._lock:
            self._bucket(name, now).deposit(now)
            self._unreported[name] = (self._decayed(name, now) + 1.0, now)

    def spend(self, name: str) -> float:
        """Spend one retry of task ``name``: 0.0 when granted, else seconds until a token.

        One round trip to the shared bucket (reporting the calls counted since the last one), or
        the per-process bucket when the shared one cannot be reached.
        """
        now = self._clock()
        with self._lock:
            unreported = self._decayed(name, now)
            local_wait = self._bucket(name, now).spend(now)
        if not self.shared or time.monotonic() < self._shared_down_until:
            return local_wait
        try:
            client = self._client
            if client is None:  # the process's client for the lease Redis
                client = runtime().get(
                    "redis",
                    client_identity(self.config.redis),
                    lambda: make_client(self.config.redis),
                )
            granted, wait_ms = RETRY_BUDGET(
                client,
                [self.key(name)],
                [
                    round(now * 1000),
                    max(1, round(self.window * 1000)),
                    repr(float(self.floor)),
                    repr(float(self.ratio)),
                    repr(unreported),
                ],
            )
        except (redis.exceptions.RedisError, OSError):
            # The budget's own storage is down (often the very failure being retried): never
            # block a retry on it, and do not wait for it again on every failure for a while.
            self._shared_down_until = time.monotonic() + SHARED_COOLDOWN
            return local_wait
        with self._lock:  # reported: only calls counted since this round trip stay local
            calls, at = self._unreported.get(name, (0.0, now))
            self._unreported[name] = (max(0.0, calls - unreported), at)
        return 0.0 if int(granted) else int(wait_ms) / 1000


# -- the decision ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What to do after a failed attempt: the ``verdict`` ``retry`` in ``countdown`` seconds, or
    ``dead``."""

    verdict: Literal["retry", "dead"]
    countdown: float
    reason: str
    kind: Kind = "unknown"
    budget_spent: bool = False


class RetryPolicy:
    """The policy of one task (its settings, with per-task options applied)."""

    def __init__(
        self,
        config: FenceConfig,
        rng: random.Random | None = None,
        *,
        budget: RetryBudget | None = None,
    ) -> None:
        self.config = config
        self.budget = budget or RetryBudget(config)
        self.rng = rng or random.Random()

    def decide(self, exc: BaseException, *, attempts: int, task_name: str) -> Decision:
        """What to do after attempt number ``attempts`` (counted by the store) raised ``exc``."""
        max_attempts = self.config.max_attempts
        kind, dead = give_up(exc, self.config, attempts=attempts, max_attempts=max_attempts)
        if dead is not None:
            return Decision("dead", 0.0, dead, kind)
        name = type(exc).__name__
        countdown = backoff(attempts, self.config, self.rng)
        wait = self.budget.spend(task_name)
        what = f"{kind} error {name}, attempt {attempts} of {max_attempts}"
        if wait > 0:
            # Spent budget delays, never drops: wait for the bucket, then the jittered backoff.
            countdown += min(wait, self.config.retry_backoff_max)
            reason = f"{what}; retry budget spent, retry in {countdown:.3f}s"
            return Decision("retry", countdown, reason, kind, budget_spent=True)
        return Decision("retry", countdown, f"{what}; retry in {countdown:.3f}s", kind)
