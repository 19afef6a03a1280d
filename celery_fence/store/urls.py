"""Whether two database URLs name one database: the store's, and an engine or a connection a
caller hands it (``fence.transaction(bind=...)``, ``enqueue(conn, ...)``, a Django alias)."""

from __future__ import annotations

import os

import sqlalchemy as sa

_LOCAL_HOSTS = frozenset({"", "localhost", "127.0.0.1", "::1"})


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


__all__ = ["different_database"]
