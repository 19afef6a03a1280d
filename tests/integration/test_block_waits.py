"""Every wait inside a fenced block is bounded by ``fence_database_timeout``: its statements,
the ownership check, the COMMIT and the ROLLBACK, on the store's engine and on your own
(``bind=``). PostgreSQL behind a TCP proxy that stops forwarding (a peer that acknowledges and
never answers); SQLite waiting for a write lock another connection holds."""

from __future__ import annotations

import functools
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from celery_fence.store import Store
from celery_fence.testing.proxy import TcpProxy
from tests.integration.test_transaction import _attempt, _write, _writers, metadata

TIMEOUT = 1.0
#: What a bounded call may take past the timeout: the watchdog's tick, scheduling on a busy box.
SLACK = 1.5


def _ends_within_the_bound(block: Callable[[], None]) -> BaseException | None:
    """Run ``block`` on a daemon thread; its exception (None: it returned). Fails when it is
    still blocked after the bound plus 10 s (the wait has no bound), or ended after the bound."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            block()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIMEOUT + SLACK + 10)
    elapsed = time.monotonic() - started
    assert outcome, "the block is still waiting: the wait has no bound"
    assert elapsed < TIMEOUT + SLACK, elapsed
    return outcome[0]


def _stall_after_the_ownership_check(conn: sa.Connection, proxy: TcpProxy) -> None:
    """Stop forwarding once the block's ownership check has answered: the COMMIT is next."""

    def after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "UPDATE fence_jobs" in statement:
            proxy.stall()

    sa.event.listen(conn, "after_cursor_execute", after)


def test_postgresql_a_block_on_your_engine_ends_each_wait_within_the_timeout(
    pg_url: str, proxy: TcpProxy
) -> None:
    # Given the store (direct) and the app's own engine reaching the same database through a
    # proxy (its URL still the store's: connect_args sends it to the proxy),
    store = Store(pg_url, database_timeout=TIMEOUT)
    metadata.create_all(store.engine)
    app_engine = sa.create_engine(pg_url, connect_args={"port": proxy.port})

    def block(fence: Any, *, stall: str) -> None:
        with fence.transaction(bind=app_engine) as conn:
            _write(conn, fence)
            if stall == "commit":
                _stall_after_the_ownership_check(conn, proxy)
            else:
                proxy.stall()
            if stall == "rollback":
                raise ValueError("the body failed inside its block")

    # when the proxy stops forwarding before the ownership check, before the COMMIT, and
    # before the ROLLBACK of an exception, then each block ends within the timeout:
    for stall, expected in (
        ("check", sa.exc.DBAPIError),
        ("commit", sa.exc.DBAPIError),
        ("rollback", ValueError),  # the body's own error, not the rollback's
    ):
        fence = _attempt(store)
        error = _ends_within_the_bound(functools.partial(block, fence, stall=stall))
        assert isinstance(error, expected), (stall, error)
        proxy.unstall()
        # and the attempt still owns its key (a cut commit's outcome is unknown; the check
        # and the rollback cases wrote nothing).
        record = store.get(fence.key)
        assert record is not None and record.attempt_id == fence.attempt_id, stall
        if stall != "commit":
            assert _writers(store, fence.key) == [], stall
    app_engine.dispose()
    store.dispose()


def test_postgresql_a_block_on_the_stores_engine_commits_within_the_timeout(
    pg_url: str, proxy: TcpProxy
) -> None:
    url = sa.engine.make_url(pg_url).set(host="127.0.0.1", port=proxy.port)
    store = Store(url.render_as_string(hide_password=False), database_timeout=TIMEOUT)
    metadata.create_all(store.engine)
    fence = _attempt(store)

    def block() -> None:
        with fence.transaction() as conn:
            _write(conn, fence)
            _stall_after_the_ownership_check(conn, proxy)

    error = _ends_within_the_bound(block)
    assert isinstance(error, sa.exc.DBAPIError), error
    proxy.unstall()
    store.dispose()


def test_sqlite_a_block_waits_for_the_write_lock_at_most_the_timeout(sqlite_url: str) -> None:
    store = Store(sqlite_url, database_timeout=TIMEOUT)
    metadata.create_all(store.engine)
    fence = _attempt(store, f"lock:{uuid.uuid4().hex}")
    # Given another connection holding the database's write lock,
    holder = sqlite3.connect(sa.make_url(sqlite_url).database or "", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        # when the attempt opens a block, it fails within the timeout (not the store's 30 s),
        def block() -> None:
            with fence.transaction() as conn:
                _write(conn, fence)

        error = _ends_within_the_bound(block)
        assert isinstance(error, sa.exc.OperationalError), error
        assert "locked" in str(error)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    # and the store's connections wait as long as before for their own statements.
    with store.engine.connect() as conn:
        busy = [conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() for _ in range(3)]
    assert busy == [30000] * 3
    with fence.transaction() as conn:
        _write(conn, fence)
    assert _writers(store, fence.key) == [fence.attempt_id] * 2
    store.dispose()
