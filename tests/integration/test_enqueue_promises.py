"""``enqueue()``'s promises against the real stores and the Redis broker, without workers: the
message goes with the outermost commit of the database connection (a ``Session`` joined to an
outer transaction sends nothing at ``session.commit()``), an ``AUTOCOMMIT`` connection is
refused, an ``eta`` is stored as its UTC instant, and recovery's re-send publishes the message as
the first send did (its eta, ``ignore_result``, serializer, compression, retry policy).

The messages are read back from the broker's queue with kombu (``basic_get``), as a worker
would receive them.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from kombu import Connection
from sqlalchemy.orm import Session

from celery_fence import ConfigurationError, enqueue, recover
from celery_fence.store import Store
from tests.support.env import BROKER_URL
from tests.support.stores import EVERY_DRIVER

UTC_MINUS_5 = dt.timezone(dt.timedelta(hours=-5))


def as_utc(value: dt.datetime) -> dt.datetime:
    """A stored instant (naive on SQLite: UTC) or an eta (naive: UTC) as an aware UTC one."""
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc)


def _queued(queue: str) -> int:
    return int(redis.Redis.from_url(BROKER_URL).llen(queue))


def _take_messages(queue: str) -> list[Any]:
    """Every message waiting in ``queue``, taken off it with kombu (as a worker receives it)."""
    out = []
    with Connection(BROKER_URL) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            message.accept = {"application/json", "application/x-python-serialize"}
            out.append(message)
    return out


def _status(store: Store, key: str) -> str | None:
    record = store.get(key)
    return None if record is None else record.status


@pytest.fixture
def orders(db_url: str, prefix: str) -> Iterator[tuple[sa.Engine, sa.Table]]:
    engine = sa.create_engine(db_url)
    table = sa.Table(
        f"orders_{prefix}", sa.MetaData(), sa.Column("id", sa.String(64), primary_key=True)
    )
    table.create(engine)
    yield engine, table
    table.drop(engine)
    engine.dispose()


# -- 8. the outermost commit ----------------------------------------------------------------------


@pytest.mark.parametrize("db_url", EVERY_DRIVER, indirect=True)
@pytest.mark.parametrize("mode", ["conditional_savepoint", "rollback_only"])
def test_a_session_joined_to_an_outer_transaction_sends_with_the_outer_commit(
    mode: Any,
    client_app: ModuleType,
    store: Store,
    orders: tuple[sa.Engine, sa.Table],
    worker_env: dict[str, str],
) -> None:
    engine, table = orders
    queue = worker_env["FENCE_T_QUEUE"]
    dropped, kept = (f"joined:{uuid.uuid4().hex[:8]}" for _ in range(2))

    # Given a Session joined to an outer Connection transaction (a test fixture's, a unit of
    # work's), which commits the session and then rolls the outer transaction back
    with engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode=mode)
        session.execute(table.insert().values(id=dropped))
        assert enqueue(session, client_app.work, args=(dropped,)).created
        session.commit()
        # then session.commit() sent nothing: the row is not committed yet
        assert _queued(queue) == 0
        outer.rollback()
        session.close()
    # and the outer rollback leaves no row and no message
    assert _status(store, dropped) is None and _queued(queue) == 0

    # When the outer transaction commits instead
    with engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode=mode)
        session.execute(table.insert().values(id=kept))
        enqueue(session, client_app.work, args=(kept,))
        session.commit()
        assert _queued(queue) == 0
        outer.commit()
        session.close()
    # Then its commit sends the job, once
    assert _status(store, kept) == "pending"
    assert [m.headers["fence_key"] for m in _take_messages(queue)] == [kept]


def test_a_session_that_owns_its_transaction_still_sends_at_its_commit(
    client_app: ModuleType, store: Store, worker_env: dict[str, str], db_url: str
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    key = f"owned:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:  # control_fully: the session's commit is the outer commit
        conn.begin()
        session = Session(bind=conn, join_transaction_mode="control_fully")
        enqueue(session, client_app.work, args=(key,))
        assert _queued(queue) == 0
        session.commit()
        assert _queued(queue) == 1 and _status(store, key) == "pending"
        session.close()
    with Session(engine) as session:  # bound to the engine: its commit ends the transaction
        other = f"owned:{uuid.uuid4().hex[:8]}"
        enqueue(session, client_app.work, args=(other,))
        session.commit()
    assert _queued(queue) == 2
    engine.dispose()


def test_a_session_joined_with_a_savepoint_is_refused(
    client_app: ModuleType, store: Store, worker_env: dict[str, str], db_url: str
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    key = f"savepoint:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    modes: list[tuple[Any, bool]] = [("create_savepoint", False), ("conditional_savepoint", True)]
    for mode, nested in modes:
        with engine.connect() as conn, conn.begin():
            if nested:  # conditional_savepoint inside a savepoint: the session's is one too
                conn.begin_nested()
            session = Session(bind=conn, join_transaction_mode=mode)
            with pytest.raises(ConfigurationError, match="savepoint"):
                enqueue(session, client_app.work, args=(key,))
            session.close()
    assert _status(store, key) is None and _queued(queue) == 0
    engine.dispose()


# -- 9. AUTOCOMMIT --------------------------------------------------------------------------------


@pytest.mark.parametrize("db_url", EVERY_DRIVER, indirect=True)
def test_an_autocommit_connection_is_refused(
    client_app: ModuleType, store: Store, worker_env: dict[str, str], db_url: str
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    key = f"autocommit:{uuid.uuid4().hex[:8]}"
    autocommit = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    plain = sa.create_engine(db_url)
    fix = r"isolation_level='AUTOCOMMIT'.*without isolation_level='AUTOCOMMIT'"
    # Given an app engine in AUTOCOMMIT, a connection switched to it, and the store's own engine
    with autocommit.begin() as conn, pytest.raises(ConfigurationError, match=fix):
        enqueue(conn, client_app.work, args=(key,))
    with plain.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        with conn.begin(), pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            enqueue(conn, client_app.work, args=(key,))
    with store.engine.begin() as conn, pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
        enqueue(conn, client_app.work, args=(key,))
    with Session(autocommit) as session, pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
        enqueue(session, client_app.work, args=(key,))
    # Then nothing was written (an autocommitted row would outlive a rollback) or sent
    assert _status(store, key) is None and _queued(queue) == 0
    # and the same engine without AUTOCOMMIT is taken
    with plain.begin() as conn:
        assert enqueue(conn, client_app.work, args=(key,)).created
    assert _status(store, key) == "pending" and _queued(queue) == 1
    autocommit.dispose()
    plain.dispose()


@pytest.mark.parametrize("db_url", EVERY_DRIVER, indirect=True)
def test_a_fenced_blocks_connection_is_not_autocommit_and_is_taken(
    client_app: ModuleType, store: Store, worker_env: dict[str, str]
) -> None:
    from tests.integration.test_transaction import _attempt

    # Given a fenced block on the store's engine (which runs in AUTOCOMMIT, but the block begins
    # a transaction of its own: BEGIN IMMEDIATE on SQLite, READ COMMITTED on PostgreSQL)
    fence = _attempt(store)
    key = f"block:{uuid.uuid4().hex[:8]}"
    with fence.transaction() as conn:
        enqueue(conn, client_app.work, args=(key,))
        assert _queued(worker_env["FENCE_T_QUEUE"]) == 0
    # Then the job is written in the block's transaction and sent after its fenced commit
    assert _status(store, key) == "pending" and _queued(worker_env["FENCE_T_QUEUE"]) == 1


# -- 10. instants in UTC --------------------------------------------------------------------------


@pytest.mark.parametrize("db_url", EVERY_DRIVER, indirect=True)
def test_an_eta_in_any_zone_is_stored_as_its_utc_instant_and_re_sent_with_it(
    client_app: ModuleType, store: Store, worker_env: dict[str, str], db_url: str
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    later, naive, due = (f"eta:{uuid.uuid4().hex[:8]}" for _ in range(3))
    etas = {
        later: (now + dt.timedelta(hours=2)).astimezone(UTC_MINUS_5),  # in two hours, UTC-5
        naive: (now + dt.timedelta(hours=2)).replace(tzinfo=None),  # naive: UTC, as Celery
        due: (now - dt.timedelta(seconds=1)).astimezone(UTC_MINUS_5),  # due a second ago
    }
    # Given jobs enqueued with an eta west of UTC, a naive one, and one already due
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        for key, eta in etas.items():
            enqueue(conn, client_app.work, args=(key,), eta=eta)
    engine.dispose()
    _take_messages(queue)  # their messages lost
    # Then each row holds its UTC instant
    for key, eta in etas.items():
        record = store.get(key)
        assert record is not None and record.retry_at is not None
        assert as_utc(record.retry_at) == as_utc(eta), key
    # When recovery passes: the two not due are left alone (not re-sent hours early) ...
    report = recover(client_app.app, older_than=0)
    assert later not in report.sent and naive not in report.sent
    assert due in report.sent
    # ... and the due one is re-sent with its eta
    (message,) = _take_messages(queue)
    assert message.headers["fence_key"] == due
    eta = message.headers.get("eta")
    assert eta is not None, "the re-send lost its eta"
    assert dt.datetime.fromisoformat(eta) == etas[due]


# -- 11. the re-send is the message the first send was --------------------------------------------


def test_recovery_re_sends_with_the_publish_options_enqueue_was_given(
    client_app: ModuleType, store: Store, worker_env: dict[str, str], db_url: str
) -> None:
    from celery.signals import before_task_publish

    queue = worker_env["FENCE_T_QUEUE"]
    key = f"options:{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {
        "ignore_result": True,
        "serializer": "pickle",
        "compression": "bzip2",
        "retry_policy": {"max_retries": 7, "interval_start": 0.25},
        "delivery_mode": 1,
        "priority": 3,
    }
    policies: list[dict[str, Any]] = []

    def seen(sender: str, retry_policy: dict[str, Any], **_: Any) -> None:
        policies.append(retry_policy)

    before_task_publish.connect(seen, weak=False)
    try:
        # Given a job enqueued with those options, its message then lost
        engine = sa.create_engine(db_url)
        with engine.begin() as conn:
            enqueue(conn, client_app.work, args=(key,), kwargs={"marker": "m"}, **options)
        engine.dispose()
        (first,) = _take_messages(queue)
        # When recovery re-sends it
        assert key in recover(client_app.app, older_than=0).sent
        (again,) = _take_messages(queue)
    finally:
        before_task_publish.disconnect(seen)
    # Then the re-sent message is published as the first one was
    for message in (first, again):
        assert message.headers["ignore_result"] is True
        assert message.content_type == "application/x-python-serialize"
        assert message.headers["compression"] == "application/x-bz2"
        assert message.properties["delivery_mode"] == 1
        assert message.properties["priority"] == 3
        args, kwargs, _ = message.decode()
        assert (list(args), kwargs) == ([key], {"marker": "m"})
    assert len(policies) == 2
    for policy in policies:
        assert (policy["max_retries"], policy["interval_start"]) == (7, 0.25)


def test_an_option_a_re_send_cannot_keep_is_refused(
    client_app: ModuleType, store: Store, worker_env: dict[str, str], db_url: str
) -> None:
    key = f"unknown:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="mandatory"):
        enqueue(conn, client_app.work, args=(key,), mandatory=True)
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="must be JSON"):
        enqueue(conn, client_app.work, args=(key,), retry_policy={"max_retries": object()})
    engine.dispose()
    assert _status(store, key) is None and _queued(worker_env["FENCE_T_QUEUE"]) == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the statements: tests above
def test_a_key_given_names_the_job_and_its_message_and_a_bad_one_is_refused(
    client_app: ModuleType, store: Store, worker_env: dict[str, str], db_url: str
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    arg, key = f"arg:{uuid.uuid4().hex[:8]}", f"given:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    # Given keys that cannot be a job's: nothing is written or sent, and the rule is named
    for bad in ("", "a\x00b", "k" * 513, 7):
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="non-empty str"):
            enqueue(conn, client_app.work, args=(arg,), key=bad)
    assert _queued(queue) == 0
    # When a job is enqueued with a key of its own
    with engine.begin() as conn:
        job = enqueue(conn, client_app.work, args=(arg,), key=key)
    engine.dispose()
    # Then the row is under that key (not the task's fence_key of its args), and so is its message
    assert job.key == key and _status(store, key) == "pending" and _status(store, arg) is None
    (message,) = _take_messages(queue)
    assert message.headers["fence_key"] == key and message.headers["id"] == job.task_id
