"""The watchdog's deadline edge: a call that ends exactly at its deadline races the watchdog's
cut, and whoever comes first wins — never a cut the caller was told did not happen."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator

import pytest

from celery_fence.store.watchdog import Watchdog


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(2.0)
    yield a, b
    a.close()
    b.close()


def _cut(a: socket.socket, b: socket.socket) -> bool:
    """True when ``a`` was shut down (it reads EOF instead of what its peer sent)."""
    try:
        b.sendall(b"x")
    except OSError:
        return True
    return a.recv(1) == b""


def test_a_call_that_disarms_first_keeps_its_connection(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    watchdog = Watchdog()
    # Given a call armed with a deadline that has passed, which ends before the watchdog looks
    token = watchdog.arm(a.fileno(), 0.0)
    # Then its disarm says "not cut", the watchdog's next look cuts nothing, and the socket works
    assert watchdog.disarm(token) is False
    assert watchdog.sweep(now=math.inf) == 0
    assert not _cut(a, b)
    # ... while a call still armed past its deadline is cut, and told so when it disarms
    token = watchdog.arm(a.fileno(), 0.0)
    assert watchdog.sweep(now=math.inf) == 1
    assert watchdog.disarm(token) is True
    assert _cut(a, b)


def test_a_call_ending_while_the_watchdog_cuts_it_is_told_so(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    deciding, proceed, returned = threading.Event(), threading.Event(), threading.Event()

    class Paused(Watchdog):
        """Stops between deciding to cut and cutting: the window of the race."""

        def _cut(self, fd: int) -> None:
            deciding.set()
            proceed.wait(2.0)
            super()._cut(fd)

    watchdog = Paused()
    # Given a call past its deadline that the watchdog's thread has decided to cut ...
    token = watchdog.arm(a.fileno(), 0.0)
    assert deciding.wait(5.0), "the watchdog did not look"
    # ... when the call ends right then (its caller disarms while the cut is under way)
    answer: list[bool | None] = []

    def caller() -> None:
        answer.append(watchdog.disarm(token))
        returned.set()

    threading.Thread(target=caller, daemon=True).start()
    returned.wait(0.3)  # a disarm that does not wait for the cut returns here
    proceed.set()
    assert returned.wait(5.0)
    # Then the caller is told its connection was cut, and it was: never "fine" and cut after
    assert answer == [True]
    assert _cut(a, b)
