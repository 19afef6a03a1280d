"""``self.fence.transaction()`` and ``self.fence.session()``: the app's own writes, fenced.

The block's connection is in one transaction on the store's database. Its commit — at the end of
the block, or any ``conn.commit()`` / ``session.commit()`` inside it — first checks, in that same
transaction, that this attempt still owns its key:

1. the lease, locally (``fence.check()``: an attempt that was paused past its lease stops here,
   without a round trip), then
2. the store: one fenced ``UPDATE fence_jobs ... WHERE key, generation, attempt, status =
   'running' RETURNING`` (``store.blocks.commit_check``), at Read Committed on PostgreSQL and in one
   ``BEGIN IMMEDIATE`` transaction on SQLite. Why that is enough: docs/design.md, "Why the check
   is enough (Read Committed)".

No row: the transaction is rolled back and :class:`StaleGeneration` is raised out of the block
(and again on entry to any later block of the attempt). The lease is also checked on entry, like
``guard()``. An exception inside the block rolls it back and goes on up.

**Sessions**: ``fence.session()`` (:mod:`celery_fence.body.orm`) is an ORM session on this block.

**Every wait is bounded by** ``fence_database_timeout``: each statement (the ownership check
too), the COMMIT and the ROLLBACK. On PostgreSQL the block sets ``statement_timeout`` and the
watchdog (:mod:`celery_fence.store.watchdog`) cuts a call still waiting past the timeout — a peer
that stopped answering — which fails it as a lost connection; on SQLite the block's busy timeout is
the timeout. A commit cut that way has an unknown outcome, like any commit whose answer was lost:
the block raises, the attempt takes its error path (a retry), and a write keyed by the job makes
the retry converge.

A holder paused inside a block holds its transaction's locks. On PostgreSQL the block sets
``idle_in_transaction_session_timeout`` to the lease TTL (the server ends a session that waits that
long between two statements, which rolls it back) and ``lock_timeout`` to
:data:`~celery_fence.store.blocks.LOCK_TIMEOUT_TTLS` TTLs, at most ``fence_database_timeout`` (a
newer attempt's block waits that long for rows a paused holder locked, then fails and retries); the
store's own statements wait ``fence_lock_timeout`` (a registration then fails and its message is
re-sent). On SQLite nothing can end a stopped process's transaction: every write to the database
waits until the holder resumes (its commit is then refused: the lease is lost) or dies.

Nested blocks share the outermost block's connection: an inner block is a SAVEPOINT (an exception
inside it rolls back to the savepoint), and the commit — fenced — is the outermost block's. Each
thread has its own outermost block (a connection is never shared between threads). A lease loss
seen while a block is open is recorded once the last open block has closed (on SQLite the block
holds the write lock the record needs). The chaos harness's store without the fence (its control
arm, never a production setting) turns the block into what it replaces: ``guard()`` on entry,
then a plain transaction.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_fence import django_port, metrics
from celery_fence.body import sqla, watch
from celery_fence.body.blocks import Block, again
from celery_fence.errors import BlockIdleTimeout, ConfigurationError, FenceError
from celery_fence.store import session_sql
from celery_fence.store.urls import different_database
from celery_fence.store.watchdog import watchdog

if TYPE_CHECKING:
    from celery_fence.body.fence import Fence
    from celery_fence.store import Store


@contextlib.contextmanager
def transaction(fence: Fence, bind: sa.Engine | None = None) -> Iterator[sa.Connection]:
    """``with self.fence.transaction() as conn:`` — see the module docstring."""
    block = fence.blocks.current()
    if block is not None:
        conn = join_block(fence, block, bind, "transaction")
        with conn.begin_nested():
            yield conn
        return
    with open_block(fence, bind) as block:
        block.conn.begin()
        yield block.conn
        if block.conn.in_transaction():
            block.conn.commit()  # fenced: _on_commit


@contextlib.contextmanager
def open_block(fence: Fence, bind: sa.Engine | None) -> Iterator[Block]:
    store = store_of(fence)
    if fence.blocks.atomic.here():
        raise FenceError(
            "fence.transaction()/session() inside an open fence.atomic() block: the two are "
            "separate connections, and a fenced commit covers one. Write through Django's ORM "
            "inside fence.atomic(), or run the blocks one after another."
        )
    fence.prepare_block()
    engine = store.engine if bind is None else checked_bind(store, bind)
    conn = engine.connect()
    block = Block(engine, conn)
    busy_timeout: int | None = None
    try:
        busy_timeout = _bound_waits(store, block)
        sa.event.listen(conn, "begin", functools.partial(_on_begin, fence, store))
        sa.event.listen(conn, "commit", functools.partial(_on_commit, fence, store, block))
        sa.event.listen(conn, "rollback", functools.partial(_on_rollback, store))
        sa.event.listen(conn, "before_cursor_execute", functools.partial(_statement_starts, block))
        sa.event.listen(conn, "after_cursor_execute", functools.partial(_statement_ended, block))
        fence.blocks.add(block)
        sqla.install()
        conn.info[sqla.BLOCK_INFO] = block  # its commit is the fenced one: not watched
        # A fence made by hand (a test) is watched for the block's duration, like a body's.
        watched = contextlib.nullcontext() if watch.is_running(fence) else watch.running(fence)
        watch_django()
        try:
            with watched:
                yield block
        except BaseException as exc:
            _rollback(store, conn)
            idle = _idle_timeout(fence, block, exc)
            if idle is not None:
                raise idle from exc
            raise
        if block.refused is not None:  # refused inside the block, and the refusal swallowed
            _rollback(store, conn)
            raise again(block.refused)
    finally:
        try:
            if busy_timeout is not None and not conn.invalidated:
                with contextlib.suppress(Exception):
                    _raw(conn, session_sql.sqlite_busy_timeout(busy_timeout))
            if not conn.invalidated:  # (an invalidated connection would reconnect here)
                _disarm_statement(conn)  # a statement that ended without either event
            if not conn.invalidated:
                conn.info.pop(sqla.BLOCK_INFO, None)
            conn.close()
        finally:
            fence.blocks.remove(block, fence.lease)  # records a loss seen inside the block


def watch_django() -> None:
    """In a process with Django configured, watch its ORM writes too (once per process): a Django
    write beside an open block is refused, one outside every block of a fenced body flagged
    (:mod:`celery_fence.contrib.django.guard`, reached through :mod:`celery_fence.django_port`).
    Django is never imported here."""
    if django_port.django_configured():
        django_port.django_side("Watching Django's ORM writes in a fenced body").watch_writes()


def _bound_waits(store: Store, block: Block) -> int | None:
    """Set the block's connection up so that each of its waits ends within
    ``fence_database_timeout``. SQLite: its busy timeout for the block's duration (returned, to be
    put back). PostgreSQL: statements on an engine that is not the store's are armed on the
    watchdog (the store's engine arms its own); ``_on_begin`` sets ``statement_timeout``, and
    COMMIT and ROLLBACK are armed by :func:`_end_driver_transaction`."""
    conn = block.conn
    if conn.dialect.name == "sqlite":
        # The driver's own transaction handling off: the BEGIN (IMMEDIATE) is ours.
        conn.execution_options(isolation_level="AUTOCOMMIT")
        previous = int(_raw(conn, session_sql.sqlite_busy_timeout()))
        _raw(conn, session_sql.sqlite_busy_timeout(math.ceil(store.database_timeout * 1000)))
        return previous
    conn.execution_options(isolation_level="READ COMMITTED")
    if block.engine is not store.engine:
        _watch_statements(block.engine)
        conn.execution_options(fence_block_timeout=store.database_timeout)
    return None


def _statement_starts(block: Block, *_: Any) -> None:
    block.idle = time.monotonic() - block.active_at


def _statement_ended(block: Block, *_: Any) -> None:
    block.active_at = time.monotonic()


#: What PostgreSQL's end of an idle transaction looks like: psycopg 3 gets its SQLSTATE and
#: message; psycopg2 mostly only sees the connection closed.
IDLE_TIMEOUT_SQLSTATE = "25P03"


def _idle_timeout(fence: Fence, block: Block, exc: BaseException) -> BlockIdleTimeout | None:
    """:func:`idle_timeout` for a ``transaction()``/``session()`` block."""
    if block.conn.dialect.name != "postgresql" or not isinstance(exc, sa.exc.DBAPIError):
        return None
    return idle_timeout(fence, block.idle, exc, disconnected=exc.connection_invalidated)


def idle_timeout(
    fence: Fence, idle: float, exc: BaseException, *, disconnected: bool
) -> BlockIdleTimeout | None:
    """The error to raise instead of ``exc`` when PostgreSQL ended a fenced block's session for
    staying idle in its transaction longer than the lease TTL (its
    ``idle_in_transaction_session_timeout``), else None. psycopg 3 says so (``25P03``, in the
    chain of ``exc``); psycopg2 sees a closed connection (``disconnected``): it is the timeout
    when the block's statement that failed came after an idle gap (``idle``) of about a TTL."""
    ttl = fence.lease.ttl
    said = False
    seen: BaseException | None = exc
    for _ in range(4):  # exc, the driver's error it wraps, what that was raised from
        if seen is None:
            break
        code = getattr(seen, "sqlstate", None) or getattr(seen, "pgcode", None)
        said = said or code == IDLE_TIMEOUT_SQLSTATE or "idle-in-transaction timeout" in str(seen)
        seen = getattr(seen, "orig", None) or seen.__cause__
    if not said and not (disconnected and idle >= ttl * 0.95):
        return None
    return BlockIdleTimeout(
        f"PostgreSQL ended the fenced block of {fence.key!r}: it stayed idle {idle:.1f}s "
        f"between two statements, and a block may not stay idle between two statements longer "
        f"than fence_lease_ttl ({ttl:g}s, its idle_in_transaction_session_timeout). Nothing of "
        "the block committed. Do slow work (HTTP calls, sleeps, computation) before the block "
        "and keep only the writes inside it, or raise fence_lease_ttl.",
        lease_ttl=ttl,
        idle=round(idle, 3),
    )


def _raw(conn: sa.Connection, statement: str) -> Any:
    """Run one statement on the driver's connection, outside SQLAlchemy's transaction (which
    would begin the block's); the first column of its first row."""
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cursor.execute(statement)
        row = cursor.fetchone() if cursor.description else None
        return None if row is None else row[0]
    finally:
        cursor.close()


_watching = threading.Lock()


def _watch_statements(engine: sa.Engine) -> None:
    """Arm the watchdog for every statement a fenced block runs on ``engine`` (your engine,
    passed as ``bind=``): three listeners added once, which act only on a connection with the
    execution option ``fence_block_timeout``."""
    with _watching:
        if not sa.event.contains(engine, "before_cursor_execute", _arm_statement):
            sa.event.listen(engine, "before_cursor_execute", _arm_statement)
            sa.event.listen(engine, "after_cursor_execute", _disarm_statement)
            sa.event.listen(engine, "handle_error", _disarm_statement_on_error)


def _arm_statement(conn: sa.Connection, cursor: Any, *_: Any) -> None:
    timeout = conn.get_execution_options().get("fence_block_timeout")
    if timeout is not None:
        conn.info["fence_block_watch"] = watchdog().arm(cursor.connection.fileno(), timeout)


def _disarm_statement(conn: sa.Connection, *_: Any) -> None:
    watchdog().disarm(conn.info.pop("fence_block_watch", None))


def _disarm_statement_on_error(context: Any) -> None:
    if context.connection is not None:
        _disarm_statement(context.connection)


def join_block(fence: Fence, block: Block, bind: sa.Engine | None, what: str) -> sa.Connection:
    if bind is not None and bind is not block.engine:
        raise FenceError(
            f"fence.{what}(bind=...) inside an open fence block on another engine: a nested block "
            "shares the outer block's connection and transaction. Pass the same engine (or none), "
            "or run the blocks one after another."
        )
    fence.check()
    return block.conn


def _on_begin(fence: Fence, store: Store, conn: sa.Connection) -> None:
    """Every transaction the block's connection begins (the block's, and one after a commit
    inside it)."""
    store.blocks.begin(conn, fence.lease.ttl)


def _on_commit(fence: Fence, store: Store, block: Block, conn: sa.Connection) -> None:
    """Just before the connection commits: the lease check and the ownership check, in the same
    transaction, then the driver's COMMIT, bounded. A refusal rolls the transaction back here
    (SQLAlchemy would otherwise leave the driver's transaction open behind a failed commit) and
    raises out of the commit. A transaction that ended under the block (a raw COMMIT on its
    connection committed what came before, unchecked) is said as such, never as "nothing of the
    block commits". With tracing on, the check and the COMMIT are the attempt's ``fence commit``
    span."""
    execution = fence.execution
    if execution is None:  # a fence made by hand (a test): no attempt, no span
        _commit_checked(fence, store, block, conn)
        return
    with execution.committing("sqlalchemy"):
        _commit_checked(fence, store, block, conn)


def _commit_checked(fence: Fence, store: Store, block: Block, conn: sa.Connection) -> None:
    """The check and the COMMIT (:func:`_on_commit`), timed for the metrics when they are on."""
    observer = metrics.active
    started = time.perf_counter() if observer is not None else 0.0
    try:
        if store.blocks.transaction_ended(conn, ask=False):
            raise watch.raw_commit_error(sqla.where(conn))
        owner = store.blocks.owner(conn, fence)  # LeaseLost: paused past the lease in the block
        if not owner and store.blocks.transaction_ended(conn):
            raise watch.raw_commit_error(sqla.where(conn))
    except BaseException as exc:
        _end_driver_transaction(store, conn, "rollback", quiet=True)
        if isinstance(exc, FenceError):
            block.refused = exc
        raise
    if not owner:
        _end_driver_transaction(store, conn, "rollback", quiet=True)
        refused = store._rejected(fence.key, fence.generation, fence.attempt_id, "fenced commit")
        refused.context["where"] = "block"
        block.refused = fence.blocks.refused = refused
        raise refused
    _end_driver_transaction(store, conn, "commit")
    if observer is not None:
        task = fence.execution.task_name if fence.execution is not None else "unknown"
        observer.committed(task, "block", time.perf_counter() - started)


def _on_rollback(store: Store, conn: sa.Connection) -> None:
    """Every rollback of the block's transaction: the driver's ROLLBACK, bounded."""
    _end_driver_transaction(store, conn, "rollback", quiet=True)


def _end_driver_transaction(
    store: Store, conn: sa.Connection, verb: str, *, quiet: bool = False
) -> None:
    """The driver's ``commit()`` or ``rollback()``, bounded by ``fence_database_timeout`` (on
    PostgreSQL armed on the watchdog; on SQLite the block's busy timeout). SQLAlchemy's own call
    after it finds no transaction open and returns without a round trip. A failure invalidates
    the connection (never back to the pool inside a transaction; the server rolls a lost
    session's transaction back) and is raised as SQLAlchemy's error, unless ``quiet``."""
    if conn.invalidated:
        return
    dbapi_conn: Any = conn.connection.dbapi_connection
    token = None
    try:
        if conn.dialect.name == "postgresql":
            token = watchdog().arm(dbapi_conn.fileno(), store.database_timeout)
        getattr(dbapi_conn, verb)()
    except conn.dialect.loaded_dbapi.Error as exc:
        conn.invalidate()
        if quiet:
            return
        raise sa.exc.DBAPIError.instance(
            None,
            None,
            exc,
            conn.dialect.loaded_dbapi.Error,
            hide_parameters=True,
            connection_invalidated=True,
            dialect=conn.dialect,
        ) from exc
    finally:
        watchdog().disarm(token)


def _rollback(store: Store, conn: sa.Connection) -> None:
    if conn.invalidated:
        return
    try:
        if conn.in_transaction():
            conn.rollback()  # _on_rollback
        _end_driver_transaction(store, conn, "rollback", quiet=True)  # a BEGIN of our own
    except Exception:
        conn.invalidate()


def store_of(fence: Fence, block: str = "fence.transaction()", task: str = "@app.task") -> Store:
    """The store ``fence``'s ``block`` runs on; a :class:`FenceError` outside a fenced body
    (``task``: how the user declares one, as the error shows it)."""
    if fence.store is None:
        raise FenceError(
            f"{block} for {fence.key!r} has no store: it is only available inside a fenced "
            f"task's body (self.fence, with {task}(base=FencedTask, bind=True))"
        )
    return fence.store


def checked_bind(store: Store, bind: Any) -> sa.Engine:
    """``bind`` if it is an ``Engine`` on the store's database, else a clear
    :class:`ConfigurationError` (never a silent write past the fence)."""
    if type(bind).__module__.startswith("django."):
        raise ConfigurationError(
            "fence.transaction(bind=...) got a Django database connection: Django's ORM writes on "
            "its own connection, which an SQLAlchemy block cannot fence. Use "
            "`with self.fence.atomic():` (Django's transaction.atomic with a fenced commit) "
            "instead, with CELERY_FENCE_DATABASE set to that connection's alias."
        )
    if not isinstance(bind, sa.Engine):
        raise ConfigurationError(
            f"fence.transaction(bind=...) takes an SQLAlchemy Engine, not {type(bind).__name__}"
        )
    ours = sa.engine.make_url(store.url)
    reason = different_database(ours, bind.url)
    if reason is not None:
        raise ConfigurationError(
            f"fence.transaction(bind=engine): the engine is on {bind.url.render_as_string()}, "
            f"not on the fence store's database {ours.render_as_string()} ({reason}). A fenced "
            "commit checks ownership in the same transaction as your writes, so both live in one "
            "database: pass an engine on fence_database_url's database, or set "
            "fence_database_url to your app's database."
        )
    return bind
