"""The statements that set up the store's sessions and transactions, per dialect: SQLite's
pragmas, ``BEGIN`` (``BEGIN IMMEDIATE`` on SQLite), PostgreSQL's lock, statement and idle
bounds of a fenced block and its marker, and whether a transaction wrote (by what the server
says). Run by :mod:`.engine` and :mod:`.blocks`, and on the user's connection by
:mod:`celery_fence.body.transaction` and :mod:`celery_fence.body.sqla`."""

from __future__ import annotations

from typing import Any

SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA busy_timeout=30000",
)
#: SQLite: a job's ending is synced to disk at its COMMIT: ``sync_ending`` in queries.sql.
BEGIN_IMMEDIATE, COMMIT, ROLLBACK = "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK"
NO_STATEMENT_TIMEOUT = "SET LOCAL statement_timeout = 0"


def begin(dialect: str, *, immediate: bool = True) -> str:
    """A transaction's start; on SQLite ``BEGIN IMMEDIATE`` takes the write lock up front."""
    return BEGIN_IMMEDIATE if dialect == "sqlite" and immediate else "BEGIN"


def pg_lock_timeout(ms: int) -> str:
    return f"SET lock_timeout = {int(ms)}"


def pg_block_bounds(idle_ms: int, lock_ms: int, statement_ms: int | None = None) -> str:
    """A fenced block's limits on PostgreSQL, for its transaction only."""
    statement = (
        ""
        if statement_ms is None
        else (f", set_config('statement_timeout', '{int(statement_ms)}', true)")
    )
    return (
        f"SELECT set_config('idle_in_transaction_session_timeout', '{int(idle_ms)}', true), "
        f"set_config('lock_timeout', '{int(lock_ms)}', true){statement}, "
        f"set_config('{PG_BLOCK_MARKER}', 'on', true)"
    )


#: Whether the current PostgreSQL transaction wrote (true/false), by what the server says, never
#: by the statements' text: a transaction that changed data has a transaction id
#: (``pg_current_xact_id_if_assigned()``) and still holds a lock stronger than ``RowShareLock`` on
#: a relation (``RowExclusiveLock`` of an INSERT/UPDATE/DELETE/MERGE/COPY FROM, whatever function,
#: procedure, trigger or ``DO`` block made it; the ``AccessExclusiveLock`` of DDL and TRUNCATE).
#: A transaction that only locked rows (``SELECT ... FOR UPDATE [SKIP LOCKED]``) also has an id,
#: but holds ``RowShareLock`` only: a read. The lock list is read only once an id is assigned
#: (CASE evaluates in order), so a transaction that read costs one function call. PostgreSQL 13+.
PG_TRANSACTION_WROTE = (
    "SELECT CASE WHEN pg_current_xact_id_if_assigned() IS NULL THEN false ELSE EXISTS ("
    "SELECT 1 FROM pg_catalog.pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation' "
    "AND granted AND mode NOT IN ('AccessShareLock', 'RowShareLock')) END"
)
#: :data:`PG_TRANSACTION_WROTE` for PostgreSQL 10 to 12 (``txid_current_if_assigned()``).
PG_TRANSACTION_WROTE_BEFORE_13 = PG_TRANSACTION_WROTE.replace(
    "pg_current_xact_id_if_assigned()", "txid_current_if_assigned()"
)
#: SQLite: the rows this connection changed since it opened (INSERT/UPDATE/DELETE, triggers
#: included; DDL is not counted). A transaction wrote when the count moved since its BEGIN.
SQLITE_TOTAL_CHANGES = "SELECT total_changes()"
#: A transaction-local marker a PostgreSQL ``fence.transaction()`` block sets at its BEGIN
#: (:func:`pg_block_bounds`): still set at the block's commit only if the block's transaction
#: did not end under it (a raw ``COMMIT`` on the block's connection).
PG_BLOCK_MARKER = "celery_fence.block"
PG_BLOCK_MARKER_READ = f"SELECT current_setting('{PG_BLOCK_MARKER}', true)"


def pg_transaction_wrote(server_version: tuple[Any, ...] | None) -> str:
    """:data:`PG_TRANSACTION_WROTE` for a server of ``server_version`` (None: 13 or later)."""
    old = server_version is not None and tuple(server_version[:1]) < (13,)
    return PG_TRANSACTION_WROTE_BEFORE_13 if old else PG_TRANSACTION_WROTE


def pg_statement_timeout(ms: int) -> str:
    """A statement timeout for the rest of the current transaction only."""
    return f"SELECT set_config('statement_timeout', '{int(ms)}', true)"


def sqlite_busy_timeout(ms: int | None = None) -> str:
    """Read (``ms`` None) or set how long an SQLite connection waits for a lock."""
    return "PRAGMA busy_timeout" if ms is None else f"PRAGMA busy_timeout = {int(ms)}"
