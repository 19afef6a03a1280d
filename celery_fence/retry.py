"""Retry policy: classify an error, back off with full jitter, spend a retry budget.

- ``PermanentError`` (and ``fence_permanent_exceptions``) go straight to ``dead``.
- ``fence_transient_exceptions`` (default: :data:`DEFAULT_TRANSIENT`, connection errors and
  timeouts of Redis, SQLAlchemy/DB-API, kombu and the standard library) are retried.
- Anything else is retried too (``fence_retry_unknown_errors=True``, the default): an unexpected
  error is bounded by ``fence_max_attempts`` and the budget, and ends ``dead`` where an operator
  can see it. Set it to False to send unknown errors straight to ``dead``.

The attempt count comes from the store (one per claimed execution), so a crash that loses the
worker counts as well. Backoff is "full jitter": ``uniform(0, min(cap, base * 2 ** (n - 1)))``.

The budget is a token bucket per task name and process: each call adds ``ratio`` tokens (at most
``floor + ratio * calls-in-a-window``), each retry spends one, and ``floor`` tokens come back every
window. A retry that finds the bucket empty is not dropped: it is delayed by a further window.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import kombu.exceptions
import redis.exceptions
import sqlalchemy.exc

from .config import FenceConfig
from .errors import LeaseBusy, PermanentError, ResultNotSerializable

#: Errors that may resolve on their own: retried.
DEFAULT_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    sqlalchemy.exc.OperationalError,
    sqlalchemy.exc.InterfaceError,
    sqlalchemy.exc.DisconnectionError,
    sqlalchemy.exc.TimeoutError,
    kombu.exceptions.OperationalError,
    ConnectionError,
    TimeoutError,
    socket.timeout,
    LeaseBusy,
)

#: Errors that need corrected input or code: never retried.
ALWAYS_PERMANENT: tuple[type[BaseException], ...] = (PermanentError, ResultNotSerializable)

Kind = Literal["transient", "permanent", "unknown"]


def classify(exc: BaseException, config: FenceConfig) -> Kind:
    if isinstance(exc, ALWAYS_PERMANENT + config.permanent_exceptions):
        return "permanent"
    transient = (
        DEFAULT_TRANSIENT if config.transient_exceptions is None else (config.transient_exceptions)
    )
    if isinstance(exc, transient):
        return "transient"
    return "unknown"


def backoff(attempt: int, config: FenceConfig, rng: random.Random | None = None) -> float:
    """Full-jitter delay in seconds before retry number ``attempt`` (1-based)."""
    ceiling = min(config.retry_backoff_max, config.retry_backoff * (2 ** max(0, attempt - 1)))
    return (rng or random).uniform(0, ceiling)


class RetryBudget:
    """A token bucket per task name (see the module docstring). Thread-safe."""

    def __init__(self, config: FenceConfig, clock: Callable[[], float] | None = None) -> None:
        self.ratio = config.retry_budget_ratio
        self.floor = config.retry_budget_floor
        self.window = config.retry_budget_window
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}
        self._refilled: dict[str, float] = {}

    def _refill(self, name: str) -> None:
        now = self._clock()
        last = self._refilled.get(name)
        if last is None or now - last >= self.window:
            self._tokens[name] = max(self._tokens.get(name, 0.0), float(self.floor))
            self._refilled[name] = now

    def record_call(self, name: str) -> None:
        with self._lock:
            self._refill(name)
            self._tokens[name] = self._tokens[name] + self.ratio

    def try_spend(self, name: str) -> bool:
        with self._lock:
            self._refill(name)
            if self._tokens[name] >= 1.0:
                self._tokens[name] -= 1.0
                return True
            return False

    def until_refill(self, name: str) -> float:
        with self._lock:
            last = self._refilled.get(name, self._clock())
            return max(0.0, self.window - (self._clock() - last))


@dataclass(frozen=True)
class Decision:
    action: Literal["retry", "dead"]
    countdown: float
    reason: str


class RetryPolicy:
    def __init__(self, config: FenceConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.budget = RetryBudget(config)
        self.rng = rng or random.Random()

    def decide(self, exc: BaseException, *, attempts: int, task_name: str) -> Decision:
        """What to do after attempt number ``attempts`` (counted by the store) raised ``exc``."""
        kind = classify(exc, self.config)
        name = type(exc).__name__
        if kind == "permanent":
            return Decision("dead", 0.0, f"permanent error {name}")
        if kind == "unknown" and not self.config.retry_unknown_errors:
            return Decision("dead", 0.0, f"unclassified error {name} (retry_unknown_errors off)")
        if attempts >= self.config.max_attempts:
            return Decision(
                "dead", 0.0, f"{name} after {attempts} of {self.config.max_attempts} attempts"
            )
        countdown = backoff(attempts, self.config, self.rng)
        if not self.budget.try_spend(task_name):
            countdown += self.budget.until_refill(task_name) + self.rng.uniform(
                0, self.config.retry_backoff
            )
            return Decision("retry", countdown, f"{kind} error {name}; retry budget spent, delayed")
        return Decision("retry", countdown, f"{kind} error {name}")
