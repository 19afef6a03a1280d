"""``self.fence.transaction()`` and ``self.fence.session()``: the app's own writes, fenced.

The block's connection is in one transaction on the store's database. Its commit — at the end of
the block, or any ``conn.commit()`` / ``session.commit()`` inside it — first checks, in that same
transaction, that this attempt still owns its key:

1. the lease, locally (``fence.check()``: an attempt that was paused past its lease stops here,
   without a round trip), then
2. the store: one fenced ``UPDATE fence_jobs ... WHERE key, generation, attempt, status =
   'running' RETURNING`` (:meth:`Store.commit_check`). On PostgreSQL, under Read Committed, a
   newer registration either committed first (the update finds no row), or is in flight (the
   update waits for it, then re-checks the new row: no row), or comes later (it waits for this
   transaction's row lock): no newer generation registers between the check and the commit. On
   SQLite the block is one ``BEGIN IMMEDIATE`` transaction: it holds the database's write lock
   from its first statement, so nothing registers while it is open.

No row: the transaction is rolled back and :class:`StaleGeneration` is raised out of the block
(and again on entry to any later block of the attempt). The lease is also checked on entry, like
``guard()``. An exception inside the block rolls it back and goes on up.

A holder paused inside a block holds its transaction's locks. On PostgreSQL the block sets
``idle_in_transaction_session_timeout`` to the lease TTL (the server ends a session that waits that
long between two statements, which rolls it back) and ``lock_timeout`` to :data:`LOCK_TIMEOUT_TTLS`
TTLs (a newer attempt's block waits that long at most for rows a paused holder locked); the store's
own statements wait ``fence_lock_timeout`` (a registration then fails and its message is re-sent).
On SQLite nothing can end a stopped process's transaction: every write to the database waits until
the holder resumes (its commit is then refused: the lease is lost) or dies.

Nested blocks share the outermost block's connection: an inner block is a SAVEPOINT (an exception
inside it rolls back to the savepoint), and the commit — fenced — is the outermost block's.
``fence_unfenced`` (the chaos harness's control arm, never a production setting) turns the block
into what it replaces: ``guard()`` on entry, then a plain transaction.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .errors import ConfigurationError, FenceError, LeaseLost
from .store import sql

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from .fence import Fence
    from .store import Store

#: A block's ``lock_timeout`` on PostgreSQL, in lease TTLs: long enough to outwait a paused
#: holder, whose session the server ends after one TTL idle in its transaction.
LOCK_TIMEOUT_TTLS = 2.0

_LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})


@dataclass
class Block:
    """The outermost open block of one attempt: its engine, its connection, and the refusal of
    its commit (kept so a refusal swallowed inside the block still ends it)."""

    engine: sa.Engine
    conn: sa.Connection
    refused: FenceError | None = None


@contextlib.contextmanager
def transaction(fence: Fence, bind: sa.Engine | None = None) -> Iterator[sa.Connection]:
    """``with self.fence.transaction() as conn:`` — see the module docstring."""
    if fence._block is not None:
        conn = _join(fence, fence._block, bind, "transaction")
        with conn.begin_nested():
            yield conn
        return
    with _outermost(fence, bind) as block:
        block.conn.begin()
        yield block.conn
        if block.conn.in_transaction():
            block.conn.commit()  # fenced: _on_commit


@contextlib.contextmanager
def session(
    fence: Fence, factory: Callable[..., Session], bind: sa.Engine | None = None
) -> Iterator[Session]:
    """``with self.fence.session(SessionFactory) as session:`` — an ORM ``Session`` on a fenced
    connection. Every ``session.commit()`` is fenced like the block's commit; the block commits
    what is left at its end and rolls back on an exception. ``bind`` defaults to the factory's own
    engine (a ``sessionmaker(bind=engine)``), else the store's."""
    if bind is None:
        bind = _factory_engine(factory)
    if fence._block is not None:  # joins the open block in a savepoint; the outer one commits
        conn = _join(fence, fence._block, bind, "session")
        nested = factory(bind=conn, join_transaction_mode="create_savepoint")
        try:
            yield nested
            nested.commit()  # releases its savepoint
        except BaseException:
            nested.rollback()
            raise
        finally:
            nested.close()
        return
    with _outermost(fence, bind) as block:
        s = factory(bind=block.conn)
        try:
            yield s
            if s.in_transaction():
                s.commit()  # fenced: _on_commit
        except BaseException:
            with contextlib.suppress(Exception):
                s.rollback()
            raise
        finally:
            s.close()


@contextlib.contextmanager
def _outermost(fence: Fence, bind: sa.Engine | None) -> Iterator[Block]:
    store = _store_of(fence)
    if fence._atomic:
        raise FenceError(
            "fence.transaction()/session() inside an open fence.atomic() block: the two are "
            "separate connections, and a fenced commit covers one. Write through Django's ORM "
            "inside fence.atomic(), or run the blocks one after another."
        )
    if fence._refused is not None:
        raise _again(fence._refused)
    fence.check()  # guard() semantics: a lost lease stops the work before the block
    if fence._before_block is not None:
        fence._before_block()
    engine = store.engine if bind is None else checked_bind(store, bind)
    conn = engine.connect()
    block = Block(engine, conn)
    try:
        if conn.dialect.name == "postgresql":
            conn.execution_options(isolation_level="READ COMMITTED")
        else:  # the driver's own transaction handling off: the BEGIN (IMMEDIATE) is ours
            conn.execution_options(isolation_level="AUTOCOMMIT")
        sa.event.listen(conn, "begin", functools.partial(_on_begin, fence, store))
        sa.event.listen(conn, "commit", functools.partial(_on_commit, fence, store, block))
        fence._block = block
        try:
            yield block
        except BaseException:
            _rollback(conn)
            fence._block = None
            _record_loss(fence)
            raise
        if block.refused is not None:  # refused inside the block, and the refusal swallowed
            _rollback(conn)
            fence._block = None
            _record_loss(fence)
            raise _again(block.refused)
    finally:
        fence._block = None
        conn.close()


def _join(fence: Fence, block: Block, bind: sa.Engine | None, what: str) -> sa.Connection:
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
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql(sql.begin("sqlite", immediate=not store.unfenced))
    elif not store.unfenced:
        ttl_ms = math.ceil(fence._lease.ttl * 1000)
        conn.exec_driver_sql(sql.pg_block_bounds(ttl_ms, math.ceil(ttl_ms * LOCK_TIMEOUT_TTLS)))


def _on_commit(fence: Fence, store: Store, block: Block, conn: sa.Connection) -> None:
    """Just before the connection commits: the ownership check, in the same transaction. A
    refusal rolls the transaction back here (SQLAlchemy would otherwise leave the driver's
    transaction open behind a failed commit) and raises out of the commit."""
    if store.unfenced:
        return  # the chaos control arm: a plain commit
    try:
        fence.check()  # LeaseLost: paused past the lease inside the block
        owner = store.commit_check(
            conn, fence.key, generation=fence.generation, attempt_id=fence.attempt_id
        )
    except BaseException as exc:
        _rollback_driver(conn)
        if isinstance(exc, FenceError):
            block.refused = exc
        raise
    if owner:
        return
    _rollback_driver(conn)
    refused = store._rejected(fence.key, fence.generation, fence.attempt_id, "fenced commit")
    block.refused = fence._refused = refused
    raise refused


def unrecorded_loss(fence: Fence) -> LeaseLost:
    """The ``LeaseLost`` of a check inside an open block, whose loss is recorded (and signalled)
    after the block rolled back: :func:`_record_loss`."""
    return LeaseLost(
        f"lease lost for key {fence.key!r} at generation {fence.generation}: "
        f"{fence._lease.lost_reason or 'deadline passed without a confirmed renewal'}",
        key=fence.key,
        generation=fence.generation,
    )


def _record_loss(fence: Fence) -> None:
    """Mark and record a loss seen inside the block, now that it no longer holds locks."""
    with contextlib.suppress(LeaseLost):
        fence.check()


def _rollback_driver(conn: sa.Connection) -> None:
    try:
        conn.connection.dbapi_connection.rollback()  # type: ignore[union-attr]
    except Exception:
        conn.invalidate()  # never back to the pool with a transaction open


def _rollback(conn: sa.Connection) -> None:
    if conn.invalidated:
        return
    try:
        if conn.in_transaction():
            conn.rollback()
        conn.connection.dbapi_connection.rollback()  # type: ignore[union-attr]
    except Exception:
        conn.invalidate()


def _again(refused: FenceError) -> FenceError:
    """A fresh exception with the refusal's message and context (a raised exception object
    carries its traceback; do not raise the same one twice)."""
    return type(refused)(str(refused), **refused.context)


def _store_of(fence: Fence) -> Store:
    if fence._store is None:
        raise FenceError(
            f"fence.transaction() for {fence.key!r} has no store: it is only available inside "
            "a fenced task's body (self.fence, with @app.task(base=FencedTask, bind=True))"
        )
    return fence._store


def _factory_engine(factory: Callable[..., Any]) -> sa.Engine | None:
    bound = getattr(factory, "kw", {}).get("bind")  # a sessionmaker(bind=...)
    return bound if isinstance(bound, sa.Engine) else None


def checked_bind(store: Store, bind: Any) -> sa.Engine:
    """``bind`` if it is an ``Engine`` on the store's database, else a clear
    :class:`ConfigurationError` (never a silently unfenced write)."""
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


def different_database(ours: sa.URL, theirs: sa.URL) -> str | None:
    """Why two URLs name different databases, or None when they name the same one: the same
    backend, host (local names alike), port and database; for SQLite the same file."""
    if ours.get_backend_name() != theirs.get_backend_name():
        return f"backend {theirs.get_backend_name()}, the store's is {ours.get_backend_name()}"
    if ours.get_backend_name() == "sqlite":
        a, b = _sqlite_file(ours), _sqlite_file(theirs)
        if a is None or b is None:
            return "an in-memory SQLite database is never the store's"
        return None if a == b else f"file {b}, the store's is {a}"
    host = [(u.host or "").lower() for u in (ours, theirs)]
    host = ["localhost" if h in _LOCAL_HOSTS else h for h in host]
    if host[0] != host[1]:
        return f"host {theirs.host}, the store's is {ours.host}"
    if (ours.port or 5432) != (theirs.port or 5432):
        return f"port {theirs.port}, the store's is {ours.port}"
    if ours.database != theirs.database:
        return f"database {theirs.database}, the store's is {ours.database}"
    return None


def _sqlite_file(url: sa.URL) -> str | None:
    database = url.database or ""
    if database in ("", ":memory:") or "mode=memory" in database:
        return None
    if database.startswith("file:"):
        database = database[len("file:") :].split("?", 1)[0]
    return os.path.realpath(database)
