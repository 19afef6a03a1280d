"""Every Django ORM write of a fenced body, seen by what the database says (not by its text).

Django's ORM writes on its own connection per alias and per thread. A fenced block's commit covers
one connection: ``fence.atomic(using=alias)`` this thread's ``connections[alias]``,
``fence.transaction()``/``session()`` a SQLAlchemy connection and no Django one. Any other Django
connection that commits a write while a fenced body runs would land a stale worker's write
unchecked. So, once per process (:func:`install`, from the attempt's execution before its body
runs), three of Django's methods are wrapped for every connection of every backend:

- ``BaseDatabaseWrapper._commit``: just before a Django transaction commits (the end of an
  outermost ``transaction.atomic()``, a ``connection.commit()``), did it write? PostgreSQL:
  :func:`~celery_fence.store.session_sql.pg_transaction_wrote` on that connection, in that
  transaction (a transaction id is assigned and a lock stronger than ``RowShareLock`` is held:
  whatever the statement's text — a leading comment, ``WITH ... UPDATE``, ``SELECT
  writing_fn()``, ``CALL``, ``cursor.callproc``; a ``SELECT ... FOR UPDATE [SKIP LOCKED]`` only
  locks, and is a read).
  SQLite: the connection's ``total_changes`` moved since its ``BEGIN``.
- ``CursorWrapper._execute_with_wrappers`` (``execute``/``executemany``, raw or ORM) and
  ``CursorWrapper.callproc``: a statement Django runs in autocommit (no transaction, so no commit
  to stop) runs inside a transaction of the fence's own on that connection — ``BEGIN``, the
  statement, the same check, then ``COMMIT``, or ``ROLLBACK`` and the error. Reads are two more
  round trips, and only while a fenced body runs; with ``fence_unfenced_writes = "allow"`` and no
  block open, nothing is wrapped. A statement that cannot run in a transaction (``VACUUM``,
  ``CREATE INDEX CONCURRENTLY``) fails with the database's own error while a fenced body runs.

A transaction that wrote, for the attempt :func:`~celery_fence.body.watch.attribution` names:

- while a fenced block of the attempt is open (on any thread) and this connection is not the one
  it covers: rolled back and refused with
  :func:`~celery_fence.body.watch.beside_block_error` (a :class:`~celery_fence.ConfigurationError`:
  the job ends ``dead`` with that reason);
- outside every block: :func:`~celery_fence.body.watch.unfenced_write` applies
  ``fence_unfenced_writes`` (``"warn"``: one WARNING per task and process, a transition and the
  ``unfenced_write`` signal, and the write commits; ``"error"``: rolled back and refused;
  ``"allow"``).

Never refused nor flagged: the commit of the covered connection (the fenced one), a transaction
in which a ``fence.atomic()`` block's ownership check passed (a fenced block nested in your own
``transaction.atomic()``: the check holds the job row until that transaction commits), writes
inside :func:`~celery_fence.body.watch.bookkeeping` (django-celery-results' result rows written
by Celery, the fence's own), and everything while no fenced body runs (one attribute test).

Not seen: Django backends other than PostgreSQL and SQLite (the store's databases) outside a
block — beside an open block their commits are refused, as the fence cannot tell whether they
wrote; a transaction begun on the driver's connection by hand (``connection.connection``), which
Django does not know of.
"""

from __future__ import annotations

import collections
import contextlib
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteWrapper
from django.db.backends.utils import CursorWrapper
from django.db.utils import OperationalError

from celery_fence.body import watch
from celery_fence.body.watch import AMBIGUOUS, WATCH
from celery_fence.store import session_sql

if TYPE_CHECKING:
    from celery_fence.body.fence import Fence

T = TypeVar("T")

#: Attributes the fence keeps on a Django connection (its ``__dict__``) while a fenced body runs.
_CHANGES = "_celery_fence_changes"  # SQLite: total_changes at the transaction's BEGIN
_TABLE = "_celery_fence_table"  # the last table a writing statement named (for the warning)
#: A ``fence.atomic()`` block's ownership check passed in this connection's open transaction.
CHECKED = "_celery_fence_checked"

_WRITTEN_TABLE = re.compile(
    r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM|MERGE\s+INTO)\s+(?:ONLY\s+)?"
    r"(?:\"?[\w$]+\"?\.)?\"?([\w$]+)\"?",
    re.IGNORECASE,
)

_lock = threading.Lock()
_installed = False
_own = threading.local()  # .busy: the fence's own BEGIN/COMMIT/ROLLBACK on a connection


def install() -> None:
    """Wrap Django's commit, rollback and statement execution, once per process (see the module
    docstring). They do nothing more than one attribute test while no fenced body runs."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        commit, rollback = BaseDatabaseWrapper._commit, BaseDatabaseWrapper._rollback
        execute, callproc = CursorWrapper._execute_with_wrappers, CursorWrapper.callproc
        begin = SQLiteWrapper._start_transaction_under_autocommit

        def _commit(self: Any) -> Any:
            if not WATCH.idle and not getattr(_own, "busy", False):
                _before_commit(self)
            _forget(self)
            return commit(self)

        def _rollback(self: Any) -> Any:
            _forget(self)
            return rollback(self)

        def _execute_with_wrappers(
            self: Any, sql_: Any, params: Any, many: bool, executor: Any
        ) -> Any:
            if WATCH.idle or getattr(_own, "busy", False):
                return execute(self, sql_, params, many, executor)
            return _statement(
                self.db, sql_, lambda: execute(self, sql_, params, many, executor), self
            )

        def _callproc(self: Any, procname: Any, params: Any = None, kparams: Any = None) -> Any:
            if WATCH.idle or getattr(_own, "busy", False):
                return callproc(self, procname, params, kparams)
            return _statement(self.db, None, lambda: callproc(self, procname, params, kparams))

        def _start_transaction_under_autocommit(self: Any) -> Any:
            busy, _own.busy = getattr(_own, "busy", False), True  # Django's own BEGIN
            try:
                result = begin(self)
            finally:
                _own.busy = busy
            if not WATCH.idle and self.connection is not None:
                self.__dict__[_CHANGES] = self.connection.total_changes
            return result

        BaseDatabaseWrapper._commit = _commit
        BaseDatabaseWrapper._rollback = _rollback
        CursorWrapper._execute_with_wrappers = _execute_with_wrappers
        CursorWrapper.callproc = _callproc
        SQLiteWrapper._start_transaction_under_autocommit = _start_transaction_under_autocommit
        _installed = True


# -- what the wrappers do --------------------------------------------------------------------------


def _subject(db: Any) -> Fence | object | None:
    """The attempt (or AMBIGUOUS) a write on ``db`` is for; None: not watched (no attempt,
    bookkeeping, the connection a fenced ``atomic()`` block of this thread covers, or a
    transaction whose fenced check passed)."""
    found = watch.attribution()
    if found is None or found is AMBIGUOUS:
        return found
    fence = cast("Fence", found)
    if db.alias in fence.blocks.atomic.here() or db.__dict__.get(CHECKED):
        return None
    return fence


def _forget(db: Any) -> None:
    """The connection's transaction ends: what the fence noted about it goes."""
    for name in (_CHANGES, CHECKED, _TABLE):
        db.__dict__.pop(name, None)


def _before_commit(db: Any) -> None:
    """Just before Django commits ``db``'s transaction: refuse it (rolled back) or flag it."""
    subject = _subject(db)
    if subject is None or db.connection is None:
        return
    if _wrote(db, subject):
        try:
            _decide(db, subject)
        except BaseException:
            db.rollback()  # Django's own: its on_commit callbacks are dropped with the write
            raise


def _statement(db: Any, statement: Any, run: Callable[[], T], cursor: Any = None) -> T:
    """One statement on ``db`` while a fenced body runs: in autocommit, inside a transaction of
    the fence's own; in a transaction, as it is (its commit is checked)."""
    subject = _subject(db)
    if subject is None:
        return run()
    if statement is not None:
        _remember_table(db, statement)
    db.ensure_connection()
    raw = db.connection
    try:
        if db.in_atomic_block or not db.get_autocommit():
            if db.vendor == "sqlite" and not raw.in_transaction:
                # pysqlite begins a transaction only before a statement it takes for a write:
                # begin it here, so a write it would not recognise cannot commit on its own.
                _run(raw, "BEGIN")
                db.__dict__[_CHANGES] = raw.total_changes
            return run()
        if not _watched_alone(db, subject):
            return run()
        return _in_own_transaction(db, subject, raw, run, cursor)
    except OperationalError as exc:
        # SQLite: a write on the file an open fence.transaction() block holds the write lock of
        # waits for it, then fails as "database is locked": say what it was.
        if (
            db.vendor == "sqlite"
            and "locked" in str(exc)
            and subject is not AMBIGUOUS
            and cast("Fence", subject).blocks.any_open
        ):
            raise watch.beside_block_error(where(db)) from exc
        raise


def _watched_alone(db: Any, subject: Any) -> bool:
    """Whether an autocommit statement on ``db`` needs a transaction of the fence's own: not
    when nothing could come of its check (``"allow"`` and no block open; a backend the fence
    cannot ask, no block open)."""
    if subject is AMBIGUOUS:
        return watch.block_open_anywhere()
    fence: Fence = subject
    if fence.blocks.any_open:
        return True
    if db.vendor not in ("postgresql", "sqlite"):
        return False
    execution = fence.execution
    mode = watch.DEFAULT_MODE if execution is None else execution.config.unfenced_writes
    return bool(mode != "allow")


def _in_own_transaction(
    db: Any, subject: Any, raw: Any, run: Callable[[], T], cursor: Any = None
) -> T:
    _own.busy = True
    watch.hold()
    try:
        _run(raw, "BEGIN")
        if db.vendor == "sqlite":
            db.__dict__[_CHANGES] = raw.total_changes
        try:
            result = run()
            if db.vendor == "sqlite" and cursor is not None:
                # SQLite counts a statement's changes (an INSERT ... RETURNING's too) when it
                # has run to its end, and commits no transaction with a statement in progress:
                # its rows are read now, and served from memory.
                cursor.cursor = _Buffered.of(cursor.cursor)
            if _wrote(db, subject):
                _decide(db, subject)
        except BaseException:
            with contextlib.suppress(Exception):  # a broken connection: the server rolls back
                _run(raw, "ROLLBACK")
            raise
        _run(raw, "COMMIT")
        return result
    finally:
        _forget(db)
        _own.busy = False
        watch.release()


def _wrote(db: Any, subject: Any) -> bool:
    """Whether ``db``'s open transaction wrote, by what the database says."""
    raw = db.connection
    if db.vendor == "sqlite":
        start = db.__dict__.get(_CHANGES)
        if start is None:  # begun before a fenced body ran: an open transaction wrote
            return bool(raw.in_transaction)
        return bool(raw.total_changes != start)
    if db.vendor == "postgresql":
        cursor = raw.cursor()
        try:
            cursor.execute(session_sql.pg_transaction_wrote((db.pg_version // 10000,)))
            row = cursor.fetchone()
        finally:
            cursor.close()
        return bool(row and row[0])
    # Another backend: the fence cannot ask it. Beside an open block, refused (fail closed).
    if subject is AMBIGUOUS:
        return watch.block_open_anywhere()
    fence: Fence = subject
    return fence.blocks.any_open


def where(db: Any) -> str:
    """How a Django connection is named in the errors and the warning."""
    return f"Django's {db.alias!r} database connection"


def _decide(db: Any, subject: Any) -> None:
    """A transaction on ``db`` wrote for ``subject``: :func:`watch.judge` decides."""
    watch.judge(subject, where=where(db), table=db.__dict__.get(_TABLE))


def _remember_table(db: Any, statement: Any) -> None:
    """The table a writing statement names, for the warning only (never to decide)."""
    found = _WRITTEN_TABLE.search(statement if isinstance(statement, str) else str(statement))
    if found:
        db.__dict__[_TABLE] = found[1]


class _Buffered:
    """A DB-API cursor whose last statement's rows were read to the end and are served from
    memory; everything else (the next ``execute``, ``rowcount``, ``lastrowid``, ``description``)
    is the cursor's own."""

    def __init__(self, cursor: Any, rows: list[Any]) -> None:
        self._cursor = cursor
        self._rows: collections.deque[Any] | None = collections.deque(rows)

    @classmethod
    def of(cls, cursor: Any) -> Any:
        inner = cursor._cursor if isinstance(cursor, _Buffered) else cursor
        if inner.description is None:
            return inner
        return cls(inner, inner.fetchall())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)

    def execute(self, *args: Any) -> Any:
        self._rows = None
        return self._cursor.execute(*args)

    def executemany(self, *args: Any) -> Any:
        self._rows = None
        return self._cursor.executemany(*args)

    def fetchone(self) -> Any:
        if self._rows is None:
            return self._cursor.fetchone()
        return self._rows.popleft() if self._rows else None

    def fetchmany(self, size: int | None = None) -> list[Any]:
        count = size or self._cursor.arraysize
        if self._rows is None:
            return list(self._cursor.fetchmany(count))
        return [self._rows.popleft() for _ in range(min(count, len(self._rows)))]

    def fetchall(self) -> list[Any]:
        if self._rows is None:
            return list(self._cursor.fetchall())
        rows, self._rows = list(self._rows), collections.deque()
        return rows

    def __iter__(self) -> Any:
        return iter(self.fetchone, None)


def _run(raw: Any, statement: str) -> None:
    cursor = raw.cursor()
    try:
        cursor.execute(statement)
    finally:
        cursor.close()


__all__ = ["CHECKED", "install", "where"]
