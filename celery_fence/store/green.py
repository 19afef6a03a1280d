"""The store's waits under gevent (``celery worker -P gevent``): cooperative, so they stay bounded.

Under gevent every greenlet of the worker, the renewer's and the database watchdog's included,
runs on one OS thread. A wait inside a C library that gevent did not patch blocks all of them:

- psycopg2 waits for PostgreSQL in libpq's own ``poll()``. The watchdog, which would cut a call
  that outlives ``fence_database_timeout``, never runs, and neither do the lease renewals. With
  psycopg2's wait callback (:func:`gevent_wait_callback`, installed once per process when the
  first PostgreSQL engine is made under gevent) libpq works in non-blocking mode and each wait
  yields to gevent's hub: the watchdog can cut the call, ``statement_timeout`` and
  ``lock_timeout`` end it server-side, and the other greenlets go on meanwhile.
- psycopg 3 makes its own waits cooperative: when it is imported after gevent patched
  ``select`` (``celery -P gevent`` patches before the app is imported), it waits through the
  patched ``poll`` instead of its C wait. Nothing to install.
- SQLite waits for a lock held by another connection in its busy handler, in C: the whole
  process waits with it, and the holder may be a greenlet of the same process that cannot run
  until the wait ends. Under gevent the busy timeout is :data:`GREEN_SQLITE_BUSY_TIMEOUT`; a
  write that does not get the lock in that time fails as "store unavailable" and its message is
  re-sent with backoff.
"""

from __future__ import annotations

import sys
from typing import Any

#: Seconds a SQLite connection waits for a lock under gevent (the whole process waits with it).
GREEN_SQLITE_BUSY_TIMEOUT = 0.5


def gevent_patched() -> bool:
    """Whether gevent has patched this process's sockets (the gevent pool does, at start)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


def sqlite_busy_timeout(default: float) -> float:
    """The busy timeout for a new SQLite connection: ``default``, short under gevent."""
    return min(default, GREEN_SQLITE_BUSY_TIMEOUT) if gevent_patched() else default


def cooperative_waits(driver: str) -> bool:
    """Under gevent, make ``driver``'s waits yield to the hub (psycopg2: its wait callback);
    True when this process's waits on it are cooperative. Installs once, never replaces a
    callback the application set itself."""
    if not gevent_patched() or driver != "psycopg2":
        return False
    from psycopg2 import extensions

    if extensions.get_wait_callback() is None:
        extensions.set_wait_callback(gevent_wait_callback)
    return True


def gevent_wait_callback(conn: Any, timeout: float | None = None) -> None:
    """psycopg2's wait callback for gevent (psycogreen's pattern): poll the connection, and
    wait for its socket through the hub."""
    from gevent.socket import wait_read, wait_write
    from psycopg2 import OperationalError, extensions

    while True:
        state = conn.poll()
        if state == extensions.POLL_OK:
            return
        if state == extensions.POLL_READ:
            wait_read(conn.fileno(), timeout=timeout)
        elif state == extensions.POLL_WRITE:
            wait_write(conn.fileno(), timeout=timeout)
        else:
            raise OperationalError(f"bad result from poll: {state!r}")


__all__ = [
    "GREEN_SQLITE_BUSY_TIMEOUT",
    "cooperative_waits",
    "gevent_patched",
    "gevent_wait_callback",
    "sqlite_busy_timeout",
]
