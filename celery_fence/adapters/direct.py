"""A fenced task run in the caller's own thread — a direct call ``task(...)``, ``.apply()``,
``task_always_eager`` — inside the caller's open transaction on the fence store's database.

The fence's own statements (the job's registration and completion) run on the store's connections
and a fenced block's commit check is an ``UPDATE`` of the job row; the caller's transaction stays
open until the call returns. So inside it:

- a Django ``transaction.atomic()`` on the store's alias (``ATOMIC_REQUESTS``, an atomic
  management command, pytest-django's test transaction): ``fence.atomic()`` is a savepoint of the
  caller's transaction, its check locks the job row until the caller commits, and the store's
  completion waits on that lock — a deadlock ended by the lock timeout, the row left ``running``;
- an SQLAlchemy transaction that holds locks (it wrote, or locked rows) on the store's database:
  the task's fenced writes, or on SQLite any write of the store, wait on it the same way.

Such a call is refused before it claims anything (:func:`refusal`): nothing is written, nothing
is left for recovery to run later. SQLAlchemy transactions are seen through three engine events
(``begin``, ``commit``, ``rollback``) listened to on every engine of the process
(:func:`track_transactions`, called when :mod:`celery_fence.adapters.task` is imported): one
dictionary operation per transaction; a transaction begun before that import is not seen.

After a direct or eager call the store's idle PostgreSQL connections are closed
(:func:`release_connections`), so a test database can be dropped afterwards (pytest-django,
Django's test runner).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import sqlalchemy as sa

from celery_fence import django_port
from celery_fence.store import Store, sql
from celery_fence.store.urls import different_database

_local = threading.local()  # .open: {id(connection): weakref to it} of this thread
_track_lock = threading.Lock()


def track_transactions() -> None:
    """Listen (once per process) to every SQLAlchemy engine's transactions, per thread."""
    with _track_lock:
        if not sa.event.contains(sa.Engine, "begin", _began):
            sa.event.listen(sa.Engine, "begin", _began)
            sa.event.listen(sa.Engine, "commit", _ended)
            sa.event.listen(sa.Engine, "rollback", _ended)


def _open() -> dict[int, weakref.ref[sa.Connection]]:
    found: dict[int, weakref.ref[sa.Connection]] | None = getattr(_local, "open", None)
    if found is None:
        found = _local.open = {}
    return found


def _began(conn: sa.Connection) -> None:
    _open()[id(conn)] = weakref.ref(conn)


def _ended(conn: sa.Connection) -> None:
    _open().pop(id(conn), None)


def open_transactions() -> list[sa.Connection]:
    """This thread's SQLAlchemy connections with a transaction open (as SQLAlchemy sees it)."""
    registry = _open()
    found = []
    for ident, ref in list(registry.items()):
        conn = ref()
        if conn is None or conn.closed or conn.invalidated or not conn.in_transaction():
            registry.pop(ident, None)
            continue
        found.append(conn)
    return found


def refusal(store: Store, task_name: str) -> str | None:
    """Why ``task_name``, called in this thread now, would wait on the caller's own transaction
    on ``store``'s database (the message of the refusal), or None when it may run."""
    reasons = [*_sqlalchemy_reasons(store), *_django_reasons(store)]
    if not reasons:
        return None
    return (
        f"fenced task {task_name} was called in this thread (task(...), .apply() or "
        "task_always_eager) inside an open transaction on the fence store's database: "
        f"{'; '.join(reasons)}. The fence's own statements run on connections of their own and "
        "would wait for that transaction to end (a fenced commit checks the job row inside it; "
        "the store's completion then waits on that row), until a lock timeout fails the call. "
        "Nothing was claimed or written. Send the task after your commit instead "
        "(`transaction.on_commit(lambda: task.delay(...))` in Django, `celery_fence.enqueue(...)` "
        "in your transaction, or `.delay()` after it), or call it outside the transaction; in "
        "tests, let the test commit (pytest-django: `@pytest.mark.django_db(transaction=True)`) "
        "or run the task on a worker (celery_fence.testing's fenced_worker fixture)."
    )


def _sqlalchemy_reasons(store: Store) -> list[str]:
    ours = sa.engine.make_url(store.url)
    reasons = []
    for conn in open_transactions():
        if different_database(ours, conn.engine.url) is not None:
            continue
        if _holds_locks(store, conn):
            reasons.append(
                f"an SQLAlchemy transaction (engine {conn.engine.url.render_as_string()}) "
                "that has written or locked rows"
            )
    return reasons


def _holds_locks(store: Store, conn: sa.Connection) -> bool:
    """Whether ``conn``'s open transaction holds locks another connection may wait on: on
    SQLite a write transaction (the driver begins one at the first write); on PostgreSQL a
    transaction id (assigned at the first write or row lock), read from ``pg_locks`` on a store
    connection — ``conn`` itself is not touched. A driver whose backend is unknown counts."""
    try:
        dbapi: Any = conn.connection.dbapi_connection
    except Exception:  # closed meanwhile
        return False
    if conn.dialect.name == "sqlite":
        return bool(getattr(dbapi, "in_transaction", True))
    pid = _backend_pid(dbapi)
    if pid is None:
        return True
    try:
        with store.db.connect() as ours:
            return bool(ours.execute(sql.holds_transaction_id(pid)).scalar())
    except Exception:  # the store unreachable: the call finds out on its own
        return False


def _backend_pid(dbapi: Any) -> int | None:
    get = getattr(dbapi, "get_backend_pid", None)  # psycopg2
    if get is not None:
        return int(get())
    info = getattr(dbapi, "info", None)  # psycopg 3
    pid = getattr(info, "backend_pid", None)
    return None if pid is None else int(pid)


def _django_reasons(store: Store) -> list[str]:
    """The Django aliases on the store's database with an atomic block open in this thread (in a
    process with Django configured; Django is never imported here)."""
    if not django_port.django_configured():
        return []
    side = django_port.django_side("The direct-call check for an open transaction.atomic()")
    return [
        f"Django's transaction.atomic() is open on alias {alias!r} (ATOMIC_REQUESTS, an atomic "
        "management command, pytest-django's test transaction, ...)"
        for alias in side.atomic_aliases_on(store.url)
    ]


def release_connections(store: Store) -> None:
    """After a direct or eager call: close the store's idle PostgreSQL connections, so the
    caller's process keeps none open on its database between calls (a test database can then be
    dropped). The next call connects again."""
    if store.dialect == "postgresql":
        store.db.close_idle()


track_transactions()

__all__ = ["open_transactions", "refusal", "release_connections", "track_transactions"]
