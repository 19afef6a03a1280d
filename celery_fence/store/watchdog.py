"""A client-side deadline for database calls: a call that outlives it has its socket cut.

libpq bounds a dead *network* (``keepalives``, ``tcp_user_timeout``) and PostgreSQL bounds a slow
*statement* (``statement_timeout``), but nothing bounds a peer that accepts and acknowledges
packets and never answers — a proxy, a NAT or a load balancer that stopped forwarding without
closing: libpq waits in ``poll()`` with no timeout. So every PostgreSQL call the store makes is
armed here with its deadline (``fence_database_timeout``), and one daemon thread per process
shuts down the socket of a call still running past it. The driver then fails the call as a broken
connection (a transient error: the attempt takes the "store unavailable" path) and the pool drops
the connection.

Arming is a dict insert on the caller's thread (no wake-up); the thread looks every :data:`TICK`
seconds. A call that ends exactly at its deadline races the thread: the thread's "cut" and the
caller's "done" (:meth:`Watchdog.disarm`) take one lock, and whoever comes first wins. The caller
that disarms first keeps a connection that is never cut; the caller that comes second learns from
``disarm()`` that its connection was cut (its answer may have arrived; the socket did not
survive), so it can drop the connection rather than give it back to the pool.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time

from celery_fence.actions import LogAction
from celery_fence.process.background import Background
from celery_fence.process.runtime import runtime

logger = logging.getLogger(__name__)

#: Seconds between the thread's looks at the armed calls (a deadline is kept within this).
TICK = 0.25

WATCHDOG_THREAD_NAME = "celery-fence-db-watchdog"


class Watchdog(Background):
    """The armed calls of one process and the thread that enforces their deadlines."""

    thread_name = WATCHDOG_THREAD_NAME

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[int, tuple[float, int]] = {}
        self._tokens = itertools.count(1)
        self._cut_lock = threading.Lock()  # the thread's "cut" against the caller's "done"
        self._stopping = False
        self.cuts = 0

    def arm(self, fd: int, timeout: float) -> int:
        """Watch the call about to run on socket ``fd`` for ``timeout`` seconds; return a token
        for :meth:`disarm`."""
        if self._thread is None or self._stopping:  # first use, or used again after shutdown
            self._stopping = False
            self.start()
        token = next(self._tokens)
        self._calls[token] = (time.monotonic() + timeout, fd)
        return token

    def disarm(self, token: int | None) -> bool:
        """The call ended (whatever its outcome): stop watching it. True when the watchdog had
        already cut its connection (the deadline came first); the connection must not be
        reused."""
        if token is None:
            return False
        with self._cut_lock:
            return self._calls.pop(token, None) is None

    def shutdown(self, timeout: float) -> None:
        """Stop looking (a call still armed is left to its own timeouts)."""
        self._stopping = True
        self.join(min(timeout, TICK * 2))

    def _run(self) -> None:
        while not self._stopping:
            time.sleep(TICK)
            self.sweep()

    def sweep(self, now: float | None = None) -> int:
        """Cut the connection of every call past its deadline at ``now`` (default: the
        monotonic clock) that its caller has not disarmed first; return how many were cut."""
        now = time.monotonic() if now is None else now
        cut = 0
        for token, (deadline, fd) in list(self._calls.items()):
            if now <= deadline:
                continue
            with self._cut_lock:  # the caller's disarm() waits for the cut, or wins before it
                if self._calls.pop(token, None) is None:
                    continue  # the call ended first: its connection is fine
                self._cut(fd)
            cut += 1
            logger.warning(
                "a database call outlived fence_database_timeout: its connection was cut",
                extra={"action": LogAction.DB_TIMEOUT, "reason": "fence_database_timeout"},
            )
        return cut

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


def watchdog() -> Watchdog:
    """This process's watchdog (a forked child gets its own)."""
    return runtime().get("watchdog", None, Watchdog)
