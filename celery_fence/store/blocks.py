"""The store's side of a fenced block (``fence.transaction()``, ``session()``, ``atomic()``):
``store.blocks``. The block runs on the caller's connection (:mod:`celery_fence.body.transaction`,
:mod:`celery_fence.contrib.django.atomic`); these verbs begin its transaction with its bounds,
and check, just before it commits and in that same transaction, that its attempt still owns the
key."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import sqlalchemy as sa

from celery_fence.schema import utcnow
from celery_fence.store import session_sql, sql

if TYPE_CHECKING:
    from celery_fence.store.jobs import Store

#: A block's ``lock_timeout`` on PostgreSQL, in lease TTLs (at most ``fence_database_timeout``):
#: long enough to outwait a paused holder, whose session the server ends after one TTL idle in
#: its transaction.
LOCK_TIMEOUT_TTLS = 2.0


class BlockOwner(Protocol):
    """The attempt a block belongs to, as the store's check needs it (a
    :class:`~celery_fence.body.fence.Fence`): whose it is, and its lease's local check."""

    @property
    def key(self) -> str: ...

    @property
    def generation(self) -> int: ...

    @property
    def attempt_id(self) -> str: ...

    def check(self) -> None:
        """Raise :class:`~celery_fence.errors.LeaseLost` once the attempt's lease is lost."""
        ...


class Blocks:
    """The block verbs of one :class:`~celery_fence.store.Store` (``store.blocks``)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def begin(self, conn: sa.Connection, ttl: float) -> None:
        """Begin a fenced block's transaction on ``conn``: on SQLite ``BEGIN IMMEDIATE`` (the
        write lock from the first statement, so no registration commits while it is open); on
        PostgreSQL the block's bounds (:meth:`bounds`)."""
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql(session_sql.begin("sqlite", immediate=True))
        else:
            conn.exec_driver_sql(self.bounds(ttl))

    def bounds(self, ttl: float) -> str:
        """A PostgreSQL block's bounds for its transaction: idle in it at most one lease TTL
        (``ttl`` seconds), a lock wait and a statement at most ``fence_database_timeout`` (the
        lock wait :data:`LOCK_TIMEOUT_TTLS` TTLs at most)."""
        ttl_ms = math.ceil(ttl * 1000)
        timeout_ms = math.ceil(self.store.database_timeout * 1000)
        lock_ms = min(math.ceil(ttl_ms * LOCK_TIMEOUT_TTLS), timeout_ms)
        return session_sql.pg_block_bounds(ttl_ms, lock_ms, timeout_ms)

    def owner(self, conn: sa.Connection, owner: BlockOwner) -> bool:
        """Whether ``owner``'s block may commit, just before it does: its lease (``LeaseLost``
        when it was paused past it inside the block), then :meth:`commit_check` on its
        connection, in its transaction."""
        owner.check()
        return self.commit_check(
            conn,
            owner.key,
            generation=owner.generation,
            attempt_id=owner.attempt_id,
            in_block=conn.dialect.name == "postgresql",
        )

    def owner_cursor(self, cursor: Any, owner: BlockOwner) -> bool:
        """:meth:`owner` for a Django block: bounded, on its DB-API cursor."""
        owner.check()
        if self.store.dialect == "postgresql":
            cursor.execute(
                session_sql.pg_statement_timeout(math.ceil(self.store.database_timeout * 1000))
            )
        return self.commit_check_cursor(
            cursor, owner.key, generation=owner.generation, attempt_id=owner.attempt_id
        )

    def commit_check(
        self,
        conn: sa.Connection,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        in_block: bool = False,
    ) -> bool:
        """The ownership check of a fenced commit (:mod:`celery_fence.body.transaction`): run on
        ``conn`` inside its open transaction, just before that transaction commits.

        One fenced ``UPDATE ... RETURNING`` of the job row (it touches ``updated_at``); why it
        is enough: docs/design.md, "Why the check is enough (Read Committed)". True when this
        attempt still owns the key (``in_block``, PostgreSQL: and the transaction is still the
        one the block began, :data:`~celery_fence.store.session_sql.PG_BLOCK_MARKER`).
        """
        stmt = sql.commit_check(key, generation, attempt_id, now=utcnow(), in_block=in_block)
        return conn.execute(stmt).first() is not None

    def commit_check_cursor(
        self, cursor: Any, key: str, *, generation: int, attempt_id: str
    ) -> bool:
        """:meth:`commit_check` on a DB-API cursor that is not SQLAlchemy's (a Django cursor on
        the store's database, inside its open transaction): the same statement, ``%s`` style."""
        stmt = sql.commit_check(key, generation, attempt_id, now=utcnow())
        text, params = sql.format_style(stmt, self.store.dialect)
        cursor.execute(text, params)
        return cursor.fetchone() is not None

    def transaction_ended(self, conn: sa.Connection, *, ask: bool = True) -> bool:
        """Whether a fenced block's transaction ended under it (a raw COMMIT or ROLLBACK on its
        connection): SQLite, the driver is out of its transaction; PostgreSQL, libpq says the
        session is idle, or the transaction-local marker the block set at its BEGIN is gone
        (another transaction began since; read only when ``ask``: one round trip)."""
        dbapi: Any = conn.connection.dbapi_connection
        if conn.dialect.name == "sqlite":
            return not dbapi.in_transaction
        status = getattr(getattr(dbapi, "info", None), "transaction_status", None)
        if status is not None and int(status) == 0:  # IDLE (psycopg2 and psycopg alike)
            return True
        if not ask:
            return False
        cursor = dbapi.cursor()
        try:
            cursor.execute(session_sql.PG_BLOCK_MARKER_READ)
            row = cursor.fetchone()
        finally:
            cursor.close()
        return not row or row[0] != "on"


__all__ = ["LOCK_TIMEOUT_TTLS", "BlockOwner", "Blocks"]
