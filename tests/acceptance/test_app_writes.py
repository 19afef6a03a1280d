"""The app's own writes through ``self.fence.transaction()`` / ``session()`` with real workers:
a stale attempt's rows never land, a paused holder does not block takeover for long.

The task (``tests/support/app.py: write_app``) upserts the job's report row and appends two lines
per attempt, inside one fenced block; its ledger says where the body is, so the test can pause it
there. TTL 2 s, renewal every 0.5 s.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from celery_fence.store import Store
from celery_fence.store.records import Completion
from celery_fence.testing import faults
from tests.support import ledger
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

TTL = 2.0


class AppDb:
    """Reads the app's tables (``tests.support.app``'s ``app_lines`` and ``app_reports``) back."""

    def __init__(self, client_app: ModuleType, engine: sa.Engine) -> None:
        self.client_app = client_app
        self.engine = engine

    def lines(self, key: str) -> list[tuple[int, str]]:
        t = self.client_app.app_lines
        with self.engine.connect() as conn:
            query = sa.select(t.c.generation, t.c.attempt_id).where(t.c.key == key)
            return [(r[0], r[1]) for r in conn.execute(query.order_by(t.c.id))]

    def report(self, key: str) -> tuple[int, str] | None:
        t = self.client_app.app_reports
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(t.c.generation, t.c.attempt_id).where(t.c.key == key)
            ).first()
        return None if row is None else (row[0], row[1])


@pytest.fixture
def app_db(client_app: ModuleType, db_url: str) -> Iterator[AppDb]:
    """The app's tables in the store's database; reads them back for the test."""
    engine = sa.create_engine(db_url)
    client_app.app_metadata.create_all(engine)
    yield AppDb(client_app, engine)
    engine.dispose()


def _at(redis_client: redis.Redis, prefix: str, key: str) -> list[str]:
    return ledger.entries(redis_client, f"{prefix}:at:{key}")


def _key() -> str:
    return f"report:{uuid.uuid4().hex[:8]}"


def _assert_only_the_newer_attempts_rows(
    app_db: AppDb, store: Store, key: str, result: Any
) -> None:
    record = store.get(key)
    assert record is not None
    assert (record.status, record.generation) == ("completed", result["generation"])
    newer = (result["generation"], result["attempt_id"])
    assert app_db.lines(key) == [newer, newer]
    assert app_db.report(key) == newer


def test_paused_after_its_work_before_its_block_its_rows_never_land(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = _key()
    store = Store(db_url)
    # Given worker A that finished its work (generation 1) and is about to write,
    a = spawn_worker("a")
    first = client_app.write_app.delay(key, pause_before=1.5)
    wait_until(lambda: "worked:1" in _at(redis_client, prefix, key), 20, what="A's work")
    # when A pauses past its lease, B takes the job over and commits its rows,
    a.pause()
    time.sleep(TTL + 0.6)
    spawn_worker("b")
    second = client_app.write_app.delay(key)
    newer = second.get(timeout=30)
    assert newer["generation"] == 2
    # and A resumes,
    a.resume()
    # then A's rows never land, B's stay, the job is B's, and both callers get B's result.
    assert first.get(timeout=30) == newer
    _assert_only_the_newer_attempts_rows(app_db, store, key, newer)
    assert "committed:1" not in _at(redis_client, prefix, key)
    store.dispose()


@pytest.mark.parametrize("via", ["conn", "bind", "session"])
def test_a_newer_registration_refuses_the_commit_while_the_lease_still_looks_valid(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    via: str,
) -> None:
    """The store's check, not the lease: A is never paused, its lease is renewed all along, and
    a newer generation registers in the store (as after Redis lost A's lease)."""
    key = _key()
    store = Store(db_url)
    # Given worker A at the door of its block (generation 1, its lease live),
    spawn_worker("a")
    first = client_app.write_app.delay(key, gate=True, via=via)
    wait_until(lambda: "worked:1" in _at(redis_client, prefix, key), 20, what="A's work")
    # when a newer generation registers with the store, and A then writes through the fence,
    newer = uuid.uuid4().hex
    registered = store.register(key, generation=2, attempt_id=newer, task_name="elsewhere")
    assert registered.outcome == "registered"
    faults.arm(redis_client, prefix, "gate", key)
    # then A's commit is refused: none of its rows landed, and it settled as stale,
    wait_until(
        lambda: ("stale", 1) in [(t.action, t.generation) for t in store.transitions.history(key)],
        20,
        what="A's stale record",
    )
    assert "inside:1" in _at(redis_client, prefix, key)  # it did write, inside the block
    assert "committed:1" not in _at(redis_client, prefix, key)
    assert app_db.lines(key) == [] and app_db.report(key) is None
    # and its message converges on the newer attempt's result once that one completes.
    store.end(key, Completion(generation=2, attempt_id=newer, result={"by": "newer"}))
    assert first.get(timeout=30) == {"by": "newer"}
    assert app_db.lines(key) == []
    store.dispose()


def test_paused_inside_its_block_it_does_not_hold_up_the_takeover_and_never_commits(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = _key()
    store = Store(db_url)
    # Given worker A paused inside its block, after writing its rows, before its commit,
    a = spawn_worker("a")
    first = client_app.write_app.delay(key, pause_inside=1.5)
    wait_until(lambda: "inside:1" in _at(redis_client, prefix, key), 20, what="A's writes")
    a.pause()
    paused_at = time.monotonic()
    spawn_worker("b")
    # when its lease runs out and the job is handed to B,
    time.sleep(max(0.0, paused_at + TTL + 0.3 - time.monotonic()))
    second = client_app.write_app.delay(key)
    if store.dialect == "sqlite":
        # SQLite: nothing can end a stopped process's transaction, and its write lock holds every
        # writer (B's registration too) until A resumes; A's commit is then refused (lease lost).
        time.sleep(max(0.0, paused_at + 1.5 * TTL - time.monotonic()))
        a.resume()
    # then B completes within a few TTLs of the pause (PostgreSQL: A still paused; the server
    # ended A's session after one TTL idle in its transaction, which freed its row locks),
    wait_until(
        lambda: (r := store.get(key)) is not None and r.status == "completed",
        max(0.0, paused_at + 5 * TTL - time.monotonic()),
        what="B to complete within 5 TTLs of A's pause",
    )
    newer = second.get(timeout=10)
    assert newer["generation"] == 2
    a.resume()
    # and A's rows never land: B's stay, and A's message converges on B's result.
    assert first.get(timeout=30) == newer
    _assert_only_the_newer_attempts_rows(app_db, store, key, newer)
    assert "committed:1" not in _at(redis_client, prefix, key)
    store.dispose()


def test_a_write_beside_the_block_ends_the_job_dead_naming_the_fix_and_lands_nothing(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = _key()
    store = Store(db_url)
    spawn_worker("w")
    # Given a body that writes through Flask-SQLAlchemy's db.session inside fence.transaction()
    # (its own connection, which the block's fenced commit does not cover),
    client_app.write_app.delay(key, via="beside")
    # then the write is refused: the job ends dead at once (a setting to fix, not retried),
    # its reason naming the fix, and nothing of the block landed.
    wait_until(lambda: (r := store.get(key)) is not None and r.status == "dead", 30, what="dead")
    record = store.get(key)
    assert record is not None and record.error_type == "celery_fence.errors.ConfigurationError"
    assert "not the fenced block's" in (record.error_message or "")
    assert "self.fence.session(db.session)" in (record.error_message or "")
    dead = [t.reason for t in store.transitions.history(key) if t.action == "dead"]
    assert dead == ["permanent error ConfigurationError"]
    assert app_db.lines(key) == [] and app_db.report(key) is None
    assert ledger.run_count(redis_client, prefix, key) == 1
    store.dispose()


@pytest.mark.parametrize("mode", ["warn", "error"])
def test_a_write_outside_any_block_is_flagged_or_refused(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    db_url: str,
    mode: str,
) -> None:
    key = _key()
    store = Store(db_url)
    worker = spawn_worker("w", FENCE_T_UNFENCED_WRITES=mode)
    # Given a body that appends its lines through a plain engine.begin(), outside any block,
    client_app.write_app.delay(key, via="outside")
    wanted = "completed" if mode == "warn" else "dead"
    wait_until(lambda: (r := store.get(key)) is not None and r.status == wanted, 30, what=wanted)
    record = store.get(key)
    assert record is not None

    # (the flag's transition row is written off the body's thread: it may land after the end)
    def flagged() -> list[Any]:
        return [t for t in store.transitions.history(key) if t.action == "unfenced_write"]

    wait_until(lambda: flagged(), 10, what="the unfenced_write transition")
    assert len(flagged()) == 1 and "app_lines" in (flagged()[0].reason or "")
    if mode == "warn":
        # then under "warn" the write landed, and it was said out loud: the transition row, and
        # the worker's WARNING naming the task, the table and the fix
        assert [g for g, _ in app_db.lines(key)] == [1, 1]
        wait_until(lambda: "fence unfenced write" in worker.log(), 10, what="the warning")
        line = next(x for x in worker.log().splitlines() if "fence unfenced write" in x)
        assert "write_app" in line and f"table {client_app.app_lines.name}" in line
        assert "self.fence.transaction()" in line
    else:
        # and under "error" it was rolled back and the job ended dead, naming the setting
        assert app_db.lines(key) == [] and app_db.report(key) is None
        assert record.error_type == "celery_fence.errors.ConfigurationError"
        assert "fence_unfenced_writes='error'" in (record.error_message or "")
    store.dispose()


def test_an_exception_inside_the_block_rolls_it_back_and_the_retry_writes(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = _key()
    store = Store(db_url)
    faults.arm(redis_client, prefix, "fail_inside", key)  # the first attempt raises in its block
    spawn_worker("w")
    result = client_app.write_app.delay(key, fail_inside_once=True).get(timeout=30)
    assert result["generation"] == 2
    at = _at(redis_client, prefix, key)
    assert "inside:1" in at and "committed:1" not in at  # it wrote, raised, and was rolled back
    _assert_only_the_newer_attempts_rows(app_db, store, key, result)
    actions = [(t.action, t.generation) for t in store.transitions.history(key)]
    assert ("retry_scheduled", 1) in actions  # the normal error path
    store.dispose()


def test_postgresql_a_registration_behind_a_locked_job_row_is_resent_not_stuck(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL: SQLite has no row locks (its writers wait busy_timeout)")
    # Given a job row locked by a holder paused between its ownership check and its commit,
    key, other = _key(), _key()
    store = Store(db_url)
    store.register(key, generation=0, attempt_id="holder", task_name="t")
    holder = store.engine.connect()
    holder.exec_driver_sql("BEGIN")
    holder.execute(sa.text("UPDATE fence_jobs SET updated_at = now() WHERE key = :k"), {"k": key})
    try:
        # and one worker process, whose store statements wait 1 s at most for a row lock,
        spawn_worker("w", FENCE_T_LOCK_TIMEOUT="1")
        # when the job and another one are sent,
        blocked = client_app.write_app.delay(key)
        unrelated = client_app.work.delay(other)
        # then the worker is not stuck behind the lock (the other job completes meanwhile),
        assert unrelated.get(timeout=30)["key"] == other
        record = store.get(key)
        assert record is not None and (record.generation, record.attempt_id) == (0, "holder")
    finally:
        holder.exec_driver_sql("ROLLBACK")  # the holder goes away (its session ended)
        holder.close()
    # and the job's message was re-sent, not dropped: it completes once the row is free.
    result = blocked.get(timeout=40)
    _assert_only_the_newer_attempts_rows(app_db, store, key, result)
    store.dispose()


@pytest.mark.parametrize("via", ["binds", "flask"])
def test_a_session_routed_by_its_own_binds_never_lands_a_paused_attempts_rows(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
    via: str,
) -> None:
    """``sessionmaker(binds={Model: engine})`` and Flask-SQLAlchemy's ``db.session`` choose
    their engine themselves: the fenced session still runs every statement on its block."""
    key = _key()
    store = Store(db_url)
    # Given worker A inside its fenced session, its rows added but not yet flushed,
    a = spawn_worker("a")
    first = client_app.write_app.delay(key, via=via, pause_inside=1.5)
    wait_until(lambda: "inside:1" in _at(redis_client, prefix, key), 20, what="A in its block")
    # when A pauses past its lease, B takes the job over and commits its rows,
    a.pause()
    paused_at = time.monotonic()
    spawn_worker("b")
    time.sleep(max(0.0, paused_at + TTL + 0.6 - time.monotonic()))
    second = client_app.write_app.delay(key, via=via)
    newer = second.get(timeout=30)
    assert newer["generation"] == 2
    # and A resumes (its session flushes and commits),
    a.resume()
    # then none of A's rows land: the stored state is B's, and A's message gets B's result.
    assert first.get(timeout=30) == newer
    _assert_only_the_newer_attempts_rows(app_db, store, key, newer)
    assert "committed:1" not in _at(redis_client, prefix, key)
    store.dispose()


def test_postgresql_a_block_whose_database_stops_answering_ends_and_its_attempt_retries(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    app_db: AppDb,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL: a connection that stops answering (SQLite has none)")
    from celery_fence.testing.proxy import TcpProxy

    url = sa.engine.make_url(db_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    proxy.up()
    key = _key()
    store = Store(db_url)
    try:
        # Given worker A inside a block on the app's own engine (bind=), which reaches the
        # database through a proxy, and whose database calls may take 1 s,
        spawn_worker("a", FENCE_T_APP_PORT=str(proxy.port), FENCE_T_DB_TIMEOUT="1")
        result = client_app.write_app.delay(key, via="bind", pause_inside=1.0)
        wait_until(lambda: "inside:1" in _at(redis_client, prefix, key), 20, what="A's writes")
        # when the proxy stops forwarding (nothing closed, nothing answered) before A commits,
        proxy.stall()
        # then A's commit ends within a few seconds and the attempt settles: a retry scheduled
        # (the lease renews all along, so nothing else would take the job over),
        wait_until(
            lambda: (
                ("retry_scheduled", 1)
                in [(t.action, t.generation) for t in store.transitions.history(key)]
            ),
            8,
            what="A's commit to end and its attempt to be retried",
        )
        proxy.unstall()
        # and the retry completes the job with its own rows only.
        newer = result.get(timeout=30)
        assert newer["generation"] == 2
        _assert_only_the_newer_attempts_rows(app_db, store, key, newer)
    finally:
        proxy.unstall()
        proxy.down()
        store.dispose()
