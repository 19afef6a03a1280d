"""The fenced store on SQLite and PostgreSQL: stale writes rejected, replays, regressions,
concurrent completions."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_fence.errors import ResultNotSerializable, StaleGeneration
from celery_fence.lease import LeaseStore
from celery_fence.schema import create_schema
from celery_fence.store import Store


def _key() -> str:
    return f"job:{uuid.uuid4().hex}"


def test_stale_completion_is_rejected_and_stores_nothing(store: Store) -> None:
    key = _key()
    store.register(key, generation=41, attempt_id="A", task_name="t")
    store.register(key, generation=42, attempt_id="B", task_name="t")
    with pytest.raises(StaleGeneration) as stale:
        store.complete(key, generation=41, attempt_id="A", result={"by": "A"})
    assert stale.value.context["stored_generation"] == 42
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation, record.attempt_id, record.result) == (
        "running",
        42,
        "B",
        None,
    )
    store.complete(key, generation=42, attempt_id="B", result={"by": "B"})
    record = store.get(key)
    assert record is not None and (record.status, record.result) == ("completed", {"by": "B"})


def test_a_completed_result_is_never_overwritten(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    store.complete(key, generation=1, attempt_id="A", result={"v": 1})
    with pytest.raises(StaleGeneration):  # same attempt again (a replayed completion)
        store.complete(key, generation=1, attempt_id="A", result={"v": 2})
    record = store.get(key)
    assert record is not None and record.result == {"v": 1}


def test_a_completed_job_replays(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    store.complete(key, generation=1, attempt_id="A", result=[1, 2, 3])
    reg = store.register(key, generation=2, attempt_id="B", task_name="t")
    assert reg.outcome == "completed"
    assert reg.record is not None and reg.record.result == [1, 2, 3]
    record = store.get(key)
    assert record is not None
    assert (record.generation, record.attempt_id, record.attempts) == (1, "A", 1)  # untouched


def test_register_counts_attempts_durably(store: Store) -> None:
    key = _key()
    for g in (1, 2, 3):
        reg = store.register(key, generation=g, attempt_id=f"a{g}", task_name="t")
        assert (reg.outcome, reg.attempts) == ("registered", g)


def test_registration_after_a_counter_regression_is_rejected_then_recovered(
    store: Store, leases: LeaseStore
) -> None:
    key = _key()
    # Given generation 5 registered, and a Redis that lost its counter (restart, failover):
    for _ in range(5):
        g = leases.claim(key, "old", 10_000)
        leases.release(leases.keys_for(key).lease, f"old:{g}")
    store.register(key, generation=5, attempt_id="old", task_name="t")
    leases.client.delete(leases.keys_for(key).generation)
    # When a new claim gets generation 1,
    g = leases.claim(key, "new", 10_000)
    assert g == 1
    reg = store.register(key, generation=g, attempt_id="new", task_name="t")
    # then the store rejects it and says what it holds,
    assert (reg.outcome, reg.stored_generation) == ("stale", 5)
    # and raising the counter above the store's and claiming again recovers.
    leases.release(leases.keys_for(key).lease, f"new:{g}")
    leases.raise_generation(key, reg.stored_generation)
    g = leases.claim(key, "new", 10_000)
    assert g == 6
    assert (
        store.register(key, generation=g, attempt_id="new", task_name="t").outcome == "registered"
    )
    with pytest.raises(StaleGeneration):
        store.complete(key, generation=5, attempt_id="old", result="late")
    store.complete(key, generation=6, attempt_id="new", result="fresh")
    record = store.get(key)
    assert record is not None and record.result == "fresh"


def test_concurrent_completions_from_two_attempts_exactly_one_wins(store: Store) -> None:
    for _ in range(10):
        key = _key()
        store.register(key, generation=1, attempt_id="A", task_name="t")
        store.register(key, generation=2, attempt_id="B", task_name="t")
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def finish(
            generation: int,
            attempt: str,
            key: str = key,
            barrier: threading.Barrier = barrier,
            outcomes: dict[str, str] = outcomes,
        ) -> None:
            barrier.wait()
            try:
                store.complete(key, generation=generation, attempt_id=attempt, result=attempt)
                outcomes[attempt] = "won"
            except StaleGeneration:
                outcomes[attempt] = "rejected"

        threads = [
            threading.Thread(target=finish, args=(1, "A")),
            threading.Thread(target=finish, args=(2, "B")),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert outcomes == {"A": "rejected", "B": "won"}
        record = store.get(key)
        assert record is not None and record.result == "B"


def test_concurrent_registrations_of_the_same_generation_one_wins(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def reg(attempt: str) -> None:
        barrier.wait()
        outcomes.append(
            store.register(key, generation=2, attempt_id=attempt, task_name="t").outcome
        )

    threads = [threading.Thread(target=reg, args=(f"x{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(outcomes) == ["registered", "stale", "stale", "stale"]


def test_non_json_result_is_refused_with_a_clear_error(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    with pytest.raises(ResultNotSerializable, match="not JSON"):
        store.complete(key, generation=1, attempt_id="A", result={"when": object()})
    with pytest.raises(ResultNotSerializable):
        store.complete(key, generation=1, attempt_id="A", result=float("nan"))
    record = store.get(key)
    assert record is not None and record.status == "running"


def test_transitions_are_recorded_with_the_state_change(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    store.register(key, generation=2, attempt_id="B", task_name="t")
    with pytest.raises(StaleGeneration):
        store.complete(key, generation=1, attempt_id="A", result=None)
    store.complete(key, generation=2, attempt_id="B", result=None)
    assert [(t.action, t.generation, t.attempt_id) for t in store.history(key)] == [
        ("claimed", 1, "A"),
        ("claimed", 2, "B"),
        ("completed", 2, "B"),
    ]


def test_unfenced_mode_accepts_stale_writes_for_demonstration(db_url: str) -> None:
    unfenced = Store(db_url, unfenced=True)
    key = _key()
    unfenced.register(key, generation=1, attempt_id="A", task_name="t")
    unfenced.register(key, generation=2, attempt_id="B", task_name="t")
    unfenced.complete(key, generation=1, attempt_id="A", result="stale")  # accepted: no fence
    record = unfenced.get(key)
    assert record is not None and record.result == "stale"
    unfenced.dispose()


def _create_schema_at_once(url: str, barrier: Any, errors: Any) -> None:
    engine = sa.create_engine(url)
    barrier.wait()
    try:
        create_schema(engine)
    except Exception as exc:  # reported to the parent, which fails the test with it
        errors.put(f"{type(exc).__name__}: {exc}")
    finally:
        engine.dispose()


def test_processes_creating_the_schema_at_once_on_a_fresh_sqlite_file_all_succeed(
    tmp_path: Path,
) -> None:
    # Given 6 processes (worker children on their first task) and fresh SQLite files,
    ctx = multiprocessing.get_context("spawn")
    for n in range(3):
        url = f"sqlite:///{tmp_path / f'fresh-{n}.sqlite3'}"
        barrier, errors = ctx.Barrier(6), ctx.Queue()
        procs = [
            ctx.Process(target=_create_schema_at_once, args=(url, barrier, errors))
            for _ in range(6)
        ]
        # When they all create the schema at the same moment,
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        # then none fails ("table already exists" for the losers of the race) and the tables
        # are there.
        assert [p.exitcode for p in procs] == [0] * 6
        failures = [errors.get(timeout=1) for _ in range(errors.qsize())]
        assert failures == [], failures
        assert {"fence_jobs", "fence_transitions", "fence_outbox"} <= set(
            sa.inspect(sa.create_engine(url)).get_table_names()
        )


def test_a_message_kept_dead_keeps_a_request_the_database_refuses_encoded(store: Store) -> None:
    # Given a request holding NUL (PostgreSQL's jsonb refuses it; SQLite stores it as is)
    key = _key()
    request = {"task": "t", "args": ["before\x00after"], "kwargs": {}}
    # When a message that cannot run is kept as a dead job (expired, revoked, unkeyed)
    store.end_unrun(key, task_name="t", request=request, reason="expired")
    # Then the job is dead, and its request reads back as it was sent
    record = store.get(key)
    assert record is not None and record.status == "dead"
    assert record.request == request
