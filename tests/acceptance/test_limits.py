"""Cluster-wide limits with real worker processes: a concurrency group's slots across 8
processes (with SIGKILLed children), and a rate limit shared by two workers; each against its
control arm (Celery's own per-worker limits). The bodies record what really ran (wall-clock
spans and starts in the Redis ledger); the assertions are on those and on the stored rows."""

from __future__ import annotations

import functools
import time
import uuid
from types import ModuleType

import pytest
import redis

from celery_fence.store import Store
from celery_fence.testing import faults
from celery_fence.testing.limits import GroupFull, RateLimited
from tests.support.worker import SpawnWorker, wait_until

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.parametrize("db_url", ["postgresql"], indirect=True),
]

TTL = 2.0  # tests/support/app.py's default lease TTL (FENCE_T_TTL)


def _spans(client: redis.Redis, prefix: str) -> list[tuple[float, float]]:
    out = []
    for raw in client.lrange(f"{prefix}:spans", 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        start, end = text.split(":")
        out.append((float(start), float(end)))
    return out


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most bodies running at one instant (an end before a start at the same instant)."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = best = 0
    for _, step in events:
        running += step
        best = max(best, running)
    return best


def _all_completed(store: Store, keys: list[str], what: str) -> None:
    wait_until(
        lambda: all((r := store.get(k)) is not None and r.status == "completed" for k in keys),
        90,
        interval=0.2,
        what=what,
    )


def _eight_processes(spawn_worker: SpawnWorker) -> None:
    for name in ("a", "b"):
        spawn_worker(name, concurrency=4)


def test_a_group_of_limit_3_never_runs_more_than_3_across_8_processes_even_with_kills(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given two prefork workers of 4 children each (8 processes), a task of group limit 3,
    # and two of its bodies to be SIGKILLed mid-body ...
    _eight_processes(spawn_worker)
    keys = [f"grp:{uuid.uuid4().hex[:8]}" for _ in range(24)]
    for key in keys[:2]:
        faults.arm(redis_client, prefix, "kill", "mid_body", key)
    for key in keys:
        client_app.grouped.delay(key, sleep=0.5)
    # ... every job completes,
    _all_completed(fence_store, keys, "every grouped job completed")
    spans = _spans(redis_client, prefix)
    kills = [s for s in spans if s[1] - s[0] < 0.4]
    assert len(kills) == 2, spans  # both killed bodies ran, and died mid-body
    # never more than 3 bodies ran at once,
    assert _max_overlap(spans) == 3
    # the killed children's slots came back within one TTL: a batch sent once that TTL has
    # passed runs 3 at once again (with the two slots lost, it could run only 1 at a time),
    after = max(end for _, end in kills) + TTL
    time.sleep(max(0.0, after - time.time()))
    later = [f"grp:{uuid.uuid4().hex[:8]}" for _ in range(9)]
    for key in later:
        client_app.grouped.delay(key, sleep=0.5)
    _all_completed(fence_store, later, "every job of the later batch completed")
    spans = _spans(redis_client, prefix)
    assert _max_overlap([s for s in spans if s[0] >= after - 0.1]) == 3
    # the re-sends over the limit said so in the store, and none counted as an attempt.
    reasons = {
        t.reason
        for k in keys
        for t in fence_store.transitions.history(k)
        if t.action == "retry_scheduled"
    }
    assert "group_full" in reasons
    assert all(fence_store.get(k).attempts == 1 for k in keys[2:])  # type: ignore[union-attr]
    assert fence_store.get(keys[0]).attempts == 2  # type: ignore[union-attr]


def test_control_arm_per_worker_concurrency_alone_runs_more_than_3(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    _eight_processes(spawn_worker)
    keys = [f"ungrp:{uuid.uuid4().hex[:8]}" for _ in range(16)]
    for key in keys:
        client_app.ungrouped.delay(key, sleep=0.5)
    wait_until(
        lambda: all(
            (r := fence_store.get(k)) is not None and r.status == "completed" for k in keys
        ),
        60,
        interval=0.2,
        what="every ungrouped job completed",
    )
    assert _max_overlap(_spans(redis_client, prefix)) > 3


def _rate(starts: list[float], skip: int) -> float:
    """Starts per second after the bucket's initial burst (its first ``skip`` tokens)."""
    steady = sorted(starts)[skip:]
    return (len(steady) - 1) / (steady[-1] - steady[0])


@pytest.mark.parametrize("fenced", [True, False], ids=["fence_rate_limit", "celery_rate_limit"])
def test_a_rate_limit_holds_across_two_workers_where_celerys_own_multiplies(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fenced: bool,
) -> None:
    # Given two workers and a task limited cluster-wide by fence_rate_limit="20/s" -- or, the
    # control arm, by Celery's own rate_limit="1/s", which each worker applies to itself (on
    # this transport Celery's limiter runs about one task a second per worker at most, so the
    # arm uses a limit it can reach) ...
    rate_limit, n, burst = ("20/s", 140, 20) if fenced else ("1/s", 16, 1)
    for name in ("a", "b"):
        spawn_worker(
            name, concurrency=2, extra_args=("--prefetch-multiplier=40",), FENCE_T_RATE=rate_limit
        )
    # ... when n messages wait at once,
    task = client_app.rated if fenced else client_app.celery_rated
    for i in range(n):
        task.delay(f"rate:{i}:{uuid.uuid4().hex[:6]}")
    wait_until(
        lambda: redis_client.llen(f"{prefix}:starts") >= n,
        40,
        interval=0.2,
        what="every rated body started",
    )
    starts = [float(s) for s in redis_client.lrange(f"{prefix}:starts", 0, -1)]
    rate = _rate(starts, skip=burst)
    if fenced:  # then the fenced limit holds within 10 % across both workers,
        assert 18.0 <= rate <= 22.0, rate
    else:  # while Celery's per-worker limit lets each worker run at its limit: near twice it
        # (2.0 on a quiet machine; a loaded one read 1.40): above the one limit by over 20 %.
        assert rate > 1.2, rate


def test_the_plugins_faults_make_a_task_meet_group_full_and_rate_limited(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given the group's slots all taken and the rate limit's bucket drained for 2 s (what the
    # fence_group_full / fence_rate_limited fixtures do) ...
    spawn_worker("w", concurrency=2)
    full = GroupFull(redis_client, prefix)
    full.fill("limited", 3, hold=30)
    drained_at = time.time()
    RateLimited(redis_client, prefix).drain("20/s", seconds=2.0, task=client_app.rated.name)
    grouped, rated = f"gf:{uuid.uuid4().hex[:8]}", f"rl:{uuid.uuid4().hex[:8]}"
    client_app.grouped.delay(grouped, sleep=0.0)
    client_app.rated.delay(rated)

    def reasons(key: str) -> list[str | None]:
        return [
            t.reason for t in fence_store.transitions.history(key) if t.action == "retry_scheduled"
        ]

    # ... the grouped task is re-sent as group_full, and runs only once the slots are free,
    wait_until(lambda: "group_full" in reasons(grouped), 30, interval=0.1, what="group_full")

    def completed(key: str) -> bool:
        record = fence_store.get(key)
        return record is not None and record.status == "completed"

    assert not completed(grouped)
    full.free()
    # ... and the rated task is re-sent as rate_limited, and starts once a token is due.
    for key in (grouped, rated):
        wait_until(functools.partial(completed, key), 30, interval=0.1, what=f"{key} completed")
    assert "rate_limited" in reasons(rated)
    started = float(redis_client.lrange(f"{prefix}:starts", 0, -1)[0])
    assert started >= drained_at + 1.5
    assert fence_store.get(grouped).attempts == 1  # type: ignore[union-attr]
