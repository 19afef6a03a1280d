"""The retry policy: classification, full-jitter backoff (bounds, growth, cap) and the budget.

The budget's local token bucket runs with a controlled clock: time is passed in, never slept. Its
shared bucket (a Lua script on the real Redis) is tested in tests/integration/test_retry_budget.py.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

import kombu.exceptions
import pytest
import redis
import sqlalchemy.exc

from celery_fence import ConfigurationError, LeaseBusy, PermanentError, ResultNotSerializable
from celery_fence.config import FenceConfig
from celery_fence.pipeline.retry import (
    RetryBudget,
    RetryPolicy,
    TokenBucket,
    backoff,
    ceiling,
    classify,
)


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class InvalidInput(Exception):
    pass


def _config(**overrides: Any) -> FenceConfig:
    return FenceConfig.from_mapping({}, **overrides)


# -- classification -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "exc",
    [
        redis.exceptions.ConnectionError("down"),
        redis.exceptions.TimeoutError("slow"),
        sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed")),
        sqlalchemy.exc.InterfaceError("SELECT 1", {}, Exception("closed")),
        kombu.exceptions.OperationalError("broker down"),
        ConnectionRefusedError("refused"),
        TimeoutError("timed out"),
        LeaseBusy(remaining=1.0),
    ],
    ids=lambda e: type(e).__name__,
)
def test_connection_errors_and_timeouts_are_transient(exc: BaseException) -> None:
    assert classify(exc, _config()) == "transient"


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_dbapi_connection_errors_are_transient(driver: str) -> None:
    module = pytest.importorskip(driver)
    assert classify(module.OperationalError("server closed"), _config()) == "transient"
    assert classify(module.InterfaceError("connection closed"), _config()) == "transient"


def test_permanent_errors_and_configured_types() -> None:
    config = _config(permanent_exceptions=[InvalidInput, "json.JSONDecodeError"])
    assert classify(PermanentError("bad input"), config) == "permanent"
    assert classify(ResultNotSerializable(), config) == "permanent"
    # a fence API misused in the body (e.g. a bind= on another database) never starts working
    assert classify(ConfigurationError("bind on another database"), config) == "permanent"
    assert classify(InvalidInput(), config) == "permanent"
    import json

    assert classify(json.JSONDecodeError("x", "doc", 0), config) == "permanent"
    # permanent wins over transient: a configured permanent ConnectionError is not retried
    both = _config(permanent_exceptions=[ConnectionResetError])
    assert classify(ConnectionResetError(), both) == "permanent"


def test_unknown_errors_and_a_replaced_transient_list() -> None:
    assert classify(KeyError("x"), _config()) == "unknown"
    config = _config(transient_exceptions=[KeyError])
    assert classify(KeyError("x"), config) == "transient"
    assert classify(ConnectionError(), config) == "unknown"  # the list replaces the defaults


# -- backoff --------------------------------------------------------------------------------------


def test_full_jitter_stays_within_the_growing_capped_ceiling() -> None:
    config = _config(retry_backoff=0.5, retry_backoff_max=5.0)
    assert [ceiling(n, config) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert ceiling(10_000, config) == 5.0  # no overflow far past the cap
    rng = random.Random(7)
    for attempt in range(1, 8):
        delays = [backoff(attempt, config, rng) for _ in range(400)]
        assert all(0.0 <= d <= ceiling(attempt, config) for d in delays)
        # full jitter: spread over the whole range, not clustered at the ceiling
        assert min(delays) < 0.1 * ceiling(attempt, config)
        assert max(delays) > 0.9 * ceiling(attempt, config)
        assert len(set(delays)) == len(delays)


def test_full_jitter_grows_on_average_until_the_cap() -> None:
    config = _config(retry_backoff=0.5, retry_backoff_max=5.0)
    rng = random.Random(11)
    means = [statistics.fmean(backoff(n, config, rng) for _ in range(2000)) for n in range(1, 7)]
    for expected_ceiling, mean in zip([0.5, 1.0, 2.0, 4.0, 5.0, 5.0], means, strict=True):
        assert mean == pytest.approx(expected_ceiling / 2, rel=0.1)
    assert means[0] < means[1] < means[2] < means[3]


def test_zero_base_means_immediate_retries() -> None:
    config = _config(retry_backoff=0.0, retry_backoff_max=0.0)
    assert backoff(3, config) == 0.0


# -- the decision ---------------------------------------------------------------------------------


def _policy(**overrides: Any) -> RetryPolicy:
    config = _config(**overrides)
    return RetryPolicy(config, random.Random(3), budget=RetryBudget(config, shared=False))


def test_decisions_permanent_transient_unknown_and_exhausted() -> None:
    policy = _policy(max_attempts=3, retry_backoff=1.0, retry_backoff_max=8.0)
    permanent = policy.decide(PermanentError("no"), attempts=1, task_name="t")
    assert (permanent.verdict, permanent.countdown) == ("dead", 0.0)
    first = policy.decide(ConnectionError(), attempts=1, task_name="t")
    assert first.verdict == "retry" and 0.0 <= first.countdown <= 1.0
    second = policy.decide(KeyError("k"), attempts=2, task_name="t")  # unknown: retried
    assert second.verdict == "retry" and second.kind == "unknown" and second.countdown <= 2.0
    last = policy.decide(ConnectionError(), attempts=3, task_name="t")
    assert last.verdict == "dead" and "3 of 3" in last.reason
    strict = _policy(retry_unknown_errors=False)
    assert strict.decide(KeyError("k"), attempts=1, task_name="t").verdict == "dead"
    assert strict.decide(ConnectionError(), attempts=1, task_name="t").verdict == "retry"


def test_a_spent_budget_delays_the_retry_and_never_drops_it() -> None:
    policy = _policy(
        retry_budget_floor=1,
        retry_budget_ratio=0.0,
        retry_budget_window=60.0,
        retry_backoff=0.1,
        retry_backoff_max=2.0,
    )
    granted = policy.decide(ConnectionError(), attempts=1, task_name="t")
    assert not granted.budget_spent and granted.countdown <= 0.1
    delayed = [policy.decide(ConnectionError(), attempts=1, task_name="t") for _ in range(20)]
    assert all(d.verdict == "retry" and d.budget_spent for d in delayed)
    # delayed by the wait for a token (60 s here), capped at fence_retry_backoff_max, plus backoff
    assert all(2.0 <= d.countdown <= 2.1 for d in delayed)


# -- the budget -----------------------------------------------------------------------------------


def test_token_bucket_floor_ratio_refill_and_cap() -> None:
    clock = Clock()
    bucket = TokenBucket(floor=2, ratio=0.5, window=60.0, now=clock())
    assert [bucket.spend(clock()) for _ in range(2)] == [0.0, 0.0]  # the floor
    wait = bucket.spend(clock())
    assert wait == pytest.approx(30.0)  # one token per window / floor
    for _ in range(4):
        bucket.deposit(clock())  # 4 calls x 0.5
    assert [bucket.spend(clock()) for _ in range(2)] == [0.0, 0.0]
    assert bucket.spend(clock()) > 0
    clock.now += 30.0  # the floor refills one token per 30 s
    assert bucket.spend(clock()) == 0.0
    assert bucket.spend(clock()) > 0
    # a long quiet period refills only up to floor + ratio * recent (decayed) calls
    clock.now += 3600.0
    assert sum(bucket.spend(clock()) == 0.0 for _ in range(10)) == 2


def test_a_budget_without_floor_depends_on_traffic() -> None:
    clock = Clock()
    bucket = TokenBucket(floor=0, ratio=0.1, window=10.0, now=clock())
    assert bucket.spend(clock()) == 10.0
    for _ in range(10):
        bucket.deposit(clock())
    assert bucket.spend(clock()) == 0.0
    assert bucket.spend(clock()) > 0


def test_task_options_override_the_retry_settings() -> None:
    from celery import Celery

    from celery_fence import FencedTask

    app = Celery("t", set_as_current=False)
    app.conf.update(fence_max_attempts=5, fence_retry_backoff=1.0, fence_retry_backoff_max=60.0)

    @app.task(
        base=FencedTask,
        bind=True,
        shared=False,
        max_attempts=2,
        fence_retry_backoff=0.25,
        fence_retry_backoff_max=2.0,
        fence_retry_budget_floor=3,
    )
    def tuned(self: FencedTask) -> None: ...

    @app.task(base=FencedTask, bind=True, shared=False, fence_max_attempts=7)
    def other(self: FencedTask) -> None: ...

    policy = tuned.fence_backends().policy
    assert (policy.config.max_attempts, policy.config.retry_backoff) == (2, 0.25)
    assert (policy.config.retry_backoff_max, policy.budget.floor) == (2.0, 3)
    assert policy.decide(ConnectionError(), attempts=2, task_name=tuned.name).verdict == "dead"
    assert other.fence_config().max_attempts == 7
    assert other.fence_config().retry_backoff == 1.0  # the app's setting where not overridden
