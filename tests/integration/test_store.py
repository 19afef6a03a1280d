"""The fenced store on SQLite and PostgreSQL: stale writes rejected, replays, regressions,
concurrent completions."""

from __future__ import annotations

import datetime as dt
import itertools
import multiprocessing
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_fence.chaos.arms import UnfencedStore
from celery_fence.errors import ResultNotSerializable, StaleGeneration, StoreError
from celery_fence.leases.lease import LeaseStore
from celery_fence.schema import create_schema
from celery_fence.store import Effect, Store, probe, utcnow
from celery_fence.store.probe import PROBE_KEY_PREFIX
from celery_fence.store.records import (
    Completion,
    Dead,
    DeadRefused,
    DeadStranded,
    DeadUnregistered,
    DeadUnrun,
    RetryScheduled,
)
from tests.support.stores import EVERY_DRIVER, store_url


@pytest.fixture(params=EVERY_DRIVER)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLite, and PostgreSQL through psycopg2 and through psycopg 3."""
    return store_url(request, tmp_path)


def _key() -> str:
    return f"job:{uuid.uuid4().hex}"


def test_stale_completion_is_rejected_and_stores_nothing(store: Store) -> None:
    key = _key()
    store.register(key, generation=41, attempt_id="A", task_name="t")
    store.register(key, generation=42, attempt_id="B", task_name="t")
    with pytest.raises(StaleGeneration) as stale:
        store.end(key, Completion(generation=41, attempt_id="A", result={"by": "A"}))
    assert stale.value.context["stored_generation"] == 42
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation, record.attempt_id, record.result) == (
        "running",
        42,
        "B",
        None,
    )
    store.end(key, Completion(generation=42, attempt_id="B", result={"by": "B"}))
    record = store.get(key)
    assert record is not None and (record.status, record.result) == ("completed", {"by": "B"})


def test_a_completed_result_is_never_overwritten(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    store.end(key, Completion(generation=1, attempt_id="A", result={"v": 1}))
    with pytest.raises(StaleGeneration):  # same attempt again (a replayed completion)
        store.end(key, Completion(generation=1, attempt_id="A", result={"v": 2}))
    record = store.get(key)
    assert record is not None and record.result == {"v": 1}


def test_a_completed_job_replays(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    store.end(key, Completion(generation=1, attempt_id="A", result=[1, 2, 3]))
    reg = store.register(key, generation=2, attempt_id="B", task_name="t")
    assert reg.outcome == "completed"
    assert reg.record is not None and reg.record.result == [1, 2, 3]
    record = store.get(key)
    assert record is not None
    assert (record.generation, record.attempt_id, record.attempts) == (1, "A", 1)  # untouched


def test_an_operators_rerun_of_a_completed_job_keeps_its_result_until_the_new_one(
    store: Store,
) -> None:
    # Given a completed job
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t", request_json='{"a": 1}')
    store.end(key, Completion(generation=1, attempt_id="A", result={"v": 1}))
    # When an operator requeues it on purpose: pending, the old result still stored ...
    before = store.admin.requeue(key, completed=True)
    pending = store.get(key)
    assert pending is not None and (pending.status, pending.result) == ("pending", {"v": 1})
    # ... and its send failed: back to completed as it was
    store.admin.restore_finished(before, reason="send failed")
    restored = store.get(key)
    assert restored is not None and (restored.status, restored.result) == ("completed", {"v": 1})
    assert restored.attempts == before.attempts and restored.finished_at is not None
    # Sent this time: the next attempt registers and its completion replaces the result
    store.admin.requeue(key, completed=True)
    store.register(key, generation=2, attempt_id="B", task_name="t")
    store.end(key, Completion(generation=2, attempt_id="B", result={"v": 2}))
    record = store.get(key)
    assert record is not None and (record.status, record.result) == ("completed", {"v": 2})
    # A plain requeue of a completed job, or a re-run of a dead one, is refused
    with pytest.raises(StoreError):
        store.admin.requeue(key)


def test_purge_goes_in_batches_oldest_first_and_resumes_where_it_stopped(store: Store) -> None:
    import datetime as dt

    # Given (older finished jobs of the shared database purged first) 6 completed jobs with
    # history, and one requeued (pending) job of the same age
    store.admin.purge(finished_before=dt.datetime.now(dt.timezone.utc))
    keys = []
    for i in range(7):
        key = _key()
        store.register(key, generation=1, attempt_id="A", task_name=f"purge-{i}")
        store.end(key, Completion(generation=1, attempt_id="A", result=i))
        keys.append(key)
    rerun = keys.pop()
    store.admin.requeue(rerun, completed=True)
    cutoff = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=1)
    ours = set(keys)
    # When a purge of batches of 2 is stopped after its first batch (its callback raises)
    seen: list[int] = []

    def stop_after_one(total: int) -> None:
        seen.append(total)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.admin.purge(finished_before=cutoff, batch_size=2, progress=stop_after_one)
    left = {k for k in ours if store.get(k) is not None}
    # Then that batch is gone for good (history too), the rest untouched
    assert seen == [2] and len(ours - left) == 2
    assert all(store.transitions.history(k) == [] for k in ours - left)
    # And run again it goes on, batch by batch, and keeps the unfinished job
    totals: list[int] = []
    store.admin.purge(finished_before=cutoff, batch_size=2, progress=totals.append)
    assert all(store.get(k) is None for k in ours)
    steps = [b - a for a, b in itertools.pairwise([0, *totals])]
    assert totals and all(0 < step <= 2 for step in steps)
    pending = store.get(rerun)
    assert (
        pending is not None
        and pending.status == "pending"
        and store.transitions.history(rerun) != []
    )


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
        store.end(key, Completion(generation=5, attempt_id="old", result="late"))
    store.end(key, Completion(generation=6, attempt_id="new", result="fresh"))
    record = store.get(key)
    assert record is not None and record.result == "fresh"


def test_concurrent_completions_from_two_attempts_exactly_one_wins(store: Store) -> None:
    # Given generation 1 running (A), and at the same moment A completing while B registers
    # generation 2 and completes: whichever statement lands first decides, and either may,
    for _ in range(10):
        key = _key()
        store.register(key, generation=1, attempt_id="A", task_name="t")
        barrier = threading.Barrier(2)
        outcomes: dict[str, str] = {}

        def finish_a(
            key: str = key,
            barrier: threading.Barrier = barrier,
            outcomes: dict[str, str] = outcomes,
        ) -> None:
            barrier.wait()
            try:
                store.end(key, Completion(generation=1, attempt_id="A", result="A"))
                outcomes["A"] = "won"
            except StaleGeneration:
                outcomes["A"] = "rejected"

        def take_over_b(
            key: str = key,
            barrier: threading.Barrier = barrier,
            outcomes: dict[str, str] = outcomes,
        ) -> None:
            barrier.wait()
            registration = store.register(key, generation=2, attempt_id="B", task_name="t")
            if registration.outcome != "registered":  # A completed first: nothing to take
                outcomes["B"] = "rejected"
                return
            try:
                store.end(key, Completion(generation=2, attempt_id="B", result="B"))
                outcomes["B"] = "won"
            except StaleGeneration:
                outcomes["B"] = "rejected"

        threads = [threading.Thread(target=finish_a), threading.Thread(target=take_over_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        # then exactly one of them won, its result is the stored one, completed once.
        assert sorted(outcomes.values()) == ["rejected", "won"], outcomes
        (winner,) = [a for a, o in outcomes.items() if o == "won"]
        record = store.get(key)
        assert record is not None and record.status == "completed" and record.result == winner
        assert [t.action for t in store.transitions.history(key)].count("completed") == 1


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
        store.end(key, Completion(generation=1, attempt_id="A", result={"when": object()}))
    with pytest.raises(ResultNotSerializable):
        store.end(key, Completion(generation=1, attempt_id="A", result=float("nan")))
    record = store.get(key)
    assert record is not None and record.status == "running"


def test_transitions_are_recorded_with_the_state_change(store: Store) -> None:
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    store.register(key, generation=2, attempt_id="B", task_name="t")
    with pytest.raises(StaleGeneration):
        store.end(key, Completion(generation=1, attempt_id="A", result=None))
    store.end(key, Completion(generation=2, attempt_id="B", result=None))
    assert [(t.action, t.generation, t.attempt_id) for t in store.transitions.history(key)] == [
        ("claimed", 1, "A"),
        ("claimed", 2, "B"),
        ("completed", 2, "B"),
    ]


def test_the_unfenced_control_arm_accepts_stale_writes(db_url: str) -> None:
    unfenced = UnfencedStore(db_url)
    key = _key()
    unfenced.register(key, generation=1, attempt_id="A", task_name="t")
    unfenced.register(key, generation=2, attempt_id="B", task_name="t")
    stale = Completion(generation=1, attempt_id="A", result="stale")
    unfenced.end(key, stale)  # accepted: no fence
    record = unfenced.get(key)
    assert record is not None and record.result == "stale"
    unfenced.dispose()


def _create_schemas_at_once(urls: list[str], barrier: Any, errors: Any) -> None:
    for url in urls:  # one round per file: the processes meet at the barrier, then race
        engine = sa.create_engine(url)
        barrier.wait(timeout=60)
        try:
            create_schema(engine)
        except Exception as exc:  # reported to the parent, which fails the test with it
            errors.put(f"{url}: {type(exc).__name__}: {exc}")
        finally:
            engine.dispose()


def test_processes_creating_the_schema_at_once_on_a_fresh_sqlite_file_all_succeed(
    tmp_path: Path,
) -> None:
    # Given 6 processes (worker children on their first task) and 3 fresh SQLite files,
    ctx = multiprocessing.get_context("spawn")
    urls = [f"sqlite:///{tmp_path / f'fresh-{n}.sqlite3'}" for n in range(3)]
    barrier, errors = ctx.Barrier(6), ctx.Queue()
    procs = [
        ctx.Process(target=_create_schemas_at_once, args=(urls, barrier, errors)) for _ in range(6)
    ]
    # When they all create the schema at the same moment, on each file in turn (a fresh engine
    # each time, so each round is a first creation in every process),
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    # then none fails ("table already exists" for the losers of the race) and the tables
    # are there.
    assert [p.exitcode for p in procs] == [0] * 6
    failures = [errors.get(timeout=1) for _ in range(errors.qsize())]
    assert failures == [], failures
    for url in urls:
        engine = sa.create_engine(url)
        assert {"fence_jobs", "fence_transitions", "fence_outbox"} <= set(
            sa.inspect(engine).get_table_names()
        )
        engine.dispose()


def _state(store: Store, key: str) -> tuple[str, int, str, int]:
    record = store.get(key)
    assert record is not None
    return (record.status, record.generation, record.attempt_id, record.attempts)


def test_every_statement_of_the_task_path_the_operators_and_the_recovery_runs(
    db_url: str, request: pytest.FixtureRequest
) -> None:
    """Each fenced write, check and read the store has, once, judged by the state it leaves (on
    each driver: a statement a driver cannot run fails here, not in a worker)."""
    store = Store(db_url)
    request.addfinalizer(store.dispose)
    later = utcnow() + dt.timedelta(hours=1)
    # The task's path: register, the fenced commit check, retry, dead (with and without error).
    key = _key()
    store.register(key, generation=2, attempt_id="A", task_name="t", request={"args": [1]})
    assert _state(store, key) == ("running", 2, "A", 1)
    with store.db.tx() as conn:
        assert store.blocks.commit_check(conn, key, generation=2, attempt_id="A")
        assert not store.blocks.commit_check(conn, key, generation=1, attempt_id="A")
    store.end(
        key,
        RetryScheduled(
            generation=2, attempt_id="A", error=OSError("x"), retry_at=later, reason="r"
        ),
    )
    store.register(key, generation=3, attempt_id="B", task_name="t")
    store.end(
        key, RetryScheduled(generation=3, attempt_id="B", error=None, retry_at=later, reason="r")
    )
    store.register(key, generation=4, attempt_id="C", task_name="t")
    store.end(key, Dead(generation=4, attempt_id="C", error=None, reason="d", attempts=7))
    assert _state(store, key) == ("dead", 4, "C", 7)
    # The operator's requeue and its undo, then a completion with a staged effect.
    before = store.admin.requeue(key)
    store.admin.restore_finished(before, reason="send failed")
    assert _state(store, key) == ("dead", 4, "C", 7)
    store.admin.requeue(key)
    store.register(key, generation=5, attempt_id="D", task_name="t")
    effect = Effect(name="mail", payload={"to": "x"}, idempotency_key=f"{key}:mail")
    store.end(key, Completion(generation=5, attempt_id="D", result={"ok": True}, effects=[effect]))
    record = store.get(key)
    assert record is not None and (record.status, record.result) == ("completed", {"ok": True})
    assert store.transitions.last_exit(key) == "completed"
    # A job dead unregistered, a refused registration, a message never run.
    unregistered = _key()
    assert store.end(
        unregistered,
        DeadUnregistered(task_name="t", request=None, error=ValueError("k"), reason="key"),
    )
    refused = _key()
    store.end(
        refused,
        DeadRefused(
            generation=1,
            attempt_id="R",
            task_name="t",
            request_json='{"a": 1}',
            error=ValueError("nul"),
            reason="refused",
        ),
    )
    unrun = _key()
    store.register(unrun, generation=2, attempt_id="U", task_name="t")
    store.end(
        unrun, RetryScheduled(generation=2, attempt_id="U", error=None, retry_at=later, reason="r")
    )
    store.end(unrun, DeadUnrun(task_name="t", request=None, reason="expired"))
    store.record(unrun, action="lost", generation=2, attempt_id="U", reason="deadline")
    assert [_state(store, k)[0] for k in (unregistered, refused, unrun)] == ["dead"] * 3
    assert store.transitions.history(unrun)[-1].action == "lost"
    # The recovery: stranded jobs taken for a re-send, or dead.
    strays = [_key(), _key()]
    for stray in strays:
        store.register(stray, generation=2, attempt_id="S", task_name=strays[0])
    found = store.admin.stranded(older_than=0, now=later, task_name=strays[0])
    assert sorted(r.key for r in found) == sorted(strays)
    by_key = {r.key: r for r in found}
    assert store.admin.take_for_resend(by_key[strays[0]], reason="stranded") is not None
    assert store.end(
        by_key[strays[1]].key,
        DeadStranded(by_key[strays[1]], error=ValueError("no request"), reason="x"),
    )
    assert [_state(store, k)[0] for k in strays] == ["pending", "dead"]
    # The outbox: claim, fail, claim again, deliver; a dead row requeued; purge.
    (row,) = store.outbox_rows.claim(claimer="s1", claim_ttl=30, key=key)
    assert store.outbox_rows.fail(row.id, claimer="s1", error=OSError("down"), retry_in=0)
    (row,) = store.outbox_rows.claim(claimer="s2", claim_ttl=30, key=key)
    assert store.outbox_rows.mark_delivered(row.id, claimer="s2")
    assert not store.outbox_rows.requeue(row.id)  # delivered, not dead
    assert store.outbox_rows.purge(delivered_before=later) >= 1
    assert store.outbox_rows.rows(key=key) == []
    assert store.admin.purge(finished_before=later) >= 5
    assert store.get(key) is None and store.transitions.history(key) == []


@pytest.mark.parametrize("db_url", ["postgresql", "psycopg3"], indirect=True)
def test_a_connection_that_lost_its_prepared_statements_prepares_them_again(db_url: str) -> None:
    # Given a store on one pooled connection whose fenced writes are prepared on it,
    store = Store(db_url, engine_options={"pool_size": 1, "max_overflow": 0})
    key = _key()
    store.register(key, generation=1, attempt_id="A", task_name="t")
    # when they are dropped behind the driver's back (a pooler's DISCARD ALL, a server swap),
    raw = store.engine.raw_connection()
    try:
        if store.db.driver == "psycopg":
            driver_conn: Any = raw.dbapi_connection
            driver_conn.pgconn.exec_(b"DEALLOCATE ALL")  # psycopg 3 does not see it
        else:
            cursor = raw.cursor()
            cursor.execute("DEALLOCATE ALL")
            cursor.close()
    finally:
        raw.close()
    # then the next writes on that connection prepare again and go through.
    store.register(key, generation=2, attempt_id="B", task_name="t")
    store.end(key, Completion(generation=2, attempt_id="B", result={"by": "B"}))
    record = store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 2)
    store.dispose()


@pytest.mark.parametrize(
    "settings",
    [{}, {"record_transitions": False}],
    ids=["default", "unrecorded"],
)
def test_the_write_probe_runs_a_tasks_writes_and_leaves_nothing(
    db_url: str, settings: dict[str, Any]
) -> None:
    store = Store(db_url, **settings)
    before = store.admin.list_jobs(limit=10_000)
    assert "rolled back" in probe.write_probe(store)
    assert store.admin.list_jobs(limit=10_000) == before
    assert [r for r in store.outbox_rows.rows() if r.key.startswith(PROBE_KEY_PREFIX)] == []
    store.dispose()


def test_the_write_probe_fails_on_a_store_without_the_fence_and_leaves_nothing(db_url: str) -> None:
    store = UnfencedStore(db_url)
    before = store.admin.list_jobs(limit=10_000)
    with pytest.raises(StoreError, match="stale completion was accepted: the fence is off"):
        probe.write_probe(store)
    assert store.admin.list_jobs(limit=10_000) == before
    store.dispose()


def test_the_write_probe_fails_on_a_store_it_cannot_write(tmp_path: Path) -> None:
    path = tmp_path / "fence.sqlite3"
    Store(f"sqlite:///{path}").create_schema()
    read_only = Store(f"sqlite:///file:{path}?mode=ro&uri=true")
    with pytest.raises(StoreError, match=r"registration failed: OperationalError: .*readonly"):
        probe.write_probe(read_only)
    read_only.dispose()


def test_a_message_kept_dead_keeps_a_request_the_database_refuses_encoded(store: Store) -> None:
    # Given a request holding NUL (PostgreSQL's jsonb refuses it; SQLite stores it as is)
    key = _key()
    request = {"task": "t", "args": ["before\x00after"], "kwargs": {}}
    # When a message that cannot run is kept as a dead job (expired, revoked, unkeyed)
    store.end(key, DeadUnrun(task_name="t", request=request, reason="expired"))
    # Then the job is dead, and its request reads back as it was sent
    record = store.get(key)
    assert record is not None and record.status == "dead"
    assert record.request == request


def test_a_revoked_message_of_a_shared_key_ends_the_job_only_when_the_job_waits_for_it(
    store: Store,
) -> None:
    # Given two fenced jobs (a fence_key other messages may share) waiting for their retry, each
    # registered by the message with task id "m1" ...
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    own, other = _key(), _key()
    for key in (own, other):
        request = {"task": "t", "id": "m1", "args": [key], "kwargs": {}}
        store.register(key, generation=1, attempt_id="A", task_name="t", request=request)
        store.end(
            key,
            RetryScheduled(generation=1, attempt_id="A", error=None, retry_at=later, reason="r"),
        )
    # When the revoked message is the job's own retry (task id "m1"), the job goes dead;
    store.end(
        own,
        DeadUnrun(task_name="t", request=None, reason="revoked", only_insert=True, message_id="m1"),
    )
    # when it is another message of the key ("m2"), the job keeps waiting for its own.
    store.end(
        other,
        DeadUnrun(task_name="t", request=None, reason="revoked", only_insert=True, message_id="m2"),
    )
    assert [_state(store, k)[0] for k in (own, other)] == ["dead", "retrying"]
    assert [t.action for t in store.transitions.history(own)][-1] == "dead"
    assert [(t.action, t.reason) for t in store.transitions.history(other)][-1] == (
        "revoked",
        "message not run",
    )


def test_re_sends_nobody_claimed_are_counted_per_key_in_one_statement(store: Store) -> None:
    from celery_fence.actions import Action

    # Given a claimed key re-sent twice since, a never-claimed key re-sent once, a key re-sent
    # and then claimed again, and a key never re-sent
    tag = uuid.uuid4().hex[:8]
    twice, once, reclaimed, never = (f"{name}:{tag}" for name in ("twice", "once", "again", "no"))
    store.register(twice, generation=1, attempt_id="a", task_name="t")
    store.register(reclaimed, generation=1, attempt_id="a", task_name="t")
    store.register(never, generation=1, attempt_id="a", task_name="t")
    for key in (twice, twice, once, reclaimed):
        store.record(key, action=Action.RECOVERED, reason="stranded running")
    store.register(reclaimed, generation=2, attempt_id="b", task_name="t")
    # Then one call counts each: only the re-sends after the key's newest claim
    counts = store.admin.resends_unclaimed([twice, once, reclaimed, never])
    assert counts == {twice: 2, once: 1, reclaimed: 0, never: 0}
    assert store.admin.resends_unclaimed([]) == {}


def test_on_sqlite_an_ending_is_synced_to_disk_and_a_registration_is_not(
    tmp_path: Path,
) -> None:
    """SQLite's WAL with ``synchronous=NORMAL`` syncs no commit: a power loss after the ack could
    take a completion back (and with it the job). Every ending runs with ``synchronous=FULL``
    (the WAL fsynced at its COMMIT); a registration keeps NORMAL (its loss costs a re-run)."""
    store = Store(f"sqlite:///{tmp_path / 'sync.sqlite3'}")
    seen: list[str] = []

    def trace(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        dbapi_conn.set_trace_callback(seen.append)

    sa.event.listen(store.engine, "checkout", trace)
    key = f"sync:{uuid.uuid4().hex[:8]}"
    # Given a registration,
    store.register(key, generation=1, attempt_id="A", task_name="t")
    registration = list(seen)
    seen.clear()
    # when the job completes,
    store.end(key, Completion(generation=1, attempt_id="A", result={"ok": True}))
    # then the registration ran on the connection's default (NORMAL), not synced,
    assert registration and not any("synchronous" in s for s in registration), registration
    # and the completion's statements ran between FULL and the return to NORMAL.
    pragmas = [s for s in seen if "synchronous" in s]
    assert pragmas == ["PRAGMA synchronous=FULL", "PRAGMA synchronous=NORMAL"], seen
    first, last = seen.index(pragmas[0]), seen.index(pragmas[1])
    assert any("UPDATE" in s.upper() for s in seen[first:last]), seen
    record = store.get(key)
    assert record is not None and record.status == "completed"
    store.dispose()
