"""``fence.run_step()`` / ``fence.step()`` / ``fence.checkpoint()`` against the real stores,
without workers: a step's row is written by a fenced statement in the step's own transaction, a
completed step is not run again, a stale attempt runs nothing of its next step."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_fence import CheckpointTooLarge, StaleGeneration
from celery_fence.body.fence import Fence
from celery_fence.errors import FenceError
from celery_fence.schema import CHECKPOINT
from celery_fence.store import Store
from tests.integration.test_transaction import _attempt
from tests.support.stores import EVERY_DRIVER, store_url

metadata = sa.MetaData()
effects = sa.Table(
    "t_step_effects",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("what", sa.String(64), nullable=False),
)


@pytest.fixture(params=EVERY_DRIVER)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return store_url(request, tmp_path)


@pytest.fixture
def tables(store: Store) -> Store:
    metadata.create_all(store.engine)
    return store


def _effects(store: Store, key: str) -> list[str]:
    with store.engine.connect() as conn:
        query = sa.select(effects.c.what).where(effects.c.key == key).order_by(effects.c.id)
        return list(conn.execute(query).scalars())


def _effect(fence: Fence, what: str) -> dict[str, Any]:
    with fence.transaction() as conn:
        conn.execute(effects.insert().values(key=fence.key, what=what))
    return {"did": what}


def _takeover(store: Store, fence: Fence) -> Fence:
    """A newer attempt of the same key (a higher generation registered)."""
    return _attempt(store, fence.key, generation=fence.generation + 1)


def test_a_completed_step_is_not_run_again(tables: Store) -> None:
    a = _attempt(tables)
    assert a.run_step("one", _effect, a, "one") == {"did": "one"}
    b = _takeover(tables, a)
    assert b.run_step("one", _effect, b, "one") == {"did": "one"}  # stored, not run
    assert b.run_step("two", _effect, b, "two") == {"did": "two"}
    assert _effects(tables, a.key) == ["one", "two"]
    names = [s.name for s in tables.steps.rows(a.key)]
    assert names == ["one", "two"]
    assert [s.generation for s in tables.steps.rows(a.key)] == [1, 2]


def test_a_stale_attempt_runs_nothing_of_its_next_step(tables: Store) -> None:
    a = _attempt(tables)
    a.run_step("one", _effect, a, "one")
    _takeover(tables, a)
    ran: list[str] = []
    with pytest.raises(StaleGeneration):
        a.run_step("two", lambda: ran.append("two"))
    assert ran == []
    with pytest.raises(StaleGeneration):  # and every later block or step stays refused
        a.run_step("three", lambda: ran.append("three"))
    with pytest.raises(StaleGeneration):
        _effect(a, "late")
    assert ran == [] and _effects(tables, a.key) == ["one"]


def test_a_step_refused_at_its_end_commits_nothing(tables: Store) -> None:
    """Taken over while the step runs: its writes and its row roll back together. (On SQLite
    the open step holds the write lock: nobody registers meanwhile.)"""
    if tables.dialect == "sqlite":
        pytest.skip("SQLite: a registration waits for the open step's write lock")
    a = _attempt(tables)

    def body() -> str:
        _effect(a, "inside")
        _takeover(tables, a)
        return "v"

    with pytest.raises(StaleGeneration):
        a.run_step("one", body)
    assert _effects(tables, a.key) == [] and tables.steps.rows(a.key) == []


def test_an_exception_rolls_the_step_back(tables: Store) -> None:
    a = _attempt(tables)

    def failing() -> None:
        _effect(a, "inside")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        a.run_step("one", failing)
    assert _effects(tables, a.key) == [] and tables.steps.rows(a.key) == []
    assert a.run_step("one", _effect, a, "again") == {"did": "again"}


def test_the_with_form_and_the_decorator(tables: Store) -> None:
    a = _attempt(tables)
    with a.step("one") as step:
        assert not step.done
        assert step.conn is not None
        step.conn.execute(effects.insert().values(key=a.key, what="with"))
        step.result = (1, 2)
    assert step.value == [1, 2]

    @a.step("two")
    def two(x: int) -> int:
        _effect(a, "decorated")
        return x * 2

    assert two(21) == 42
    b = _takeover(tables, a)
    with b.step("one") as again:
        assert again.done and again.value == [1, 2]
    assert b.step("two")(lambda x: 0)(21) == 42
    assert _effects(tables, a.key) == ["with", "decorated"]


def test_checkpoints_are_fenced(tables: Store) -> None:
    a = _attempt(tables)
    assert a.progress is None
    a.checkpoint({"after": 10})
    a.checkpoint({"after": 20})
    assert a.progress == {"after": 20}
    b = _takeover(tables, a)
    assert b.progress == {"after": 20}
    b.checkpoint({"after": 30})
    with pytest.raises(StaleGeneration):
        a.checkpoint({"after": 25})
    assert b.progress == {"after": 30}
    [row] = tables.steps.rows(a.key, values=True)
    assert (row.name, row.generation, row.value) == (CHECKPOINT, 2, {"after": 30})


def test_a_checkpoint_commits_with_its_block(tables: Store) -> None:
    a = _attempt(tables)
    with pytest.raises(RuntimeError), a.transaction() as conn:
        conn.execute(effects.insert().values(key=a.key, what="batch"))
        a.checkpoint({"after": 1})
        assert a.progress == {"after": 1}  # the block sees its own
        raise RuntimeError("rolled back")
    assert a.progress is None and _effects(tables, a.key) == []


def test_bad_input_is_refused_clearly(tables: Store) -> None:
    a = _attempt(tables)
    with pytest.raises(CheckpointTooLarge, match="fence_checkpoint_max_bytes=65536"):
        a.checkpoint({"rows": "x" * 70_000})
    with pytest.raises(FenceError, match="reserved"):
        a.step("@checkpoint")
    with pytest.raises(FenceError, match="non-empty"):
        a.step("")
    with pytest.raises(FenceError, match="not JSON"):
        a.run_step("obj", lambda: object())
    assert tables.steps.rows(a.key) == []


def test_requeue_completed_clears_steps_and_purge_deletes_them(tables: Store) -> None:
    a = _attempt(tables)
    a.run_step("one", lambda: 1)
    a.checkpoint({"after": 1})
    from celery_fence.store.records import Completion

    tables.end(a.key, Completion(generation=a.generation, attempt_id=a.attempt_id, result=1))
    assert len(tables.steps.rows(a.key)) == 2  # a completion that used none keeps them
    tables.admin.requeue(a.key, completed=True)
    assert tables.steps.rows(a.key) == []
    b = _attempt(tables, a.key, generation=2)
    b.run_step("one", lambda: 2)
    tables.end(b.key, Completion(generation=2, attempt_id=b.attempt_id, result=2))
    assert len(tables.steps.rows(a.key)) == 1
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
    assert tables.admin.purge(finished_before=later) >= 1
    assert tables.steps.rows(a.key) == []


def test_a_completion_that_used_steps_clears_them_in_its_transaction(tables: Store) -> None:
    from celery_fence.store.records import Completion

    a = _attempt(tables)
    a.run_step("one", lambda: 1)
    a.checkpoint({"after": 1})
    b = _takeover(tables, a)
    stale = Completion(a.generation, a.attempt_id, "stale", clear_steps=True)
    with pytest.raises(StaleGeneration):  # a refused completion clears nothing
        tables.end(a.key, stale)
    assert len(tables.steps.rows(a.key)) == 2
    tables.end(b.key, Completion(b.generation, b.attempt_id, "done", clear_steps=True))
    assert tables.steps.rows(a.key) == []
    assert tables.get(a.key).status == "completed"  # type: ignore[union-attr]


def test_a_step_name_per_key(tables: Store) -> None:
    a, other = _attempt(tables), _attempt(tables, f"tx:{uuid.uuid4().hex}")
    a.run_step("one", lambda: "a")
    assert other.run_step("one", lambda: "other") == "other"


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_the_bench_steps_mode_runs_tiny(db_url: str) -> None:
    """``python -m bench --steps`` measures every variant (tiny here; the lead measures)."""
    import io

    from bench import steps as bench_steps

    samples = bench_steps.measure(db_url, ops=3, rounds=1)
    out = io.StringIO()
    result = bench_steps.report(samples, ops=3, rounds=1, out=out)
    assert set(result["variants"]) == set(bench_steps.VARIANTS)
    assert all(len(samples[name]) == 3 for name in bench_steps.VARIANTS)
    assert "step-replay" in out.getvalue()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_fence_show_lists_steps_with_sizes_and_values_only_when_asked(
    tables: Store, worker_env: dict[str, str]
) -> None:
    import json

    from tests.integration.test_cli import fence_cli, ok

    a = _attempt(tables)
    a.run_step("charge", lambda: {"card": "secret-4242"})
    a.checkpoint({"after": 12})
    text = ok(fence_cli(worker_env, "show", a.key))
    assert "steps:" in text and "charge" in text and "@checkpoint" in text
    assert "secret-4242" not in text and "gen 1" in text
    assert "secret-4242" in ok(fence_cli(worker_env, "show", a.key, "--values"))
    doc = json.loads(ok(fence_cli(worker_env, "show", a.key, "--json")))
    assert [(s["name"], s["state"]) for s in doc["steps"]] == [
        ("charge", "done"),
        ("@checkpoint", "checkpoint"),
    ]
    assert "value" not in doc["steps"][0] and doc["steps"][0]["size"] > 0
