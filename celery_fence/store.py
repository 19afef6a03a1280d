"""The fenced result store: the only module that runs SQL (its values live in records.py).

Every write on a fenced path is one conditional statement (or, on SQLite, one short
``BEGIN IMMEDIATE`` transaction) whose ``WHERE`` names the key, the generation and the attempt:
"no row returned" is turned into a domain error in one place, :meth:`Store._fenced`, and never
followed by an unconditional write. On PostgreSQL a transition record and staged outbox rows ride
in the same statement as data-modifying CTEs, so the hot path is one round trip per write on an
AUTOCOMMIT engine.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from . import schema, statements
from .config import DEFAULT_DATABASE_TIMEOUT, FenceConfig
from .errors import ConfigurationError, StaleGeneration, StoreError
from .outbox_store import OutboxRow, OutboxStore
from .records import (
    ENCODED_REQUEST,
    Effect,
    JobRecord,
    Registration,
    Transition,
    _record,
    decode_request,
    dumps_strict,
    encode_request,
)
from .runtime import runtime
from .schema import COMPLETED, DEAD, PENDING, RETRYING, RUNNING, jobs, outbox, transitions, utcnow
from .watchdog import watchdog

#: Statuses of a job that is not finished: each needs a live lease, a pending retry time or a
#: message on its way, or it is stranded (:meth:`Store.stranded`).
UNFINISHED = (RUNNING, RETRYING, PENDING)

logger = logging.getLogger(__name__)


class _RedactedDriverError(Exception):
    """A driver error reduced to its class and first line: never a value from the statement."""

    def __init__(self, orig: BaseException) -> None:
        first_line = (str(orig).splitlines() or [""])[0]
        super().__init__(f"{type(orig).__name__}: {first_line}")
        self.pgcode = getattr(orig, "pgcode", None)
        self.driver_error = type(orig)


class _Row(NamedTuple):
    """What a critical-path write returns."""

    key: str
    generation: int
    attempt_id: str
    attempts: int


class Store(OutboxStore):
    """The SQLAlchemy repository. Safe to share between threads; re-creates its pool after fork."""

    def __init__(
        self,
        url: str,
        *,
        record_transitions: bool = True,
        unfenced: bool = False,
        defer_first_registration: bool = False,
        error_message_length: int = 500,
        lock_timeout: float = 5.0,
        engine_options: Mapping[str, Any] | None = None,
        database_timeout: float = DEFAULT_DATABASE_TIMEOUT,
    ) -> None:
        self.url = url
        self.database_timeout = database_timeout
        self.lock_timeout = lock_timeout
        self.record_transitions = record_transitions
        self.unfenced = unfenced
        self.defer_first_registration = defer_first_registration
        self.error_message_length = error_message_length
        self._engine_options = dict(engine_options or {})
        self._lock = threading.Lock()
        self._engine: sa.Engine | None = None
        self._process = runtime()
        try:
            self.dialect = sa.engine.make_url(url).get_backend_name()
        except Exception as exc:
            raise ConfigurationError(
                f"fence_database_url={url!r} is not a valid URL: {exc}"
            ) from None
        if self.dialect not in ("postgresql", "sqlite"):
            raise ConfigurationError(
                f"fence_database_url uses {self.dialect!r}; celery-fence supports postgresql and "
                "sqlite."
            )

    # -- engine -------------------------------------------------------------------------------

    @property
    def engine(self) -> sa.Engine:
        if self._engine is not None and not self._process.forked:
            return self._engine
        with self._lock:
            if self._engine is not None and self._process.forked:
                self._engine.dispose(close=False)  # the parent's sockets are not ours
                self._engine = None
            if self._engine is None:
                self._engine = self._create_engine()
                self._process = runtime()
            return self._engine

    def _create_engine(self) -> sa.Engine:
        # hide_parameters: a database error must never print a result or payload into a log.
        options: dict[str, Any] = {
            "isolation_level": "AUTOCOMMIT",
            "pool_pre_ping": False,
            "hide_parameters": True,
        }
        if self.dialect == "sqlite":
            options["connect_args"] = {"timeout": 30, "check_same_thread": False}
        else:
            options.update(pool_size=5, max_overflow=10, pool_recycle=1800)
            options["connect_args"] = self._pg_connect_args()
        options.update(self._engine_options)
        engine = sa.create_engine(self.url, **options)
        if self.dialect == "postgresql":
            self._bound_calls(engine)
        if self.dialect == "sqlite":

            @sa.event.listens_for(engine, "connect")
            def _sqlite_pragmas(dbapi_conn: Any, _: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
                cur.execute("PRAGMA busy_timeout=30000")
                cur.close()

            # The embedded default needs no set-up step: create the tables once per process.
            schema.create_schema(engine)
        else:
            lock_timeout_ms = max(1, round(self.lock_timeout * 1000))

            @sa.event.listens_for(engine, "connect")
            def _pg_session(dbapi_conn: Any, _: Any) -> None:
                # A store statement never waits for a row lock for ever (e.g. a registration
                # behind a paused fence.transaction() holder): it fails, and the message is
                # re-sent with backoff (task.py's registration and completion error paths).
                autocommit = dbapi_conn.autocommit
                dbapi_conn.autocommit = True
                cur = dbapi_conn.cursor()
                cur.execute(f"SET lock_timeout = {lock_timeout_ms}")
                cur.close()
                dbapi_conn.autocommit = autocommit

        return engine

    def _pg_connect_args(self) -> dict[str, Any]:
        """libpq options that bound every wait on a PostgreSQL connection by
        ``fence_database_timeout`` (t): connecting (``connect_timeout``), unacknowledged data
        (``tcp_user_timeout``), a silent peer while waiting for an answer (keepalives: idle t/2,
        then 3 probes t/6 apart) and a slow statement (``statement_timeout``). Options given in
        the URL's query win; an ``options`` there is kept and extended."""
        t = self.database_timeout
        query = sa.engine.make_url(self.url).query
        args: dict[str, Any] = {
            "connect_timeout": max(2, math.ceil(t)),  # libpq: whole seconds, at least 2
            "keepalives": 1,
            "keepalives_idle": max(1, round(t / 2)),
            "keepalives_interval": max(1, round(t / 6)),
            "keepalives_count": 3,
            "tcp_user_timeout": max(1, round(t * 1000)),
        }
        args = {name: value for name, value in args.items() if name not in query}
        statement_timeout = f"-c statement_timeout={max(1, round(t * 1000))}"
        user_options = query.get("options")
        if isinstance(user_options, tuple):
            user_options = " ".join(user_options)
        if user_options is None:
            args["options"] = statement_timeout
        elif "statement_timeout" not in user_options:
            args["options"] = f"{user_options} {statement_timeout}"
        return args

    def _bound_calls(self, engine: sa.Engine) -> None:
        """Arm :mod:`celery_fence.watchdog` for every statement SQLAlchemy runs on ``engine``
        (the two hot-path statements arm it themselves, in :meth:`_pg_execute`). A connection
        with the execution option ``fence_unbounded`` is not watched (purge)."""
        timeout = self.database_timeout

        @sa.event.listens_for(engine, "before_cursor_execute")
        def _arm(conn: Any, cursor: Any, *_: Any) -> None:
            if not conn.get_execution_options().get("fence_unbounded"):
                conn.info["fence_watch"] = watchdog.arm(cursor.connection.fileno(), timeout)

        @sa.event.listens_for(engine, "after_cursor_execute")
        def _disarm(conn: Any, *_: Any) -> None:
            watchdog.disarm(conn.info.pop("fence_watch", None))

        @sa.event.listens_for(engine, "handle_error")
        def _disarm_on_error(context: Any) -> None:
            if context.connection is not None:
                watchdog.disarm(context.connection.info.pop("fence_watch", None))

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def create_schema(self) -> None:
        schema.create_schema(self.engine)

    @contextmanager
    def _tx(self, *, unbounded: bool = False) -> Iterator[sa.Connection]:
        """A short explicit transaction on the AUTOCOMMIT engine (BEGIN IMMEDIATE on SQLite).

        ``unbounded``: a long operator statement (purge) — no statement timeout, no watchdog.
        """
        with self.engine.connect() as conn:
            if unbounded:
                conn = conn.execution_options(fence_unbounded=True)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if self.dialect == "sqlite" else "BEGIN")
            if unbounded and self.dialect == "postgresql":
                conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise
            conn.exec_driver_sql("COMMIT")

    # -- the fenced write helper ---------------------------------------------------------------

    def _transition_row(self, action: str, reason: str | None, at: dt.datetime) -> dict[str, Any]:
        return {"action": action, "reason": (reason or "")[:255] or None, "at": at}

    def _fenced(
        self,
        stmt: Any,
        *,
        action: str,
        reason: str | None,
        at: dt.datetime,
        effects: Sequence[Effect] = (),
    ) -> Any:
        """Run a conditional write that RETURNS (key, generation, attempt_id, attempts).

        With it, in the same statement or transaction: the transition record and staged outbox rows.
        Returns the returned row, or None when the condition did not match (the caller decides
        what that means; it never falls back to an unconditional write).
        """
        stmt = stmt.returning(jobs.c.key, jobs.c.generation, jobs.c.attempt_id, jobs.c.attempts)
        record = self.record_transitions
        if self.dialect == "postgresql" and (record or effects):
            upd = stmt.cte("fenced")
            query = sa.select(upd.c.key, upd.c.generation, upd.c.attempt_id, upd.c.attempts)
            if record:
                t = self._transition_row(action, reason, at)
                ins = transitions.insert().from_select(
                    ["key", "generation", "attempt_id", "action", "reason", "at"],
                    sa.select(
                        upd.c.key,
                        upd.c.generation,
                        upd.c.attempt_id,
                        sa.literal(t["action"], sa.String),
                        sa.literal(t["reason"], sa.String),
                        sa.literal(t["at"], schema.Timestamp),
                    ),
                )
                query = query.add_cte(ins.cte("transition"))
            for i, effect in enumerate(effects):
                ins = outbox.insert().from_select(
                    [
                        "key",
                        "name",
                        "idempotency_key",
                        "payload",
                        "status",
                        "attempts",
                        "available_at",
                        "created_at",
                    ],
                    sa.select(
                        upd.c.key,
                        sa.literal(effect.name, sa.String),
                        sa.literal(effect.idempotency_key, sa.String),
                        sa.literal(effect.payload, postgresql.JSONB(none_as_null=True)),
                        sa.literal("pending", sa.String),
                        sa.literal(0, sa.Integer),
                        sa.literal(at, schema.Timestamp),
                        sa.literal(at, schema.Timestamp),
                    ),
                )
                query = query.add_cte(ins.cte(f"effect_{i}"))
            with self.engine.connect() as conn:
                return conn.execute(query).first()
        if not record and not effects:
            with self.engine.connect() as conn:
                return conn.execute(stmt).first()
        with self._tx() as conn:
            row = conn.execute(stmt).first()
            if row is None:
                return None
            if record:
                conn.execute(
                    transitions.insert().values(
                        key=row.key,
                        generation=row.generation,
                        attempt_id=row.attempt_id,
                        **self._transition_row(action, reason, at),
                    )
                )
            if effects:
                conn.execute(
                    outbox.insert(),
                    [
                        {
                            "key": row.key,
                            "name": e.name,
                            "idempotency_key": e.idempotency_key,
                            "payload": e.payload,
                            "status": "pending",
                            "attempts": 0,
                            "available_at": at,
                            "created_at": at,
                        }
                        for e in effects
                    ],
                )
            return row

    @contextmanager
    def _raw(self) -> Iterator[tuple[Any, Any]]:
        """A pooled DB-API connection and cursor for the critical path, skipping SQLAlchemy's
        connection and result wrappers; driver errors come out as SQLAlchemy's (with parameters
        hidden), and a broken connection is invalidated."""
        engine = self.engine
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            try:
                yield raw, cursor
            finally:
                cursor.close()
        except engine.dialect.loaded_dbapi.Error as exc:
            raise _driver_error(engine, raw, exc) from None
        finally:
            raw.close()  # back to the pool

    def _pg_execute(self, sql: str, params: dict[str, Any]) -> Any:
        """:meth:`_raw` + :func:`statements.execute_prepared`, inlined for the two statements
        every task runs: the connection keeps one cursor for them, and no context manager is
        built per call."""
        engine = self.engine
        raw = engine.raw_connection()
        try:
            cursor = raw.info.get("fence_cursor")
            if cursor is None or cursor.closed or cursor.connection is not raw.dbapi_connection:
                cursor = raw.info["fence_cursor"] = raw.cursor()
            token = watchdog.arm(cursor.connection.fileno(), self.database_timeout)
            try:
                return statements.execute_prepared(raw, cursor, sql, params)
            finally:
                watchdog.disarm(token)
        except engine.dialect.loaded_dbapi.Error as exc:
            raw.info.pop("fence_cursor", None)
            raise _driver_error(engine, raw, exc) from None
        finally:
            raw.close()  # back to the pool

    def _hot_write(
        self,
        sql: str,
        params: dict[str, Any],
        *,
        action: str | tuple[str, ...],
        effects: Sequence[Effect] = (),
    ) -> _Row | None:
        """Run a critical-path write from :mod:`statements` with its transition rows and staged
        effects: one prepared statement on PostgreSQL, one short transaction on SQLite. Returns
        the changed row, or None when the fence did not match."""
        now = utcnow()
        record = self.record_transitions
        if self.dialect == "postgresql":
            params["now"] = now
            if record or effects:
                sql = statements.pg_with_records(
                    sql, action=action, transitions=record, effects=bool(effects)
                )
            if effects:
                params["effects"] = json.dumps(
                    [
                        {"name": e.name, "idempotency_key": e.idempotency_key, "payload": e.payload}
                        for e in effects
                    ],
                    separators=(",", ":"),
                )
            row = self._pg_execute(sql, params)
            return None if row is None else _Row(*row)
        params["now"] = stamp = now.strftime("%Y-%m-%d %H:%M:%S.%f")  # SQLAlchemy's format
        with self._raw() as (_, cursor):
            if not record and not effects:
                cursor.execute(sql, params)
                row = cursor.fetchone()
                return None if row is None else _Row(*row)
            cursor.execute("BEGIN IMMEDIATE")
            try:
                cursor.execute(sql, params)
                row = cursor.fetchone()
                for name in (action,) if isinstance(action, str) else action:
                    if row is None or not record:
                        break
                    cursor.execute(
                        statements.sqlite_transition_sql(name),
                        {"key": row[0], "generation": row[1], "attempt_id": row[2], "now": stamp},
                    )
                for e in effects if row is not None else ():
                    cursor.execute(
                        statements.SQLITE_OUTBOX_SQL,
                        {
                            "key": row[0],
                            "name": e.name,
                            "idempotency_key": e.idempotency_key,
                            "payload": json.dumps(e.payload, separators=(",", ":")),
                            "now": stamp,
                        },
                    )
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            cursor.execute("COMMIT")
            return None if row is None else _Row(*row)

    def _insert(self) -> Any:
        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(jobs)

    # -- the fenced path ------------------------------------------------------------------------

    def register(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        task_name: str,
        request: Mapping[str, Any] | None = None,
        request_json: str | None = None,
    ) -> Registration:
        """Register generation ``generation`` as the owner of ``key`` before the body runs.

        One statement: the row takes (generation, attempt, running) and counts one attempt only
        if ``generation`` is strictly greater than the stored one and the job is neither completed
        nor dead. Otherwise nothing changes and the stored state says why.
        """
        params = {
            "key": key,
            "task_name": task_name,
            "generation": generation,
            "attempt_id": attempt_id,
            "request": request_json
            if request is None
            else json.dumps(request, separators=(",", ":")),
        }
        sql = statements.register_sql(
            self.dialect,
            fenced=not self.unfenced,
            deferred_first=self.defer_first_registration,
        )
        row = self._hot_write(sql, params, action="claimed")
        if row is not None:
            return Registration("registered", row.attempts, row.generation)
        record = self.get(key)
        if record is None:  # deleted between the two statements (purge): let the caller retry
            raise StoreError(f"job {key!r} vanished during registration; retry")
        if record.status == COMPLETED:
            return Registration("completed", record.attempts, record.generation, record)
        if record.status == DEAD:
            return Registration("dead", record.attempts, record.generation, record)
        return Registration("stale", record.attempts, record.generation, record)

    def commit_check(
        self, conn: sa.Connection, key: str, *, generation: int, attempt_id: str
    ) -> bool:
        """The ownership check of a fenced commit (:mod:`celery_fence.transaction`): run on
        ``conn`` inside its open transaction, just before that transaction commits.

        One fenced ``UPDATE ... RETURNING`` of the job row (it touches ``updated_at``). On
        PostgreSQL under Read Committed it either finds a newer registration already committed
        (no row), waits for one in flight and re-checks it (no row), or locks the row, so that no
        registration commits before this transaction does. True when this attempt still owns the
        key.
        """
        stmt = (
            jobs.update()
            .where(self._owned(key, generation, attempt_id))
            .values(updated_at=utcnow())
            .returning(jobs.c.generation)
        )
        return conn.execute(stmt).first() is not None

    def _owned(self, key: str, generation: int, attempt_id: str) -> Any:
        where = jobs.c.key == key
        if not self.unfenced:
            where = (
                where
                & (jobs.c.generation == generation)
                & (jobs.c.attempt_id == attempt_id)
                & (jobs.c.status == RUNNING)
            )
        return where

    def _rejected(self, key: str, generation: int, attempt_id: str, what: str) -> StaleGeneration:
        record = self.get(key)
        if record is None:
            detail = "no job row"
        else:
            detail = (
                f"stored generation {record.generation} (attempt {record.attempt_id}), "
                f"status {record.status}"
            )
        return StaleGeneration(
            f"{what} for {key!r} from generation {generation} (attempt {attempt_id}) rejected: "
            f"{detail}",
            key=key,
            generation=generation,
            attempt_id=attempt_id,
            stored_generation=None if record is None else record.generation,
            stored_status=None if record is None else record.status,
        )

    def complete(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        result: Any,
        effects: Sequence[Effect] = (),
    ) -> None:
        """Store the result and ``completed`` where this attempt still owns the row.

        Staged effects are written in the same statement/transaction. Raises
        :class:`StaleGeneration` when the row is not this attempt's (nothing is stored).
        """
        params = {
            "key": key,
            "generation": generation,
            "attempt_id": attempt_id,
            "result": dumps_strict(result, "task's return value"),
        }
        sql = statements.complete_sql(self.dialect, fenced=not self.unfenced)
        if self._hot_write(sql, params, action="completed", effects=effects) is None:
            raise self._rejected(key, generation, attempt_id, "completion")

    def complete_first(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        task_name: str,
        request_json: str | None,
        result: Any,
        effects: Sequence[Effect] = (),
    ) -> None:
        """The completion of a first claim whose registration was deferred: one statement
        inserts the row as completed with its ``claimed`` and ``completed`` transitions and staged
        effects, only where no row exists. Raises :class:`StaleGeneration` otherwise (a newer
        generation registered meanwhile, or Redis handed out generation 1 again)."""
        params = {
            "key": key,
            "task_name": task_name,
            "generation": generation,
            "attempt_id": attempt_id,
            "request": request_json,
            "result": dumps_strict(result, "task's return value"),
        }
        sql = statements.complete_first_sql(self.dialect)
        actions = ("claimed", "completed")
        if self._hot_write(sql, params, action=actions, effects=effects) is None:
            raise self._rejected(key, generation, attempt_id, "first completion")

    def _error_fields(self, error: BaseException | None) -> dict[str, Any]:
        if error is None:
            return {}
        message = str(error)
        if len(message) > self.error_message_length:
            message = message[: self.error_message_length - 1] + "…"
        return {
            "error_type": f"{type(error).__module__}.{type(error).__qualname__}",
            "error_message": message,
        }

    def schedule_retry(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        error: BaseException | None,
        retry_at: dt.datetime,
        reason: str,
    ) -> None:
        """Record that this attempt failed and a retry is scheduled (fenced)."""
        now = utcnow()
        stmt = (
            jobs.update()
            .where(self._owned(key, generation, attempt_id))
            .values(status=RETRYING, updated_at=now, retry_at=retry_at, **self._error_fields(error))
        )
        if self._fenced(stmt, action="retry_scheduled", reason=reason, at=now) is None:
            raise self._rejected(key, generation, attempt_id, "retry")

    def mark_dead(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        error: BaseException | None,
        reason: str,
        attempts: int | None = None,
    ) -> None:
        """Move the job to the terminal ``dead`` state (fenced on this attempt).

        ``attempts``, when given, is the number of executions to keep (a delivery that only found
        the budget spent was counted by its registration but ran nothing).
        """
        now = utcnow()
        counted = {} if attempts is None else {"attempts": attempts}
        stmt = (
            jobs.update()
            .where(self._owned(key, generation, attempt_id))
            .values(
                status=DEAD,
                updated_at=now,
                finished_at=now,
                retry_at=None,
                **counted,
                **self._error_fields(error),
            )
        )
        if self._fenced(stmt, action="dead", reason=reason, at=now) is None:
            raise self._rejected(key, generation, attempt_id, "dead-letter")

    def bury(
        self,
        key: str,
        *,
        task_name: str,
        request: Mapping[str, Any] | None,
        error: BaseException,
        reason: str,
    ) -> bool:
        """Keep a message that cannot even be registered (e.g. its ``fence_key`` failed) as a
        ``dead`` job, so nothing is lost: an operator sees it and can requeue it after the fix.

        Inserts; an existing row is touched only when it is ``pending`` (an operator re-sent
        this message and its key failed again: back to ``dead``, instead of ``pending`` with no
        message). Returns True when the row was written.
        """
        now = utcnow()
        errors = self._error_fields(error)
        stmt = self._insert().values(
            key=key,
            task_name=task_name,
            status=DEAD,
            generation=0,
            attempt_id="-",
            attempts=0,
            request=request,
            created_at=now,
            updated_at=now,
            finished_at=now,
            **errors,
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=[jobs.c.key],
            set_={"status": DEAD, "updated_at": now, "finished_at": now, **errors},
            where=jobs.c.status == PENDING,
        )
        return self._fenced(stmt, action="dead", reason=reason, at=now) is not None

    def bury_refused(
        self,
        key: str,
        *,
        generation: int,
        attempt_id: str,
        task_name: str,
        request_json: str | None,
        error: BaseException,
        reason: str,
    ) -> None:
        """A registration the database refused (its request holds a value the column cannot
        store): the job goes ``dead`` at once, fenced like a registration (only over a row with
        an older generation that is neither completed nor dead), with the request kept as JSON
        text inside a JSON string (``{"encoded": "..."}``), which every database accepts, so
        ``fence show`` and ``fence requeue`` still work."""
        now = utcnow()
        request = None if request_json is None else {ENCODED_REQUEST: request_json}
        values = {
            "key": key,
            "task_name": task_name,
            "status": DEAD,
            "generation": generation,
            "attempt_id": attempt_id,
            "attempts": 1,
            "request": request,
            "created_at": now,
            "updated_at": now,
            "finished_at": now,
            **self._error_fields(error),
        }
        insert = self._insert().values(**values)
        stmt = insert.on_conflict_do_update(
            index_elements=[jobs.c.key],
            set_={
                name: insert.excluded[name]
                for name in values
                if name not in ("key", "created_at", "attempts")
            }
            | {"attempts": jobs.c.attempts + 1},
            where=(jobs.c.status.not_in((COMPLETED, DEAD)))
            & (jobs.c.generation < insert.excluded.generation),
        )
        if self._fenced(stmt, action="dead", reason=reason, at=now) is None:
            raise self._rejected(key, generation, attempt_id, "dead-letter")

    def end_unrun(
        self,
        key: str,
        *,
        task_name: str,
        request: Mapping[str, Any] | None,
        reason: str,
        only_insert: bool = False,
    ) -> None:
        """Settle the job of a message Celery acks without running it (expired, revoked).

        No row yet: the job is recorded ``dead`` with its request. A row that waits for this
        message (``retrying`` or ``pending``) goes ``dead`` by compare-and-set on the state just
        read, unless ``only_insert`` (other messages may share the key). Any other row keeps its
        state; the transition is recorded.
        """
        from .errors import JobDead

        error = JobDead(f"the message was {reason} before it ran; requeue the job to run it")
        if self.bury(key, task_name=task_name, request=request, error=error, reason=reason):
            return
        before = None if only_insert else self.get(key)
        if before is not None and before.status in (RETRYING, PENDING):
            now = utcnow()
            stmt = (
                jobs.update()
                .where(
                    (jobs.c.key == key)
                    & (jobs.c.status == before.status)
                    & (jobs.c.generation == before.generation)
                    & (jobs.c.attempt_id == before.attempt_id)
                )
                .values(
                    status=DEAD,
                    updated_at=now,
                    finished_at=now,
                    retry_at=None,
                    **self._error_fields(error),
                )
            )
            if self._fenced(stmt, action="dead", reason=reason, at=now) is not None:
                return
        self.record(key, action=reason, reason="message not run")

    def last_exit(self, key: str) -> str | None:
        """How the key's latest attempt before this one ended, as far as the history says: the
        action of its newest transition row that is not a claim or a lease loss (None without
        one)."""
        with self.engine.connect() as conn:
            return conn.execute(
                sa.select(transitions.c.action)
                .where(
                    (transitions.c.key == key)
                    & transitions.c.action.not_in(("claimed", "lost"))  # a loss is a symptom
                )
                .order_by(transitions.c.id.desc())
                .limit(1)
            ).scalar()

    def record(
        self,
        key: str,
        *,
        action: str,
        generation: int | None = None,
        attempt_id: str | None = None,
        reason: str | None = None,
    ) -> None:
        """Record a transition that is not itself a SQL state change (lease lost, stale, busy)."""
        if not self.record_transitions:
            return
        with self.engine.connect() as conn:
            conn.execute(
                transitions.insert().values(
                    key=key,
                    generation=generation,
                    attempt_id=attempt_id,
                    **self._transition_row(action, reason, utcnow()),
                )
            )

    # -- operator verbs ---------------------------------------------------------------------------

    def get(self, key: str) -> JobRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs).where(jobs.c.key == key)).first()
        return None if row is None else _record(row)

    def history(self, key: str) -> list[Transition]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(transitions).where(transitions.c.key == key).order_by(transitions.c.id)
            ).all()
        return [
            Transition(r.key, r.generation, r.attempt_id, r.action, r.reason, r.at) for r in rows
        ]

    def list(
        self, *, status: str | None = None, task_name: str | None = None, limit: int = 50
    ) -> list[JobRecord]:
        query = sa.select(jobs).order_by(jobs.c.updated_at.desc()).limit(limit)
        if status is not None:
            query = query.where(jobs.c.status == status)
        if task_name is not None:
            query = query.where(jobs.c.task_name == task_name)
        with self.engine.connect() as conn:
            return [_record(r) for r in conn.execute(query).all()]

    def requeue(self, key: str) -> JobRecord:
        """Move a dead job to ``pending`` with a fresh attempt budget; refuse any other status.

        Returns the job as it was (``dead``; its stored request is what to re-send). The write is
        conditional on the row still being that dead record (generation and attempt), so two
        operators cannot both requeue it and a requeue never touches a job someone else changed.
        """
        before = self.get(key)
        if before is None:
            raise StoreError(f"no job with key {key!r}")
        if before.status != DEAD:
            raise StoreError(
                f"job {key!r} is {before.status}, not dead: only dead jobs are requeued"
            )
        now = utcnow()
        stmt = (
            jobs.update()
            .where(
                (jobs.c.key == key)
                & (jobs.c.status == DEAD)
                & (jobs.c.generation == before.generation)
                & (jobs.c.attempt_id == before.attempt_id)
            )
            .values(status=PENDING, attempts=0, updated_at=now, finished_at=None, retry_at=None)
        )
        if self._fenced(stmt, action="requeued", reason="by operator", at=now) is None:
            raise self._rejected(key, before.generation, before.attempt_id, "requeue")
        return before

    def restore_dead(self, before: JobRecord, *, reason: str) -> None:
        """Undo :meth:`requeue` when the message could not be sent: back to ``dead`` as it was.

        Fenced on the requeued row (``pending``, same generation and attempt): if an attempt
        claimed the job meanwhile, nothing changes and :class:`StaleGeneration` says so.
        """
        now = utcnow()
        stmt = (
            jobs.update()
            .where(
                (jobs.c.key == before.key)
                & (jobs.c.status == PENDING)
                & (jobs.c.generation == before.generation)
                & (jobs.c.attempt_id == before.attempt_id)
            )
            .values(
                status=DEAD,
                attempts=before.attempts,
                finished_at=before.finished_at,
                updated_at=now,
            )
        )
        if self._fenced(stmt, action="requeue_reverted", reason=reason, at=now) is None:
            raise self._rejected(before.key, before.generation, before.attempt_id, "restore")

    # -- recovery: stranded jobs ------------------------------------------------------------------

    def stranded(
        self,
        *,
        older_than: float,
        limit: int = 1000,
        task_name: str | None = None,
        now: dt.datetime | None = None,
    ) -> Sequence[JobRecord]:
        """Unfinished jobs (``running``, ``retrying``, ``pending``) that have not moved for
        ``older_than`` seconds, oldest first: ``updated_at`` before the cutoff and, for a
        ``retrying`` job, its ``retry_at`` too. Whether a live lease still holds one is for the
        caller to ask Redis (:func:`celery_fence.recovery.stranded_jobs`)."""
        cutoff = (now or utcnow()) - dt.timedelta(seconds=older_than)
        still = jobs.c.status.in_(UNFINISHED) & (jobs.c.updated_at < cutoff)
        retry_due = jobs.c.retry_at.is_(None) | (jobs.c.retry_at < cutoff)
        query = (
            sa.select(jobs)
            .where(still & ((jobs.c.status != RETRYING) | retry_due))
            .order_by(jobs.c.updated_at)
            .limit(limit)
        )
        if task_name is not None:
            query = query.where(jobs.c.task_name == task_name)
        with self.engine.connect() as conn:
            return [_record(r) for r in conn.execute(query).all()]

    def take_for_resend(self, before: JobRecord, *, reason: str) -> JobRecord | None:
        """Move an unfinished job that is about to be re-sent to ``pending`` — only if it is
        still exactly ``before`` (status, generation, attempt and ``updated_at``): of two
        recoveries racing for it, one gets the row and the other None, so one of them sends.

        The attempt count is kept (a job that keeps stranding still ends ``dead``); the owner
        attempt, if it is alive after all, can no longer write: its fenced writes need
        ``running``. If the send that follows never happens, the row is ``pending`` with a
        fresh ``updated_at``, and the next recovery past the threshold takes it again.
        """
        if before.status not in UNFINISHED:
            raise StoreError(f"job {before.key!r} is {before.status}: only unfinished jobs")
        now = utcnow()
        stmt = (
            jobs.update()
            .where(
                (jobs.c.key == before.key)
                & (jobs.c.status == before.status)
                & (jobs.c.generation == before.generation)
                & (jobs.c.attempt_id == before.attempt_id)
                & (jobs.c.updated_at == before.updated_at)
            )
            .values(status=PENDING, updated_at=now, retry_at=None)
        )
        if self._fenced(stmt, action="recovered", reason=reason, at=now) is None:
            return None
        return dataclasses.replace(before, status=PENDING, updated_at=now, retry_at=None)

    def bury_stranded(self, before: JobRecord, *, error: BaseException, reason: str) -> bool:
        """Move an unfinished job that cannot be re-sent (no stored request) to ``dead``, with
        the same compare-and-set as :meth:`take_for_resend`; False when it moved meanwhile."""
        now = utcnow()
        stmt = (
            jobs.update()
            .where(
                (jobs.c.key == before.key)
                & (jobs.c.status == before.status)
                & (jobs.c.generation == before.generation)
                & (jobs.c.attempt_id == before.attempt_id)
                & (jobs.c.updated_at == before.updated_at)
            )
            .values(
                status=DEAD,
                updated_at=now,
                finished_at=now,
                retry_at=None,
                **self._error_fields(error),
            )
        )
        return self._fenced(stmt, action="dead", reason=reason, at=now) is not None

    def purge(
        self, *, finished_before: dt.datetime, statuses: Sequence[str] = (COMPLETED, DEAD)
    ) -> int:
        """Delete finished jobs of ``statuses`` (and their history) finished before the date.

        Outbox rows are left to the outbox's own lifecycle. Returns the number of jobs deleted.
        """
        unfinished = set(statuses) - {COMPLETED, DEAD}
        if unfinished:
            raise StoreError(f"only finished jobs are purged, not {sorted(unfinished)}")
        done = (jobs.c.status.in_(tuple(statuses))) & (jobs.c.finished_at < finished_before)
        with self._tx(unbounded=True) as conn:
            keys = sa.select(jobs.c.key).where(done)
            conn.execute(transitions.delete().where(transitions.c.key.in_(keys)))
            return int(conn.execute(jobs.delete().where(done)).rowcount or 0)


def _driver_error(engine: sa.Engine, raw: Any, exc: Any) -> sa.exc.StatementError:
    """A driver error as SQLAlchemy's, parameters hidden and the driver's text cut to its first
    line; the connection is invalidated when the error says it is broken."""
    if engine.dialect.is_disconnect(exc, raw.dbapi_connection, None):
        raw.invalidate(exc)
    wrapped = sa.exc.DBAPIError.instance(
        None,
        None,
        exc,
        engine.dialect.loaded_dbapi.Error,
        hide_parameters=True,
        dialect=engine.dialect,
    )
    # PostgreSQL echoes the failing statement (``LINE 1: EXECUTE ...('<the result>'``) and
    # quotes values in its CONTEXT lines, and psycopg2 sends parameters inline: keep only the
    # first line, and do not chain the driver's exception into tracebacks.
    wrapped.orig = _RedactedDriverError(exc)
    return wrapped


def store_for(config: Any) -> Store:
    """This process's store for a :class:`~celery_fence.config.FenceConfig`."""
    return runtime().store(config)


def get_store(app: Any) -> Store:
    """The store an app's fenced tasks write to: ``get_store(app).get(key)``."""
    return store_for(FenceConfig.from_app(app))


__all__ = [
    "COMPLETED",
    "DEAD",
    "PENDING",
    "RETRYING",
    "RUNNING",
    "Effect",
    "JobRecord",
    "OutboxRow",
    "Registration",
    "Store",
    "Transition",
    "decode_request",
    "dumps_strict",
    "encode_request",
    "get_store",
    "store_for",
]
