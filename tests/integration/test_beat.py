"""The fenced beat scheduler in this process, with a clock of the test's own: the missed-tick
policy after every replica was down, a second replica's pass sending nothing already recorded,
the refusals, the store's forward-only record and ``fence beat ls``. Messages go to the real
Redis broker (a queue of the test's own) and are read back from it."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.schedules import schedule

from celery_fence import FencedTask, migrate
from celery_fence.beat import Scheduler
from celery_fence.errors import ConfigurationError
from celery_fence.ops.recovery import RECOVER_TASK
from celery_fence.process.runtime import runtime
from celery_fence.schema import metadata
from celery_fence.store import Store
from celery_fence.testing.broker import delete_queues
from tests.integration.test_cli import fence_cli, ok
from tests.support.env import BROKER_URL, PG_ADMIN_URL, REDIS_URL

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 1, 1, 0, 0, 0, 500_000, tzinfo=UTC)


class Jittered(schedule):
    """A schedule of its own (solar, a custom class): times no two replicas agree on."""


class Clock:
    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def beat_app(prefix: str, sqlite_url: str) -> Iterator[Celery]:
    queue = f"{prefix}-beat"
    app = Celery(f"beat-{prefix}", broker=BROKER_URL, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        fence_redis_url=REDIS_URL,
        fence_database_url=sqlite_url,
        fence_key_prefix=prefix,
        beat_schedule={"every-second": {"task": "beat_it.fenced", "schedule": 1.0}},
    )

    @app.task(base=FencedTask, shared=False, name="beat_it.fenced")
    def fenced() -> None:
        pass

    @app.task(shared=False, name="beat_it.plain")
    def plain() -> None:
        pass

    yield app
    delete_queues(app, [queue])
    app.close()


def sent_keys(app: Celery) -> list[str]:
    """The ``fence_key`` header of every message waiting in the app's queue, oldest first."""
    client = redis.Redis.from_url(BROKER_URL)
    try:
        raw = client.lrange(app.conf.task_default_queue, 0, -1)
    finally:
        client.close()
    return [json.loads(m)["headers"].get("fence_key", "-") for m in reversed(raw)]


def one_pass(app: Celery, clock: Clock) -> Scheduler:
    """A replica started at the clock's time that checks its entry once."""
    scheduler = Scheduler(app, clock=clock)
    scheduler.apply_entry(scheduler.schedule["every-second"])
    return scheduler


@pytest.mark.parametrize(
    ("missed", "expected"),
    [
        ("skip", ["00:00:30"]),
        ("catch_up", [f"00:00:{s}" for s in range(26, 31)]),  # the latest catch_up_max=5
    ],
)
def test_missed_ticks_after_every_replica_was_down(
    beat_app: Celery, missed: str, expected: list[str]
) -> None:
    beat_app.conf.fence_beat_missed = missed
    beat_app.conf.fence_beat_catch_up_max = 5
    clock = Clock(T0)
    scheduler = Scheduler(beat_app, clock=clock)
    clock.now = T0 + dt.timedelta(seconds=1)
    scheduler.apply_entry(scheduler.schedule["every-second"])
    assert sent_keys(beat_app) == ["beat:every-second:2026-01-01T00:00:01Z"]
    scheduler.close()  # every replica down from 00:00:01.5 to 00:00:30.5
    clock.now = T0 + dt.timedelta(seconds=30)
    one_pass(beat_app, clock)
    again = one_pass(beat_app, clock)  # a second replica, same moment: nothing left to send
    keys = sent_keys(beat_app)[1:]
    assert keys == [f"beat:every-second:2026-01-01T{t}Z" for t in expected]
    last = again.store().beat_ticks.last("every-second")
    assert last == dt.datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)


def test_a_new_entry_starts_with_the_first_tick_after_the_replica_started(
    beat_app: Celery,
) -> None:
    clock = Clock(T0 + dt.timedelta(seconds=3600))
    scheduler = Scheduler(beat_app, clock=clock)
    assert scheduler.is_due(scheduler.schedule["every-second"]).is_due is False
    scheduler.apply_entry(scheduler.schedule["every-second"])
    assert sent_keys(beat_app) == []  # nothing recorded: no tick before the start is "missed"
    clock.now += dt.timedelta(seconds=1)
    assert scheduler.is_due(scheduler.schedule["every-second"]).is_due is True
    scheduler.apply_entry(scheduler.schedule["every-second"])
    assert sent_keys(beat_app) == ["beat:every-second:2026-01-01T01:00:01Z"]


def test_a_tick_is_a_pending_job_committed_with_its_record_and_a_second_replica_finds_it(
    beat_app: Celery, store: Store, prefix: str
) -> None:
    # Given two replicas started at the same moment, one second before a tick (on each store)
    name = f"{prefix}-tick"
    beat_app.conf.fence_database_url = store.url
    beat_app.conf.beat_schedule = {name: {"task": "beat_it.fenced", "schedule": 1.0}}
    clock = Clock(T0)
    first, second = Scheduler(beat_app, clock=clock), Scheduler(beat_app, clock=clock)
    clock.now += dt.timedelta(seconds=1)
    entry = first.schedule[name]
    at = dt.datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)
    key = f"beat:{name}:2026-01-01T00:00:01Z"
    # When the first sends the tick
    job = first.send_tick(entry, at)
    # Then the tick is a job under its key, pending with the request a re-send needs, recorded,
    # and its message is in the queue under that key
    record = store.get(key)
    assert job.created and record is not None and record.status == "pending"
    assert record.generation == 0 and record.request is not None
    assert record.request["id"] == job.task_id
    assert store.beat_ticks.last(name) == at
    assert sent_keys(beat_app) == [key]
    # And the second replica's copy of the same tick finds that job: no second row, no message
    again = second.send_tick(entry, at)
    assert (again.created, again.task_id, again.status) == (False, job.task_id, "pending")
    assert sent_keys(beat_app) == [key]
    assert store.get(key) == record


def test_a_task_on_a_store_of_its_own_has_its_tick_job_there_and_the_record_in_beats(
    beat_app: Celery, sqlite_url: str, tmp_path: Path
) -> None:
    # Given an entry whose task keeps its jobs in a database other than beat's store
    other = f"sqlite:///{tmp_path / 'elsewhere.sqlite3'}"

    @beat_app.task(
        base=FencedTask, shared=False, name="beat_it.elsewhere", fence_database_url=other
    )
    def elsewhere() -> None:
        pass

    beat_app.conf.beat_schedule = {"apart": {"task": "beat_it.elsewhere", "schedule": 1.0}}
    clock = Clock(T0)
    scheduler = Scheduler(beat_app, clock=clock)
    clock.now += dt.timedelta(seconds=1)
    # When a tick is sent
    scheduler.apply_entry(scheduler.schedule["apart"])
    # Then its job is in the task's store, the record in beat's, the message in the queue
    key = "beat:apart:2026-01-01T00:00:01Z"
    jobs, ticks = Store(other), Store(sqlite_url)
    try:
        record = jobs.get(key)
        assert record is not None and record.status == "pending"
        assert ticks.get(key) is None
        assert ticks.beat_ticks.last("apart") == dt.datetime(2026, 1, 1, 0, 0, 1, tzinfo=UTC)
    finally:
        jobs.dispose()
        ticks.dispose()
    assert sent_keys(beat_app) == [key]


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"task": "beat_it.plain", "schedule": 1.0}, ["not a FencedTask", "base=FencedTask"]),
        ({"task": "beat_it.missing", "schedule": 1.0}, ["not registered", "include="]),
        ({"task": "beat_it.fenced", "schedule": 0.5}, ["at least 1s"]),
        (
            {"task": "beat_it.fenced", "schedule": Jittered(60.0)},
            ["interval", "crontab", "Jittered"],
        ),
        (
            {"task": "beat_it.fenced", "schedule": 1.0, "options": {"mandatory": True}},
            ["mandatory", "cannot be kept with the job"],
        ),
        (
            {"task": "beat_it.fenced", "schedule": 1.0, "args": (dt.date(2026, 1, 1),)},
            ["not JSON", "re-sent"],
        ),
    ],
)
def test_an_entry_it_cannot_fence_is_refused_at_start(
    beat_app: Celery, entry: dict[str, Any], words: list[str]
) -> None:
    beat_app.conf.beat_schedule = {"bad": entry}
    with pytest.raises(ConfigurationError) as raised:
        Scheduler(beat_app)
    assert "'bad'" in str(raised.value)
    for word in words:
        assert word in str(raised.value)


def test_celery_fences_own_maintenance_tasks_are_sent_without_a_key(beat_app: Celery) -> None:
    beat_app.conf.beat_schedule = {"fence-recover": {"task": RECOVER_TASK, "schedule": 60.0}}
    clock = Clock(T0)
    scheduler = Scheduler(beat_app, clock=clock)
    clock.now += dt.timedelta(seconds=60)
    scheduler.apply_entry(scheduler.schedule["fence-recover"])
    assert sent_keys(beat_app) == ["-"]


def test_a_store_without_the_table_is_refused_naming_init_db(beat_app: Celery) -> None:
    name = f"celery_fence_beat_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        url = sa.engine.make_url(PG_ADMIN_URL).set(database=name)
        beat_app.conf.fence_database_url = url.render_as_string(hide_password=False)
        with pytest.raises(ConfigurationError, match=r"no fence_beat_ticks table.*fence init-db"):
            Scheduler(beat_app)
    finally:
        for store in runtime().stores():
            store.dispose()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def test_init_db_adds_the_table_to_tables_an_older_create_all_made(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'older.sqlite3'}"
    engine = sa.create_engine(url)
    try:  # the 0.3 schema: every table but fence_beat_ticks, no version table
        metadata.create_all(
            engine, tables=[t for t in metadata.sorted_tables if t.name != "fence_beat_ticks"]
        )
        assert migrate.upgrade(url) == "upgraded"
        assert "fence_beat_ticks" in sa.inspect(engine).get_table_names()
        assert migrate.upgrade(url) == "current"
    finally:
        engine.dispose()


def test_the_record_only_moves_forward(store: Store, prefix: str) -> None:
    ticks, e = store.beat_ticks, f"{prefix}-e"  # the PostgreSQL database is the session's
    late, early = T0 + dt.timedelta(seconds=10), T0 + dt.timedelta(seconds=5)
    assert ticks.advance(e, late) is True
    assert ticks.advance(e, early) is False
    assert ticks.advance(e, late) is False
    assert ticks.last(e) == late
    assert ticks.last(f"{prefix}-never") is None
    assert [r.key for r in ticks.rows([e])] == [f"beat:{e}:2026-01-01T00:00:10Z"]


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the statements: tests above
def test_fence_beat_ls_shows_each_entrys_last_tick(
    store: Store, worker_env: dict[str, str], prefix: str
) -> None:
    nightly = f"{prefix}-nightly"
    store.beat_ticks.advance(nightly, dt.datetime(2026, 1, 2, 3, 0, tzinfo=UTC))
    listed = json.loads(ok(fence_cli(worker_env, "beat", "ls", "--json")))
    assert [row for row in listed if row["entry"].startswith(prefix)] == [
        {
            "entry": nightly,
            "last_scheduled": "2026-01-02T03:00:00+00:00",
            "key": f"beat:{nightly}:2026-01-02T03:00:00Z",
            "recorded_at": listed[0]["recorded_at"],
        }
    ]
    table = ok(fence_cli(worker_env, "beat", "ls"))
    assert f"beat:{nightly}:2026-01-02T03:00:00Z" in table and "LAST TICK" in table
