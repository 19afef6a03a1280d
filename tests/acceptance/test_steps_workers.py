"""Fenced steps and checkpoints with real workers and real signals (issue #37).

- A is paused (SIGSTOP) inside step 2 of 3; B takes the key over and completes: B skips step 1's
  body, step 3's effect happens once, and A, resumed, runs nothing more. The control arm (the
  same body without steps) shows A running step 3 again.
- A checkpointed export of 10^5 rows, killed (SIGKILL) at random points, finishes with every
  row exported once and less than one checkpoint interval of work repeated per kill; the control
  arm (no checkpoint) starts from zero and exports rows twice.

The workload is tests/support/steps_app.py (its ledger: Redis; its effects: tables). PostgreSQL
only: on SQLite a paused holder of a fenced block holds the database's write lock, so nobody
takes over until it resumes (docs/design.md).
"""

from __future__ import annotations

import random
import time
import uuid
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from celery_fence.store import Store
from celery_fence.testing import faults
from tests.support import ledger
from tests.support.worker import SpawnWorker, Worker, wait_until

pytestmark = pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)

INCLUDE = ("--include", "tests.support.steps_app")
TTL = 2.0


def _send(client_app: ModuleType, task: str, key: str, **kwargs: Any) -> None:
    client_app.app.send_task(f"tests.support.steps_app.{task}", args=[key], kwargs=kwargs)


def _worker(spawn_worker: SpawnWorker, name: str) -> Worker:
    return spawn_worker(name, extra_args=INCLUDE, FENCE_T_TTL=str(TTL))


def _completed(store: Store, key: str) -> bool:
    record = store.get(key)
    return record is not None and record.status == "completed"


def _step_effects(store: Store, key: str) -> list[tuple[int, int]]:
    with store.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT step, generation FROM t_saga_effects WHERE key = :key ORDER BY id"),
            {"key": key},
        )
        return [(int(r[0]), int(r[1])) for r in rows]


def _paused_in_step_2(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    store: Store,
    *,
    fenced: bool,
) -> tuple[str, list[str]]:
    """A runs step 1, hangs in step 2 and is SIGSTOPped; B takes over and completes; A is
    resumed and settles. The key and the ledger's step runs ``<step>:<generation>``."""
    key = f"saga-{uuid.uuid4().hex[:8]}"
    faults.arm(redis_client, prefix, "hang", key, "2")
    a = _worker(spawn_worker, "a")
    _send(client_app, "saga", key, fenced=fenced)
    wait_until(
        lambda: ledger.entries(redis_client, f"{prefix}:hung:{key}") == ["2"],
        30,
        what="A inside step 2",
    )
    a.pause()
    _worker(spawn_worker, "b")
    _send(client_app, "saga", key, fenced=fenced)  # the duplicate B runs once A's lease is gone
    wait_until(lambda: _completed(store, key), 60, what="B completed the job")
    assert store.get(key).generation == 2  # type: ignore[union-attr]
    faults.arm(redis_client, prefix, "unhang", key)
    a.resume()
    wait_until(
        lambda: ledger.entries(redis_client, f"{prefix}:resumed:{key}") == ["2"],
        30,
        what="A went on after its pause",
    )
    # A settles (stale or lease lost): its transition is recorded after B's completion.
    wait_until(
        lambda: any(
            t.generation == 1 and t.action in ("stale", "lost")
            for t in store.transitions.history(key)
        ),
        30,
        what="A settled",
    )
    return key, ledger.entries(redis_client, f"{prefix}:step_runs:{key}")


def test_a_paused_inside_step_2_of_3_runs_nothing_more_and_b_skips_step_1(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    key, runs = _paused_in_step_2(
        spawn_worker, client_app, redis_client, prefix, fence_store, fenced=True
    )
    print(f"fenced steps: step runs {runs}, step writes {_step_effects(fence_store, key)}")
    # B skipped step 1's body; A ran nothing after resuming (no step 3 from generation 1)
    assert runs == ["1:1", "2:1", "2:2", "3:2"]
    # each step's write committed once: step 1 by A, steps 2 and 3 by B
    assert _step_effects(fence_store, key) == [(1, 1), (2, 2), (3, 2)]
    assert fence_store.steps.rows(key) == []  # cleared by B's completion
    assert fence_store.get(key).result == [  # type: ignore[union-attr]
        {"step": 1, "generation": 1},
        {"step": 2, "generation": 2},
        {"step": 3, "generation": 2},
    ]


def test_control_arm_unfenced_steps_a_runs_step_3_again(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    key, runs = _paused_in_step_2(
        spawn_worker, client_app, redis_client, prefix, fence_store, fenced=False
    )
    print(f"control arm: step runs {runs}, step writes {_step_effects(fence_store, key)}")
    assert runs.count("1:2") == 1  # B ran step 1 again
    assert "3:1" in runs  # A, resumed, ran step 3's external effect after B had
    # and its plain write of step 3 lands too (A's "lost" transition, which the helper waits
    # for, is recorded by the renewal thread and may come before the body's write)
    wait_until(lambda: (3, 1) in _step_effects(fence_store, key), 15, what="A's write of step 3")
    assert sorted(_step_effects(fence_store, key)).count((3, 1)) == 1


def _export_rows(store: Store, key: str) -> tuple[int, int]:
    """(distinct rows exported, rows exported more than once)."""
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT count(DISTINCT row_id), count(*) - count(DISTINCT row_id) "
                "FROM t_export_rows WHERE key = :key"
            ),
            {"key": key},
        ).one()
    return int(row[0]), int(row[1])


def _batches(redis_client: redis.Redis, prefix: str, key: str) -> list[tuple[int, int]]:
    return [
        (int(a), int(b))
        for a, b in (
            e.split(":") for e in ledger.entries(redis_client, f"{prefix}:export_work:{key}")
        )
    ]


def _killed_export(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    store: Store,
    *,
    rows: int,
    batch: int,
    kills: int,
    checkpoint: bool,
) -> tuple[str, int]:
    """Export ``rows`` with ``kills`` SIGKILLs at random batches; the key and the rows the
    workers started more than once (repeated work)."""
    key = f"export-{uuid.uuid4().hex[:8]}"
    rng = random.Random()
    total = rows // batch
    for n in range(kills + 1):
        worker = _worker(spawn_worker, f"w{n}")
        _send(client_app, "export", key, rows=rows, batch=batch, checkpoint=checkpoint)
        if n == kills:
            break
        seen = len(_batches(redis_client, prefix, key))
        # at least two batches committed before the kill: the control arm's repeat is >= 2
        point = seen + rng.randint(3, max(3, total // (kills + 1)))

        def started(point: int = point) -> bool:
            return len(_batches(redis_client, prefix, key)) >= point

        wait_until(started, 60, what=f"batch {point} started")
        time.sleep(rng.uniform(0, 0.05))
        worker.kill()
    wait_until(lambda: _completed(store, key), 120, what="the export completed")
    work = sum(b - a for a, b in _batches(redis_client, prefix, key))
    return key, work - rows


def test_a_checkpointed_export_killed_at_random_points_exports_every_row_once(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    rows, batch, kills = 100_000, 5_000, 2
    key, repeated = _killed_export(
        spawn_worker,
        client_app,
        redis_client,
        prefix,
        fence_store,
        rows=rows,
        batch=batch,
        kills=kills,
        checkpoint=True,
    )
    print(f"checkpointed export: {kills} kills, {repeated} rows of work repeated (batch {batch})")
    assert _export_rows(fence_store, key) == (rows, 0)
    assert 0 <= repeated <= kills * batch  # at most the one batch in flight, per kill
    assert fence_store.get(key).result == rows  # type: ignore[union-attr]


def test_control_arm_no_checkpoint_repeats_the_work_from_zero(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    rows, batch = 100_000, 5_000
    key, repeated = _killed_export(
        spawn_worker,
        client_app,
        redis_client,
        prefix,
        fence_store,
        rows=rows,
        batch=batch,
        kills=1,
        checkpoint=False,
    )
    distinct, duplicates = _export_rows(fence_store, key)
    print(f"control arm: {repeated} rows of work repeated, {duplicates} rows exported twice")
    assert distinct == rows
    assert repeated >= 2 * batch and duplicates >= 2 * batch  # everything before the kill again
