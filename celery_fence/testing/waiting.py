"""Bounded waits: every wait in a test or harness ends, with a message naming what it waited for."""

from __future__ import annotations

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


def free_port() -> int:
    """A free loopback TCP port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
