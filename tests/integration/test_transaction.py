"""``fence.transaction()`` / ``fence.session()`` against the real stores, without workers: the
commit of the app's own writes is fenced on the attempt's ownership of its key."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.orm import registry, sessionmaker

from celery_fence import FencedTask
from celery_fence.body import watch
from celery_fence.body.fence import Fence
from celery_fence.chaos.arms import UnfencedStore
from celery_fence.errors import (
    BlockIdleTimeout,
    ConfigurationError,
    FenceError,
    LeaseLost,
    StaleGeneration,
)
from celery_fence.leases.lease import HeldLease
from celery_fence.store import Store
from tests.support.stores import EVERY_DRIVER, store_url
from tests.support.worker import wait_until

metadata = sa.MetaData()
rows = sa.Table(
    "t_tx_rows",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("writer", sa.String(64), nullable=False),
)
reports = sa.Table(
    "t_tx_reports",
    metadata,
    sa.Column("key", sa.String(200), primary_key=True),
    sa.Column("writer", sa.String(64), nullable=False),
)


class Row:
    def __init__(self, key: str, writer: str) -> None:
        self.key = key
        self.writer = writer


registry().map_imperatively(Row, rows)


@pytest.fixture(params=EVERY_DRIVER)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The commit check on SQLite, and on PostgreSQL through psycopg2 and psycopg 3."""
    return store_url(request, tmp_path)


@pytest.fixture
def tables(store: Store) -> Store:
    metadata.create_all(store.engine)
    return store


def _attempt(
    store: Store,
    key: str | None = None,
    *,
    generation: int = 1,
    ttl: float = 30.0,
    on_lost: Callable[[HeldLease, str], None] | None = None,
) -> Fence:
    """A registered attempt, as FencedTask builds it before the body runs."""
    key = key or f"tx:{uuid.uuid4().hex}"
    attempt_id = uuid.uuid4().hex
    registration = store.register(key, generation=generation, attempt_id=attempt_id, task_name="t")
    assert registration.outcome == "registered"
    lease = HeldLease(
        key=key,
        lease_key=f"lease:{key}",
        token=attempt_id,
        generation=generation,
        ttl=ttl,
        interval=ttl / 3,
        margin=0.1,
        claimed_at=time.monotonic(),
        on_lost=on_lost,
    )
    return Fence(
        key=key,
        attempt_id=attempt_id,
        generation=generation,
        attempts=registration.attempts,
        lease=lease,
        store=store,
    )


def _writers(store: Store, key: str) -> list[str]:
    with store.engine.connect() as conn:
        return [
            r.writer
            for r in conn.execute(sa.select(rows.c.writer).where(rows.c.key == key).order_by("id"))
        ]


def _write(conn: sa.Connection, fence: Fence, n: int = 2) -> None:
    conn.execute(rows.insert(), [{"key": fence.key, "writer": fence.attempt_id}] * n)


def _takeover(store: Store, fence: Fence) -> str:
    """A newer attempt registers, as it would after this one's lease ran out."""
    newer = uuid.uuid4().hex
    registration = store.register(
        fence.key, generation=fence.generation + 1, attempt_id=newer, task_name="t"
    )
    assert registration.outcome == "registered"
    return newer


def test_the_block_commits_while_the_attempt_owns_its_key(tables: Store) -> None:
    fence = _attempt(tables)
    with fence.transaction() as conn:
        assert conn.in_transaction()
        _write(conn, fence)
    assert _writers(tables, fence.key) == [fence.attempt_id] * 2
    record = tables.get(fence.key)
    assert record is not None
    assert (record.status, record.generation, record.attempt_id) == (
        "running",
        1,
        fence.attempt_id,
    )


def test_a_newer_registration_refuses_the_commit_and_nothing_lands(tables: Store) -> None:
    # Given an attempt whose lease still looks valid locally, but a newer generation registered
    fence = _attempt(tables)
    newer = _takeover(tables, fence)
    # when it writes through the fence,
    with pytest.raises(StaleGeneration) as refused, fence.transaction() as conn:
        _write(conn, fence)
    # then nothing of the block committed, the newer attempt's row is untouched,
    assert refused.value.context["stored_generation"] == 2
    assert _writers(tables, fence.key) == []
    record = tables.get(fence.key)
    assert record is not None and (record.generation, record.attempt_id) == (2, newer)
    # and every later block of the attempt is refused on entry.
    with pytest.raises(StaleGeneration), fence.transaction():
        pytest.fail("a refused attempt entered another block")


def test_postgresql_a_registration_committed_while_the_block_is_open_refuses_it(
    pg_url: str,
) -> None:
    store = Store(pg_url)
    metadata.create_all(store.engine)
    fence = _attempt(store)
    with pytest.raises(StaleGeneration), fence.transaction() as conn:
        _write(conn, fence)
        _takeover(store, fence)  # another connection, committed before this block commits
    assert _writers(store, fence.key) == []
    store.dispose()


def test_postgresql_a_registration_in_flight_is_rechecked_by_the_commit(pg_url: str) -> None:
    # Given a registration that has taken the job row's lock and not committed yet,
    store = Store(pg_url)
    metadata.create_all(store.engine)
    fence = _attempt(store)
    newer = uuid.uuid4().hex
    registering = store.engine.connect()
    registering.exec_driver_sql("BEGIN")
    registering.execute(
        sa.text("UPDATE fence_jobs SET generation = 2, attempt_id = :a WHERE key = :k"),
        {"a": newer, "k": fence.key},
    )
    # when the block commits (its check waits for that lock) and the registration then commits,
    timer = threading.Timer(0.5, lambda: registering.exec_driver_sql("COMMIT"))
    timer.start()
    try:
        with pytest.raises(StaleGeneration), fence.transaction() as conn:
            _write(conn, fence)
    finally:
        timer.join()
        registering.close()
    # then Read Committed re-checked the new row: nothing of the block landed.
    assert _writers(store, fence.key) == []
    store.dispose()


def test_postgresql_registration_behind_a_holder_paused_before_its_commit_gives_up(
    pg_url: str,
) -> None:
    # Given a block paused right after its ownership check (the job row locked until it commits)
    store = Store(pg_url)
    metadata.create_all(store.engine)
    registrar = Store(pg_url, lock_timeout=0.5)
    fence = _attempt(store)
    with fence.transaction() as conn:
        _write(conn, fence)
        assert store.blocks.commit_check(
            conn, fence.key, generation=fence.generation, attempt_id=fence.attempt_id
        )
        # when a newer attempt registers, its statement fails after the lock timeout
        started = time.monotonic()
        with pytest.raises(sa.exc.OperationalError, match=r"LockNotAvailable|lock timeout"):
            registrar.register(fence.key, generation=2, attempt_id="newer", task_name="t")
        assert time.monotonic() - started < 5
    # (the holder still owned the key at its commit: its rows are there) and, once the holder
    # committed, the registration goes through.
    assert _writers(store, fence.key) == [fence.attempt_id] * 2
    reg = registrar.register(fence.key, generation=2, attempt_id="newer", task_name="t")
    assert reg.outcome == "registered"
    registrar.dispose()
    store.dispose()


def test_postgresql_a_holder_idle_in_its_block_past_the_ttl_is_ended_and_frees_its_rows(
    pg_url: str,
) -> None:
    store = Store(pg_url)
    metadata.create_all(store.engine)
    fence = _attempt(store, ttl=1.0)
    key = fence.key
    took: list[float] = []

    def newer_attempt_writes_the_same_row() -> None:
        watch.detach_thread()  # stands for another worker: not the holder's thread
        started = time.monotonic()
        with store.engine.connect() as other:
            other = other.execution_options(isolation_level="READ COMMITTED")
            with other.begin():
                other.exec_driver_sql("SET LOCAL lock_timeout = 10000")
                other.execute(reports.insert().values(key=key, writer="newer"))
        took.append(time.monotonic() - started)

    # Given a holder that wrote the job's report row and then stays idle inside its block,
    with pytest.raises((LeaseLost, sa.exc.OperationalError)), fence.transaction() as conn:
        conn.execute(reports.insert().values(key=key, writer=fence.attempt_id))
        _write(conn, fence)
        newer = threading.Thread(target=newer_attempt_writes_the_same_row)
        newer.start()
        newer.join(timeout=8)  # the holder is "paused" here, idle in its transaction
        # then the server ended the holder's session after about one TTL: the newer attempt's
        # write of the same row went through while the holder was still inside its block,
        assert took and took[0] < 4, took
    # and nothing of the holder's block landed.
    assert _writers(store, key) == []
    with store.engine.connect() as c:
        assert c.execute(sa.select(reports.c.writer).where(reports.c.key == key)).all() == [
            ("newer",)
        ]
    store.dispose()


def test_an_exception_inside_the_block_rolls_it_back_and_goes_on_up(tables: Store) -> None:
    fence = _attempt(tables)
    with pytest.raises(ZeroDivisionError), fence.transaction() as conn:
        _write(conn, fence)
        _ = 1 / 0
    assert _writers(tables, fence.key) == []
    record = tables.get(fence.key)
    assert record is not None and record.status == "running"  # the attempt still owns it
    with fence.transaction() as conn:  # and can write again
        _write(conn, fence, 1)
    assert _writers(tables, fence.key) == [fence.attempt_id]


def test_a_lost_lease_stops_the_block_on_entry_and_at_commit(tables: Store) -> None:
    # on entry: a lease whose deadline passed (a pause) never opens the block
    fence = _attempt(tables)
    fence.lease.deadline = time.monotonic() - 1
    with pytest.raises(LeaseLost), fence.transaction():
        pytest.fail("entered a block with a lost lease")
    # at commit: the deadline passes inside the block (paused between its writes and commit)
    fence = _attempt(tables)
    with pytest.raises(LeaseLost), fence.transaction() as conn:
        _write(conn, fence)
        fence.lease.deadline = time.monotonic() - 1
    assert _writers(tables, fence.key) == []


def test_nested_blocks_are_savepoints_of_the_outer_one_which_commits(tables: Store) -> None:
    fence = _attempt(tables)
    with fence.transaction() as outer:
        outer.execute(rows.insert().values(key=fence.key, writer="outer"))
        with fence.transaction() as inner:
            assert inner is outer
            inner.execute(rows.insert().values(key=fence.key, writer="inner-kept"))
        with pytest.raises(ValueError), fence.transaction() as inner:
            inner.execute(rows.insert().values(key=fence.key, writer="inner-rolled-back"))
            raise ValueError("inner")
        assert _writers(tables, fence.key) == []  # nothing visible before the outer commit
        other = sa.create_engine(tables.url)
        with pytest.raises(FenceError, match="another engine"), fence.transaction(bind=other):
            pytest.fail("nested a block on another engine")
        other.dispose()
    assert _writers(tables, fence.key) == ["outer", "inner-kept"]


def test_repeated_blocks_each_commit_fenced(tables: Store) -> None:
    fence = _attempt(tables)
    with fence.transaction() as conn:
        conn.execute(rows.insert().values(key=fence.key, writer="first"))
    with fence.transaction() as conn:
        conn.execute(rows.insert().values(key=fence.key, writer="second"))
        conn.commit()  # a commit inside the block is fenced too ...
        conn.execute(rows.insert().values(key=fence.key, writer="third"))
    assert _writers(tables, fence.key) == ["first", "second", "third"]
    _takeover(tables, fence)
    with pytest.raises(StaleGeneration), fence.transaction() as conn:
        conn.execute(rows.insert().values(key=fence.key, writer="fourth"))
        conn.commit()  # ... and refused once a newer generation registered
    assert _writers(tables, fence.key) == ["first", "second", "third"]


def test_a_refusal_swallowed_inside_the_block_still_ends_it(tables: Store) -> None:
    fence = _attempt(tables)
    _takeover(tables, fence)
    with pytest.raises(StaleGeneration), fence.transaction() as conn:
        _write(conn, fence)
        with contextlib.suppress(StaleGeneration):  # a body that catches too much must not
            conn.commit()  # turn a refusal into a success
    assert _writers(tables, fence.key) == []


def test_bind_runs_the_block_on_the_apps_own_engine(tables: Store) -> None:
    app_engine = sa.create_engine(tables.url)  # the app's engine: default isolation, own pool
    fence = _attempt(tables)
    with fence.transaction(bind=app_engine) as conn:
        assert conn.engine is app_engine
        _write(conn, fence)
    assert _writers(tables, fence.key) == [fence.attempt_id] * 2
    _takeover(tables, fence)
    with pytest.raises(StaleGeneration), fence.transaction(bind=app_engine) as conn:
        _write(conn, fence, 1)
    assert _writers(tables, fence.key) == [fence.attempt_id] * 2
    with app_engine.connect() as conn:  # the connection went back to the pool as it came
        conn.execute(rows.insert().values(key=fence.key, writer="plain"))
        conn.commit()
    assert _writers(tables, fence.key)[-1] == "plain"
    app_engine.dispose()


def test_bind_to_another_database_is_a_clear_error(
    tables: Store, db_url: str, tmp_path: Path
) -> None:
    fence = _attempt(tables)
    if tables.dialect == "sqlite":
        other = sa.create_engine(f"sqlite:///{tmp_path / 'app.sqlite3'}")
        problem = "file"
    else:
        other = sa.create_engine(sa.make_url(db_url).set(database="some_app_db"))
        problem = "database some_app_db"
    with pytest.raises(ConfigurationError) as error, fence.transaction(bind=other):
        pytest.fail("opened a block on another database")
    message = str(error.value)
    assert problem in message and "fence_database_url" in message
    with (
        pytest.raises(ConfigurationError, match="takes an SQLAlchemy Engine"),
        fence.transaction(bind="sqlite://"),  # type: ignore[arg-type]
    ):
        pass
    other.dispose()


def test_the_session_commits_fenced(tables: Store) -> None:
    factory = sessionmaker()
    fence = _attempt(tables)
    with fence.session(factory) as session:
        session.add_all([Row(fence.key, "orm-1"), Row(fence.key, "orm-2")])
        session.commit()  # fenced: it lands
        session.add(Row(fence.key, "orm-3"))  # committed, fenced, at the end of the block
    assert _writers(tables, fence.key) == ["orm-1", "orm-2", "orm-3"]
    _takeover(tables, fence)
    with pytest.raises(StaleGeneration), fence.session(factory) as session:
        session.add(Row(fence.key, "stale"))
        session.commit()
    with pytest.raises(StaleGeneration), fence.session(factory):  # refused on entry now
        pass
    assert _writers(tables, fence.key) == ["orm-1", "orm-2", "orm-3"]


def test_the_session_uses_its_factorys_engine_and_rolls_back_on_an_exception(
    tables: Store,
) -> None:
    app_engine = sa.create_engine(tables.url)
    factory = sessionmaker(bind=app_engine)
    fence = _attempt(tables)
    with pytest.raises(KeyError), fence.session(factory) as session:
        assert session.get_bind().engine is app_engine
        session.add(Row(fence.key, "rolled-back"))
        session.flush()
        raise KeyError("boom")
    with fence.transaction(bind=app_engine) as conn:  # a session nested in an open block
        conn.execute(rows.insert().values(key=fence.key, writer="conn"))
        with fence.session(factory) as session:
            session.add(Row(fence.key, "nested-session"))
    assert _writers(tables, fence.key) == ["conn", "nested-session"]
    app_engine.dispose()


def test_outside_a_fenced_task_there_is_no_fence(tables: Store) -> None:
    app = Celery("t", set_as_current=False)

    @app.task(base=FencedTask, bind=True, shared=False)
    def fenced(self: Any) -> None:
        pass

    with pytest.raises(FenceError, match="only available while fenced task"):
        fenced.fence.transaction()
    fence = _attempt(tables)
    storeless = Fence(
        key=fence.key, attempt_id="x", generation=1, attempts=1, lease=fence.lease, store=None
    )
    with (
        pytest.raises(FenceError, match="only available inside a fenced task"),
        storeless.transaction(),
    ):
        pass


def test_the_unfenced_control_arm_makes_the_block_a_plain_transaction(db_url: str) -> None:
    # the chaos harness's control arm: guard() on entry, then a plain commit
    store = UnfencedStore(db_url)
    metadata.create_all(store.engine)
    fence = _attempt(store)
    _takeover(store, fence)
    with fence.transaction() as conn:
        _write(conn, fence, 1)
    assert _writers(store, fence.key) == [fence.attempt_id]
    store.dispose()


def test_each_thread_has_its_own_block_and_each_commit_is_fenced(tables: Store) -> None:
    # Given an attempt whose body opens a block, and a thread of its own that opens one too
    fence = _attempt(tables)
    seen: dict[str, Any] = {}

    def other_thread() -> None:
        try:
            with fence.transaction() as conn:
                seen["other"] = conn
                conn.execute(rows.insert().values(key=fence.key, writer="other-thread"))
        except BaseException as exc:  # reported to the test below
            seen["error"] = exc

    with fence.transaction() as conn:
        seen["body"] = conn
        conn.execute(rows.insert().values(key=fence.key, writer="body"))
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(0.3)  # on SQLite it waits for this block's write lock; on PostgreSQL not
    thread.join(10)
    # then the thread's block had its own connection (a connection is never shared between
    # threads), and both commits, each fenced, landed.
    assert not thread.is_alive() and "error" not in seen, seen.get("error")
    assert seen["other"] is not seen["body"]
    assert sorted(_writers(tables, fence.key)) == ["body", "other-thread"]


def test_a_loss_seen_by_another_thread_while_a_block_is_open_is_recorded_once(
    tables: Store,
) -> None:
    losses: list[str] = []
    fence = _attempt(tables, ttl=0.5, on_lost=lambda lease, reason: losses.append(reason))
    raised: list[BaseException] = []

    def other_thread_checks() -> None:
        try:
            fence.check()
        except LeaseLost as exc:
            raised.append(exc)

    # Given a block open (a session that has not written yet) when the lease runs out,
    with fence.session(sessionmaker()):
        wait_until(lambda: fence.lost, 5, what="the lease to run out")
        # when another thread checks the lease, it is stopped,
        checker = threading.Thread(target=other_thread_checks)
        checker.start()
        checker.join(5)
        assert len(raised) == 1
        assert losses == []  # not recorded while the block is open (it may hold the write lock)
    # then the loss is recorded once the block has closed, and only once.
    assert len(losses) == 1
    with pytest.raises(LeaseLost):
        fence.check()
    assert len(losses) == 1


def test_a_loss_noticed_by_the_renewer_during_a_block_is_recorded_once(tables: Store) -> None:
    losses: list[str] = []
    fence = _attempt(tables, on_lost=lambda lease, reason: losses.append(reason))
    lease = fence.lease  # what the renewal thread holds
    with pytest.raises(LeaseLost), fence.transaction() as conn:
        _write(conn, fence)
        renewer = threading.Thread(
            target=lease.mark_lost, args=("lease expired or taken over in Redis",)
        )
        renewer.start()
        renewer.join(5)
    assert losses == ["lease expired or taken over in Redis"]
    assert _writers(tables, fence.key) == []


@pytest.mark.parametrize("db_url", ["postgresql", "psycopg3"], indirect=True)
def test_postgresql_a_block_idle_past_the_ttl_raises_an_error_naming_the_ttl_and_the_fix(
    tables: Store,
) -> None:
    """The real limit of a block: it may not stay idle between two statements longer than
    fence_lease_ttl (PostgreSQL's idle_in_transaction_session_timeout for it). The error says so,
    with the TTL and the fix, on either driver (psycopg2 only sees the connection closed)."""
    fence = _attempt(tables, ttl=1.0)
    # Given a block that writes, then does slow work inside it past the TTL, then writes again,
    with pytest.raises(BlockIdleTimeout) as ended, fence.transaction() as conn:
        conn.execute(rows.insert().values(key=fence.key, writer="first"))
        time.sleep(1.6)
        conn.execute(rows.insert().values(key=fence.key, writer="second"))
    # then the error names the limit, the TTL and the fix, and chains the driver's error,
    message = str(ended.value)
    assert "fence_lease_ttl (1s" in message and "idle between two statements" in message
    assert "before the block" in message and fence.key in message
    assert isinstance(ended.value.__cause__, sa.exc.DBAPIError)
    assert (
        ended.value.context["lease_ttl"] == 1.0 and float(str(ended.value.context["idle"])) >= 1.0
    )
    # and nothing of the block committed.
    assert _writers(tables, fence.key) == []
    # A block that is busy (statements closer together than the TTL) is not affected.
    busy = _attempt(tables, ttl=3.0)
    with busy.transaction() as conn:
        for n in range(3):
            conn.execute(rows.insert().values(key=busy.key, writer=f"w{n}"))
            time.sleep(0.5)  # each gap well below the TTL
    assert _writers(tables, busy.key) == ["w0", "w1", "w2"]
