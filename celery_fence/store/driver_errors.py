"""Database errors reduced to what may be logged (a driver's class and first line: PostgreSQL's
further lines can quote the statement's values), their SQLSTATE, and what they mean for the
operator: a store database that does not exist, a schema that is missing or old."""

from __future__ import annotations

import math
import re
from typing import Any

import sqlalchemy as sa


class _RedactedDriverError(Exception):
    """A driver error reduced to its class and first line: never a value from the statement."""

    def __init__(self, orig: BaseException) -> None:
        first_line = (str(orig).splitlines() or [""])[0]
        super().__init__(f"{type(orig).__name__}: {first_line}")
        self.pgcode = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
        self.driver_error = type(orig)


def driver_error_line(exc: BaseException, limit: int = 200) -> str:
    """A database error as its driver's class and first line (``UndefinedTable: relation
    "fence_jobs" does not exist``), at most ``limit`` characters: what a log line or a reason may
    say of it (PostgreSQL's further lines can quote the statement's values)."""
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, _RedactedDriverError):
        text = str(orig)
    else:
        text = f"{type(orig).__name__}: {(str(orig).strip().splitlines() or [''])[0]}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def sqlstate(exc: BaseException) -> str | None:
    """PostgreSQL's SQLSTATE of a database error (either driver's), or None."""
    orig = getattr(exc, "orig", None) or exc
    return getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)


#: PostgreSQL's "database does not exist" (``invalid_catalog_name``).
_MISSING_DATABASE = re.compile(r'database "(?P<name>[^"]*)" does not exist')


def missing_database_name(exc: BaseException) -> str | None:
    """The database's name when ``exc`` says the server has no such database (PostgreSQL's
    ``3D000``, which psycopg2 reports at connect time without its code), else None."""
    match = _MISSING_DATABASE.search(str(getattr(exc, "orig", None) or exc))
    if match:
        return match.group("name")
    return "" if sqlstate(exc) == "3D000" else None


def missing_database_message(
    name: str, url: str | None = None, command: str = "celery -A <app>"
) -> str:
    """What to do about a store database that does not exist: create it, then the tables."""
    shown = ""
    if url is not None:
        try:
            shown = f" ({sa.engine.make_url(url).render_as_string(hide_password=True)})"
            name = name or sa.engine.make_url(url).database or ""
        except Exception:
            shown = ""
    name = name or "NAME"
    return (
        f'the store database "{name}" does not exist{shown}: create it first (createdb {name}, '
        f'or CREATE DATABASE "{name}"), then its tables: {command} fence init-db'
    )


def missing_database(
    url: str, timeout: float = 5.0, command: str = "celery -A <app>"
) -> str | None:
    """:func:`missing_database_message` when the PostgreSQL server at ``url`` says its database
    does not exist; None when it does, on SQLite (the file is created), and when the server
    cannot be asked (unreachable: the workers' claims re-send with backoff until it is back).
    One connection, opened and closed (nothing pooled: a prefork parent must not share one)."""
    try:
        parsed = sa.engine.make_url(url)
    except Exception:
        return None
    if parsed.get_backend_name() != "postgresql":
        return None
    connect_args = {"connect_timeout": max(1, math.ceil(timeout))}
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=connect_args)
    try:
        with engine.connect():
            return None
    except sa.exc.DBAPIError as exc:
        name = missing_database_name(exc)
        return None if name is None else missing_database_message(name, url, command)
    except Exception:
        return None
    finally:
        engine.dispose()


def refusal_reason(exc: BaseException, what: str) -> str:
    """Why the store refused ``what`` (e.g. ``registration``) with ``exc``: the driver's error
    (:func:`driver_error_line`) and, when it says the fence tables or their columns are
    missing, the fix. Any other refusal is not blamed on the schema."""
    reason = f"store refused {what} ({driver_error_line(exc)})"
    detail = str(getattr(exc, "orig", None) or exc)
    if sqlstate(exc) == "42P01" or "no such table" in detail:
        return f"{reason}; is the schema created? celery fence init-db"
    if sqlstate(exc) == "42703" or "no such column" in detail or "has no column" in detail:
        return f"{reason}; is the schema current? celery fence init-db"
    return reason


def statement_error(engine: sa.Engine, raw: Any, exc: Any) -> sa.exc.StatementError:
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
