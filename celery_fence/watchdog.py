"""A client-side deadline for database calls: a call that outlives it has its socket cut.

libpq bounds a dead *network* (``keepalives``, ``tcp_user_timeout``) and PostgreSQL bounds a slow
*statement* (``statement_timeout``), but nothing bounds a peer that accepts and acknowledges
packets and never answers — a proxy, a NAT or a load balancer that stopped forwarding without
closing: libpq waits in ``poll()`` with no timeout. So every PostgreSQL call the store makes is
armed here with its deadline (``fence_database_timeout``), and one daemon thread per process
shuts down the socket of a call still running past it. The driver then fails the call as a broken
connection (a transient error: the attempt takes the "store unavailable" path) and the pool drops
the connection.

Arming is two dict operations on the caller's thread (no lock, no wake-up); the thread looks
every :data:`TICK` seconds. A call that ends in the instant between the thread's check and the
cut loses a connection that was fine; its next user sees a broken connection, a transient error.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time

logger = logging.getLogger(__name__)

#: Seconds between the thread's looks at the armed calls (a deadline is kept within this).
TICK = 0.25

WATCHDOG_THREAD_NAME = "celery-fence-db-watchdog"


class Watchdog:
    """The armed calls of one process and the thread that enforces their deadlines."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[float, int]] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.cuts = 0

    def arm(self, fd: int, timeout: float) -> int:
        """Watch the call about to run on socket ``fd`` for ``timeout`` seconds; return a token
        for :meth:`disarm`."""
        if self._thread is None:
            self._start()
        token = next(self._tokens)
        self._calls[token] = (time.monotonic() + timeout, fd)
        return token

    def disarm(self, token: int | None) -> None:
        """The call ended (whatever its outcome): stop watching it."""
        if token is not None:
            self._calls.pop(token, None)

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name=WATCHDOG_THREAD_NAME, daemon=True
                )
                self._thread.start()

    def reset(self) -> None:
        """Forget the parent's thread, calls and lock (the runtime's fork hook, in the child)."""
        self._calls = {}
        self._thread = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            for token, (deadline, fd) in list(self._calls.items()):
                if now > deadline and self._calls.pop(token, None) is not None:
                    self._cut(fd)

    def _cut(self, fd: int) -> None:
        """Shut the socket down under the driver (a duplicate descriptor: the driver keeps and
        closes its own); its pending ``poll()`` returns and the call fails as a lost connection."""
        self.cuts += 1
        try:
            dup = os.dup(fd)
        except OSError:
            return
        with contextlib.closing(socket.socket(fileno=dup)) as sock, contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        logger.warning(
            "a database call outlived fence_database_timeout: its connection was cut",
            extra={"action": "db_timeout", "reason": "fence_database_timeout"},
        )


#: The process's watchdog.
watchdog = Watchdog()
