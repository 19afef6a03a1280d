"""Every SQLAlchemy write of a fenced body, seen by what the database says.

Five listeners on the :class:`sqlalchemy.Engine` class (every engine of the process), added once
by :func:`install`. Each starts with ``if WATCH.idle: return`` (no fenced body runs: one
attribute lookup), then looks only at a connection that is neither a fenced block's (marked
``conn.info[BLOCK_INFO]`` while the block is open; its commit is the fenced one) nor the store's
own (the connections of its own statements carry the execution option
:data:`~celery_fence.store.engine.OWN`), for code
:func:`~celery_fence.body.watch.attribution` attributes to a running attempt (never inside
:func:`~celery_fence.body.watch.bookkeeping`).

- **A transaction** (any connection not in autocommit): just before its COMMIT, did it write?
  PostgreSQL: :data:`~celery_fence.store.session_sql.PG_TRANSACTION_WROTE` on the connection (a
  transaction id is assigned and a writing lock is held: whatever the statement's text, a
  function, a procedure, a ``DO`` block, ``SELECT ... INTO``; a ``SELECT ... FOR UPDATE`` only
  locks, and is a read). SQLite: the connection's ``total_changes`` moved since the transaction
  began (while a fenced body runs, an SQLite transaction is begun explicitly before its first
  statement, so no write the driver would autocommit slips out of it; DDL is not counted).
  If it wrote: beside an open fenced block of the attempt it is rolled back and refused
  (:func:`~celery_fence.body.watch.beside_block_error`; on SQLite, whose block holds the write
  lock, a statement SQLite compiles as a write is refused before it runs: see
  :func:`_refuse_sqlite_write`); outside every block
  :func:`~celery_fence.body.watch.unfenced_write` applies ``fence_unfenced_writes``.
- **An autocommit statement** (an engine or connection with ``isolation_level="AUTOCOMMIT"``:
  no COMMIT to stop): the statement runs inside a transaction of the fence's own on the
  driver's connection — ``BEGIN``, the statement, the same check, then ``COMMIT``, or
  ``ROLLBACK`` and the refusal. A statement that cannot run in a transaction (``VACUUM``,
  ``CREATE INDEX CONCURRENTLY``) fails with the database's own error while a fenced body runs.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from celery_fence.body import watch
from celery_fence.body.watch import AMBIGUOUS, WATCH
from celery_fence.store import session_sql
from celery_fence.store.engine import OWN

if TYPE_CHECKING:
    from celery_fence.body.fence import Fence

#: ``conn.info`` key of a fenced block's connection while the block is open.
BLOCK_INFO = "fence_block"
_CHANGES = "fence_changes"  # SQLite: (the transaction, its total_changes at its start)
_TABLE = "fence_table"  # the last table a DML statement named (for the warning)
_WRAP = "fence_wrap"  # an autocommit statement runs in the fence's transaction

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Add the listeners to every SQLAlchemy engine, once per process."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        sa.event.listen(sa.Engine, "begin", _on_begin)
        sa.event.listen(sa.Engine, "before_cursor_execute", _before_statement)
        sa.event.listen(sa.Engine, "after_cursor_execute", _after_statement)
        sa.event.listen(sa.Engine, "handle_error", _on_error)
        sa.event.listen(sa.Engine, "commit", _on_commit)
        _installed = True


def _subject(conn: sa.Connection) -> Fence | object | None:
    """The attempt (or AMBIGUOUS) a statement on ``conn`` is for; None: not watched."""
    if conn.get_execution_options().get(OWN) or conn.info.get(BLOCK_INFO) is not None:
        return None
    return watch.attribution()


def _dbapi(conn: sa.Connection) -> Any:
    return conn.connection.dbapi_connection


def _autocommit(conn: sa.Connection, dbapi: Any) -> bool:
    if conn.dialect.name == "sqlite":
        return getattr(dbapi, "isolation_level", "") is None
    return bool(getattr(dbapi, "autocommit", False))


def _total_changes(dbapi: Any) -> int:
    changes = getattr(dbapi, "total_changes", None)
    if isinstance(changes, int):
        return changes
    cursor = dbapi.cursor()
    try:
        cursor.execute(session_sql.SQLITE_TOTAL_CHANGES)
        return int(cursor.fetchone()[0])
    finally:
        cursor.close()


def _in_transaction(conn: sa.Connection, dbapi: Any) -> bool:
    """Whether the driver's connection is inside a live transaction (PostgreSQL: libpq's
    status INTRANS or ACTIVE; an aborted one, INERROR, commits nothing: the server rolls it
    back)."""
    if conn.dialect.name == "sqlite":
        return bool(dbapi.in_transaction)
    info = getattr(dbapi, "info", None)
    status = getattr(info, "transaction_status", None)
    # psycopg2 and psycopg alike: 0 IDLE, 1 ACTIVE, 2 INTRANS, 3 INERROR, 4 UNKNOWN
    return status is None or int(status) in (1, 2)


def _baseline(conn: sa.Connection, dbapi: Any) -> None:
    """SQLite: remember ``total_changes`` at the start of ``conn``'s transaction."""
    conn.info[_CHANGES] = (conn.get_transaction(), _total_changes(dbapi))


def transaction_wrote(conn: sa.Connection, dbapi: Any | None = None) -> bool:
    """Whether ``conn``'s open transaction wrote, by what the database says."""
    dbapi = _dbapi(conn) if dbapi is None else dbapi
    if conn.dialect.name == "sqlite":
        entry = conn.info.get(_CHANGES)
        if entry is None or entry[0] is not conn.get_transaction():
            # began before a fenced body ran: pysqlite is in a transaction only once it wrote
            return bool(dbapi.in_transaction)
        return bool(_total_changes(dbapi) != entry[1])
    cursor = dbapi.cursor()
    try:
        cursor.execute(session_sql.pg_transaction_wrote(conn.dialect.server_version_info))
        row = cursor.fetchone()
    finally:
        cursor.close()
    return bool(row and row[0])


def where(conn: sa.Connection) -> str:
    """How a connection is named in the errors and the warning (no password)."""
    return f"SQLAlchemy engine {conn.engine.url.render_as_string(hide_password=True)}"


# -- the listeners ---------------------------------------------------------------------------


def _on_begin(conn: sa.Connection) -> None:
    if WATCH.idle:
        return
    if conn.dialect.name == "sqlite" and _subject(conn) is not None:
        _baseline(conn, _dbapi(conn))
    conn.info.pop(_TABLE, None)


def _before_statement(
    conn: sa.Connection, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
) -> None:
    if WATCH.idle:
        return
    subject = _subject(conn)
    if subject is None:
        return
    dbapi = _dbapi(conn)
    if conn.dialect.name == "sqlite" and _block_open(subject):
        _refuse_sqlite_write(conn, dbapi, subject, statement, parameters, many)
    if context is not None and (context.isinsert or context.isupdate or context.isdelete):
        table = getattr(getattr(context.compiled, "statement", None), "table", None)
        name = getattr(table, "name", None)
        if isinstance(name, str):
            conn.info[_TABLE] = name
    if _autocommit(conn, dbapi):
        if _in_transaction(conn, dbapi):
            return  # a transaction begun by hand on the driver: not seen (README)
        _run(dbapi, "BEGIN")
        conn.info[_WRAP] = subject
        if conn.dialect.name == "sqlite":
            _baseline(conn, dbapi)
        watch.hold()
    elif conn.dialect.name == "sqlite" and not dbapi.in_transaction:
        # pysqlite begins a transaction only before a statement it takes for a write: begin it
        # here, so a write it would not recognise cannot commit on its own.
        _run(dbapi, "BEGIN")
        entry = conn.info.get(_CHANGES)
        if entry is None or entry[0] is not conn.get_transaction():
            _baseline(conn, dbapi)


def _block_open(subject: Any) -> bool:
    if subject is AMBIGUOUS:
        return watch.block_open_anywhere()
    return bool(subject.blocks.any_open)


def _refuse_sqlite_write(
    conn: sa.Connection, dbapi: Any, subject: Any, statement: str, parameters: Any, many: bool
) -> None:
    """SQLite, a block of the attempt open: the block holds the database's write lock, so a
    write on another connection would wait for it (the block waits for this code: a deadlock
    until the busy timeout). Ask SQLite whether the statement writes before it runs — its
    compiled program opens a write transaction (``EXPLAIN``: a ``Transaction`` opcode with P2
    set, what ``sqlite3_stmt_readonly()`` reads) — and refuse it then."""
    if many and parameters and isinstance(parameters[0], (tuple, list, dict)):
        parameters = parameters[0]  # executemany: one row's (a batched INSERT's are flat)
    cursor = dbapi.cursor()
    try:
        cursor.execute(f"EXPLAIN {statement}", parameters)
        writes = any(row[1] == "Transaction" and row[3] for row in cursor.fetchall())
    except Exception:
        # SQLite cannot explain it: the statement runs; a write then waits on the block's lock
        # (the database still keeps it out) and its COMMIT is checked as any other.
        writes = False
    finally:
        cursor.close()
    if writes:
        here = where(conn)
        raise (
            watch.ambiguous_error(here) if subject is AMBIGUOUS else watch.beside_block_error(here)
        )


def _after_statement(
    conn: sa.Connection, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
) -> None:
    if WATCH.idle:
        return
    subject = conn.info.pop(_WRAP, None)
    if subject is None:
        return
    dbapi = _dbapi(conn)
    try:
        wrote = transaction_wrote(conn, dbapi)
        if wrote:
            _decide(conn, dbapi, subject)
    except BaseException:
        _end(conn, dbapi, "ROLLBACK")
        raise
    _end(conn, dbapi, "COMMIT")


def _on_error(context: Any) -> None:
    if WATCH.idle:
        return
    conn = context.connection
    if conn is None or conn.invalidated:
        return
    if conn.info.pop(_WRAP, None) is not None:
        _end(conn, _dbapi(conn), "ROLLBACK")


def before_commit(conn: sa.Connection) -> None:
    """The check of ``conn``'s transaction just before its COMMIT: the engine-wide listener, and
    what a listener of the connection's own that commits the driver itself must call first
    (connection listeners run before the engine-wide ones)."""
    _on_commit(conn)


def _on_commit(conn: sa.Connection) -> None:
    if WATCH.idle:
        return
    subject = _subject(conn)
    if subject is None:
        conn.info.pop(_CHANGES, None)
        return
    dbapi = _dbapi(conn)
    try:
        if _autocommit(conn, dbapi) or not _in_transaction(conn, dbapi):
            return  # nothing to commit: every autocommit statement was checked as it ran
        if transaction_wrote(conn, dbapi):
            try:
                _decide(conn, dbapi, subject)
            except BaseException:
                dbapi.rollback()  # SQLAlchemy's own commit then finds nothing to commit
                raise
    finally:
        conn.info.pop(_CHANGES, None)
        conn.info.pop(_TABLE, None)


def _decide(conn: sa.Connection, dbapi: Any, subject: Any) -> None:
    """A transaction on ``conn`` wrote for ``subject``: :func:`watch.judge` decides."""
    watch.judge(subject, where=where(conn), table=conn.info.get(_TABLE))


def _run(dbapi: Any, statement: str) -> None:
    cursor = dbapi.cursor()
    try:
        cursor.execute(statement)
    finally:
        cursor.close()


def _end(conn: sa.Connection, dbapi: Any, verb: str) -> None:
    """End the fence's own transaction around an autocommit statement."""
    try:
        _run(dbapi, verb)
    finally:
        conn.info.pop(_CHANGES, None)
        watch.release()


__all__ = ["BLOCK_INFO", "before_commit", "install", "transaction_wrote", "where"]
