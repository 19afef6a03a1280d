"""Bounded waits: every wait in a test or harness ends, with a message naming what it waited for."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from typing import Any


class WaitTimeout(AssertionError, TimeoutError):
    """A bounded wait ran out (an ``AssertionError`` in a test, a ``TimeoutError`` elsewhere)."""


def poll_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """Poll ``predicate()`` until truthy and return its value; ``None`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            return None
        time.sleep(interval)


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``predicate()`` until truthy and return its value; raise :class:`WaitTimeout` after
    ``timeout`` seconds (every wait is bounded)."""
    assert callable(predicate)
    value = poll_until(predicate, timeout, interval)
    if not value:
        raise WaitTimeout(f"timed out after {timeout}s waiting for {what or predicate}")
    return value


CLUSTER_BUS_OFFSET = 10000  # a Redis Cluster node's bus listens on its port + 10000


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback TCP port; with ``cluster_bus``, one whose Redis Cluster bus port
    (``port + 10000``) is free too (drawn from 21000-39000, so the bus port stays valid)."""
    if not cluster_bus:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    for _ in range(500):
        port = random.randint(21000, 39000)
        if _bindable(port) and _bindable(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port (with a free cluster bus port) found")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
