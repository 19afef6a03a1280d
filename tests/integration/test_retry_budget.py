"""The retry budget's shared bucket: one token bucket per task name in Redis (a Lua script),
shared by every process, with the local bucket as its twin and its fallback.

Time is passed in through a controlled clock, never slept.
"""

from __future__ import annotations

import random

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_fence.config import FenceConfig
from celery_fence.pipeline.retry import RetryBudget
from tests.unit.test_retry import Clock


@pytest.fixture
def budget_config(prefix: str) -> FenceConfig:
    return FenceConfig.from_mapping(
        {},
        key_prefix=prefix,
        retry_budget_floor=3,
        retry_budget_ratio=0.5,
        retry_budget_window=60.0,
    )


def test_the_shared_budget_is_one_bucket_for_every_process(
    redis_client: redis.Redis, budget_config: FenceConfig
) -> None:
    # Given two processes' budgets (separate objects, separate local buckets) on one Redis ...
    clock = Clock()
    a = RetryBudget(budget_config, redis_client=redis_client, clock=clock)
    b = RetryBudget(budget_config, redis_client=redis_client, clock=clock)
    # ... when both spend retries of the same task, they share floor = 3 tokens,
    spent = [a.spend("task.x"), b.spend("task.x"), a.spend("task.x"), b.spend("task.x")]
    assert spent[:3] == [0.0, 0.0, 0.0]
    assert spent[3] == pytest.approx(20.0, abs=0.01)  # 1 token / (60 s / 3)
    # while another task name has a budget of its own,
    assert a.spend("task.y") == 0.0
    # and calls, counted locally without I/O, are reported with the next failure: 4 x 0.5.
    for _ in range(4):
        b.record_call("task.x")
    assert redis_client.exists(f"{budget_config.key_prefix}:budget:task.x")
    after_calls = [b.spend("task.x"), b.spend("task.x"), b.spend("task.x")]
    assert after_calls[:2] == [0.0, 0.0] and after_calls[2] > 0
    assert a.spend("task.x") > 0
    # Time refills it: 20 s later one token is back for whoever asks first.
    clock.now += 20.0
    assert a.spend("task.x") == 0.0
    assert b.spend("task.x") > 0


def test_the_shared_bucket_and_the_local_twin_agree(
    redis_client: redis.Redis, budget_config: FenceConfig
) -> None:
    clock = Clock()
    shared = RetryBudget(budget_config, redis_client=redis_client, clock=clock)
    local = RetryBudget(budget_config, shared=False, clock=clock)
    rng = random.Random(5)
    outcomes = []
    for _ in range(150):
        for _ in range(rng.randint(0, 3)):
            shared.record_call("t")
            local.record_call("t")
        wait = shared.spend("t")
        assert wait == pytest.approx(local.spend("t"), abs=0.002)
        outcomes.append(wait == 0.0)
        clock.now += rng.randint(0, 12)  # whole seconds: both sides compute the same floats
    assert any(outcomes) and not all(outcomes)  # both regimes were exercised


def test_an_unreachable_shared_bucket_falls_back_to_the_process_budget(
    budget_config: FenceConfig,
) -> None:
    down = redis.Redis(
        host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0)
    )
    budget = RetryBudget(budget_config, redis_client=down, clock=Clock())
    assert [budget.spend("t") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert budget.spend("t") > 0  # still a budget, per process, with the same rules
