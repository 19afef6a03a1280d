"""The store's connection to its database: the SQLAlchemy engine (created lazily, re-created
after fork), the bounds on every wait (libpq timeouts, the watchdog, ``lock_timeout``), short
transactions, the raw DB-API path of the fenced writes with its server-side prepared statements
(on psycopg 3 or psycopg2, whichever the URL names). Driver errors, reduced to what may be
logged: :mod:`.driver_errors`."""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any

import sqlalchemy as sa

from celery_fence import schema
from celery_fence.errors import ConfigurationError
from celery_fence.process.runtime import runtime
from celery_fence.settings import DEFAULT_DATABASE_TIMEOUT
from celery_fence.store import green, session_sql
from celery_fence.store.driver_errors import statement_error
from celery_fence.store.watchdog import watchdog

#: SQLAlchemy's text form of a timestamp on SQLite (what its ``DateTime`` writes and compares).
SQLITE_TIMESTAMP = "%Y-%m-%d %H:%M:%S.%f"

#: The PostgreSQL drivers the store runs on (SQLAlchemy's names, as in ``postgresql+psycopg://``):
#: both take the ``%(name)s`` parameters of :mod:`.queries`' statements.
PG_DRIVERS = ("psycopg", "psycopg2")

#: The execution option every connection the store uses for its own statements carries
#: (:meth:`Database.connect`, :meth:`Database.tx`, :meth:`Database.rolled_back`; the raw paths
#: send no SQLAlchemy event at all): the fence's own writes, never the app's
#: (:mod:`celery_fence.body.sqla` looks at none of them). Another connection of the same engine
#: (``fence.store.engine.begin()`` in a body) is the app's, and watched.
OWN = "fence_own"


class Database:
    """One database URL's engine and execution paths. Safe to share between threads."""

    def __init__(
        self,
        url: str,
        *,
        lock_timeout: float = 5.0,
        engine_options: Mapping[str, Any] | None = None,
        database_timeout: float = DEFAULT_DATABASE_TIMEOUT,
    ) -> None:
        self.url = url
        self.database_timeout = database_timeout
        self.lock_timeout = lock_timeout
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
        self.driver = sa.engine.make_url(url).get_driver_name()
        if self.dialect == "postgresql" and self.driver not in PG_DRIVERS:
            raise ConfigurationError(
                f"fence_database_url uses the PostgreSQL driver {self.driver!r}; celery-fence's "
                "store runs on psycopg 3 or psycopg2: write the URL as 'postgresql+psycopg://...' "
                "or 'postgresql+psycopg2://...' (pip install 'psycopg[binary]' or psycopg2-binary)."
            )

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

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    def close_idle(self) -> None:
        """Close the pool's idle connections (a connection in use is closed when it is given
        back); the engine stays usable and connects again on its next statement."""
        with self._lock:
            if self._engine is not None and not self._process.forked:
                self._engine.dispose(close=True)

    def _create_engine(self) -> sa.Engine:
        # hide_parameters: a database error must never print a result or payload into a log.
        options: dict[str, Any] = {
            "isolation_level": "AUTOCOMMIT",
            "pool_pre_ping": False,
            "hide_parameters": True,
        }
        if self.dialect == "sqlite":
            busy_timeout = green.sqlite_busy_timeout(30.0)
            options["connect_args"] = {"timeout": busy_timeout, "check_same_thread": False}
        else:
            options.update(pool_size=5, max_overflow=10, pool_recycle=1800)
            options["connect_args"] = self._pg_connect_args()
            green.cooperative_waits(sa.engine.make_url(self.url).get_driver_name())
        options.update(self._engine_options)
        engine = sa.create_engine(self.url, **options)
        if self.dialect == "sqlite":

            @sa.event.listens_for(engine, "connect")
            def _sqlite_pragmas(dbapi_conn: Any, _: Any) -> None:
                cur = dbapi_conn.cursor()
                for pragma in session_sql.SQLITE_PRAGMAS:
                    cur.execute(pragma)
                cur.execute(f"PRAGMA busy_timeout={round(busy_timeout * 1000)}")
                cur.close()

            # The embedded default needs no set-up step: create the tables once per process.
            schema.create_schema(engine)
            return engine
        self._bound_calls(engine)
        lock_timeout = session_sql.pg_lock_timeout(max(1, round(self.lock_timeout * 1000)))

        @sa.event.listens_for(engine, "connect")
        def _pg_session(dbapi_conn: Any, _: Any) -> None:
            # A store statement never waits for a row lock for ever (e.g. a registration
            # behind a paused fence.transaction() holder): it fails, and the message is
            # re-sent with backoff (task.py's registration and completion error paths).
            autocommit = dbapi_conn.autocommit
            dbapi_conn.autocommit = True
            cur = dbapi_conn.cursor()
            cur.execute(lock_timeout)
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
        """Arm :mod:`celery_fence.store.watchdog` for every statement SQLAlchemy runs on ``engine``
        (the raw path arms it itself, in :meth:`pg_execute`). A connection with the execution
        option ``fence_unbounded`` is not watched (purge)."""
        timeout = self.database_timeout

        @sa.event.listens_for(engine, "before_cursor_execute")
        def _arm(conn: Any, cursor: Any, *_: Any) -> None:
            if not conn.get_execution_options().get("fence_unbounded"):
                conn.info["fence_watch"] = watchdog().arm(cursor.connection.fileno(), timeout)

        @sa.event.listens_for(engine, "after_cursor_execute")
        def _disarm(conn: Any, *_: Any) -> None:
            watchdog().disarm(conn.info.pop("fence_watch", None))

        @sa.event.listens_for(engine, "handle_error")
        def _disarm_on_error(context: Any) -> None:
            if context.connection is not None:
                watchdog().disarm(context.connection.info.pop("fence_watch", None))

    #: True on the view of :meth:`rolled_back`: the statements run inside its transaction.
    pinned = False

    def connect(self) -> AbstractContextManager[sa.Connection]:
        """A pooled connection for reads and Core statements (autocommit)."""
        return self.engine.connect().execution_options(**{OWN: True})

    @contextmanager
    def rolled_back(self) -> Iterator[Database]:
        """This database with every statement (raw path, Core, reads) on one connection, inside
        one transaction that is rolled back at the end, whatever happens: the store's self-test
        (``celery fence check``) writes through it and leaves nothing. The connection is closed
        afterwards, not pooled (its prepared statements go with it)."""
        with self.engine.connect().execution_options(**{OWN: True}) as conn:
            conn.exec_driver_sql(session_sql.begin(self.dialect))
            try:
                yield _Pinned(self, conn)
            finally:
                # A ROLLBACK that fails (a broken connection) must not hide the probe's own
                # error: closing the connection below ends its transaction all the same.
                with suppress(Exception):
                    conn.exec_driver_sql(session_sql.ROLLBACK)
                conn.invalidate()

    @contextmanager
    def tx(self, *, unbounded: bool = False) -> Iterator[sa.Connection]:
        """A short explicit transaction on the AUTOCOMMIT engine (BEGIN IMMEDIATE on SQLite).

        ``unbounded``: a long operator statement (purge) — no statement timeout, no watchdog.
        """
        with self.engine.connect().execution_options(**{OWN: True}) as conn:
            if unbounded:
                conn = conn.execution_options(fence_unbounded=True)
            conn.exec_driver_sql(session_sql.begin(self.dialect))
            if unbounded and self.dialect == "postgresql":
                conn.exec_driver_sql(session_sql.NO_STATEMENT_TIMEOUT)
            try:
                yield conn
            except BaseException:
                conn.exec_driver_sql(session_sql.ROLLBACK)
                raise
            conn.exec_driver_sql(session_sql.COMMIT)

    def stamp(self, value: Any) -> Any:
        """A timestamp parameter for the raw path, as a UTC instant (:func:`schema.as_utc`, as
        the columns' type writes it): as is on PostgreSQL, SQLAlchemy's text on SQLite (so rows
        written either way compare equal)."""
        if value is None:
            return None
        value = schema.as_utc(value)
        if self.dialect == "sqlite":
            return value.strftime(SQLITE_TIMESTAMP)
        return value

    @contextmanager
    def raw(self) -> Iterator[Any]:
        """A pooled DB-API cursor (SQLite's raw path), skipping SQLAlchemy's connection and
        result wrappers; driver errors come out as SQLAlchemy's (with parameters hidden), and a
        broken connection is invalidated."""
        engine = self.engine
        raw = engine.raw_connection()
        try:
            cursor = raw.cursor()
            try:
                yield cursor
            finally:
                cursor.close()
        except engine.dialect.loaded_dbapi.Error as exc:
            raise statement_error(engine, raw, exc) from None
        finally:
            raw.close()  # back to the pool

    def pg_execute(self, statement: str, params: dict[str, Any]) -> Any:
        """Run ``statement`` as a server-side prepared statement (:meth:`run_prepared`) on a
        pooled connection's own cursor, the watchdog armed; no context manager is built per
        call. Returns the first row or None."""
        engine = self.engine
        raw = engine.raw_connection()
        try:
            cursor = raw.info.get("fence_cursor")
            if cursor is None or cursor.closed or cursor.connection is not raw.dbapi_connection:
                cursor = raw.info["fence_cursor"] = raw.cursor()
            token = watchdog().arm(cursor.connection.fileno(), self.database_timeout)
            try:
                row = self.run_prepared(raw, cursor, statement, params)
            except BaseException:
                watchdog().disarm(token)
                raise
            if watchdog().disarm(token):  # cut at its deadline as it ended: answered, not reusable
                raw.info.pop("fence_cursor", None)
                raw.invalidate()
            return row
        except engine.dialect.loaded_dbapi.Error as exc:
            raw.info.pop("fence_cursor", None)
            raise statement_error(engine, raw, exc) from None
        finally:
            raw.close()  # back to the pool

    def run_prepared(self, raw: Any, cursor: Any, statement: str, params: dict[str, Any]) -> Any:
        """Run a PostgreSQL statement of :mod:`.queries` (``%(name)s`` parameters) on ``cursor`` of
        the pooled connection ``raw`` as a prepared statement, the way this URL's driver does it:
        :func:`execute_prepared` (psycopg2, whose parameters are sent inline) or
        :func:`execute_prepared_psycopg` (psycopg 3, whose parameters are sent apart, typed).
        Returns the first row or None."""
        if self.driver == "psycopg":
            return execute_prepared_psycopg(cursor, statement, params)
        return execute_prepared(raw, cursor, statement, params)


class _Pinned(Database):
    """:meth:`Database.rolled_back`'s view: the same settings and engine, every statement on
    ``conn`` in its open transaction (a write path's own ``BEGIN``/``COMMIT`` is skipped)."""

    pinned = True

    def __init__(self, db: Database, conn: sa.Connection) -> None:
        self.__dict__.update(db.__dict__)
        self._conn = conn
        self._cursor: Any = None

    def connect(self) -> AbstractContextManager[sa.Connection]:
        return nullcontext(self._conn)

    @contextmanager
    def tx(self, *, unbounded: bool = False) -> Iterator[sa.Connection]:
        yield self._conn

    def _dbapi(self) -> tuple[Any, Any]:
        raw = self._conn.connection
        if self._cursor is None:
            self._cursor = raw.cursor()
        return raw, self._cursor

    @contextmanager
    def raw(self) -> Iterator[Any]:
        raw, cursor = self._dbapi()
        try:
            yield cursor
        except self.engine.dialect.loaded_dbapi.Error as exc:
            raise statement_error(self.engine, raw, exc) from None

    def pg_execute(self, statement: str, params: dict[str, Any]) -> Any:
        raw, cursor = self._dbapi()
        token = watchdog().arm(cursor.connection.fileno(), self.database_timeout)
        try:
            return self.run_prepared(raw, cursor, statement, params)
        except self.engine.dialect.loaded_dbapi.Error as exc:
            raise statement_error(self.engine, raw, exc) from None
        finally:
            watchdog().disarm(token)


def _positional(statement: str) -> tuple[str, tuple[str, ...]]:
    """``%(name)s`` placeholders to ``$1, $2, ...`` (first appearance order) for ``PREPARE``."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return re.sub(r"%\((\w+)\)s", number, statement), tuple(names)


def execute_prepared(raw: Any, cursor: Any, statement: str, params: dict[str, Any]) -> Any:
    """Run ``statement`` on PostgreSQL as a server-side prepared statement: ``PREPARE`` once per
    connection, then ``EXECUTE`` — the server parses and plans it once, not on every task.
    Returns the first row or None. A connection that lost its prepared statements (a pooler
    that swapped the server connection, ``DISCARD ALL``) prepares again, once."""
    prepared: dict[str, tuple[str, tuple[str, ...]]] = raw.info.setdefault("fence_prepared", {})
    for attempt in (1, 2):
        entry = prepared.get(statement)
        if entry is None:
            text, names = _positional(statement)
            name = f"fence_hot_{len(prepared)}_{os.getpid()}"
            cursor.execute(f"PREPARE {name} AS {text}")
            entry = prepared[statement] = (name, names)
        name, names = entry
        try:
            cursor.execute(
                f"EXECUTE {name} ({', '.join(['%s'] * len(names))})", [params[n] for n in names]
            )
        except Exception as exc:
            if attempt == 1 and getattr(exc, "pgcode", None) == "26000":  # no such statement
                prepared.clear()
                continue
            raise
        return cursor.fetchone()
    raise AssertionError("unreachable")  # pragma: no cover


def execute_prepared_psycopg(cursor: Any, statement: str, params: dict[str, Any]) -> Any:
    """Run ``statement`` with psycopg 3's own prepared statements (the protocol's, cached per
    connection and per parameter types by the driver): parsed and planned once, then one round
    trip per call. psycopg 3 sends parameters apart from the text, so an SQL ``EXECUTE`` with
    parameters (the psycopg2 path) cannot be used: the server cannot type them there. A
    connection that lost its prepared statements behind psycopg's back (a pooler's
    ``DISCARD ALL``) forgets them all (``DEALLOCATE ALL``, which psycopg tracks) and prepares
    again, once. Returns the first row or None."""
    for attempt in (1, 2):
        try:
            cursor.execute(statement, params, prepare=True)
        except Exception as exc:
            if attempt == 1 and getattr(exc, "sqlstate", None) == "26000":  # no such statement
                cursor.execute("DEALLOCATE ALL")
                continue
            raise
        return cursor.fetchone()
    raise AssertionError("unreachable")  # pragma: no cover
