"""One runtime per process: what a worker process shares between its tasks, reset by one fork hook.

A socket, a thread or a lock belongs to one process, and Celery's prefork pool forks its children
after the app (and often its first stores) were set up. So the process's SQL stores, Redis
clients, lease stores, retry budgets and background threads
(:mod:`celery_fence.process.background`) live on one :class:`Runtime`, a registry that knows none
of them (:mod:`celery_fence.pipeline.backends` makes them). :func:`runtime` returns the current
process's; an at-fork hook gives a forked child a fresh, empty one, which builds its own on first
use. The parent's objects are left alone in the child: its threads are not there, and its engines
and clients are kept referenced but never used, so garbage collection does not close a socket the
parent still uses.

Whoever caches an object got from the runtime checks :attr:`Runtime.forked` (an attribute read,
no system call) to know the copy it holds belongs to a parent.

Per-app state set up at import time, before the pool forks (the settings read from ``app.conf``,
the outbox's handlers), is not per process: :func:`celery_fence.config.app_state` keeps it on the
app.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from celery_fence.process.background import Background

_T = TypeVar("_T")

#: The order in which :meth:`Runtime.shutdown` stops background objects, by kind: the writer
#: first, the event senders last (the others may still queue an event).
_SHUTDOWN_ORDER = {"writer": 0, "events": 2}


class Runtime:
    """The process-wide objects of one process, made on first use by the factory their caller
    passes (see :mod:`celery_fence.pipeline.backends`); thread-safe. A registry: it knows no kind of
    object, only how to keep one per identity and how to stop the ones with a thread."""

    def __init__(self) -> None:
        #: True in a forked child for its parent's runtime: ask :func:`runtime` for the child's.
        self.forked = False
        self._parent: Runtime | None = None
        self._lock = threading.RLock()  # a factory may ask for another object (a store's client)
        self._items: dict[tuple[str, Any], Any] = {}

    def get(self, kind: str, ident: Any, make: Callable[[], _T]) -> _T:
        """The object of ``kind`` for ``ident`` in this process, made by ``make()`` once."""
        item = self._items.get((kind, ident))
        if item is None:
            with self._lock:
                item = self._items.get((kind, ident))
                if item is None:
                    item = self._items[(kind, ident)] = make()
        return item

    def items(self, kind: str) -> list[Any]:
        """The objects of ``kind`` made so far."""
        return [item for (k, _), item in list(self._items.items()) if k == kind]

    def stores(self) -> list[Any]:
        """The SQL stores made so far (tests and fixtures dispose their connections)."""
        return self.items("store")

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop every background object (:mod:`celery_fence.process.background`), each after its
        queued work (lease releases, writes, events) and bounded by ``timeout``: a worker process
        that exits."""
        items = sorted(self._items.items(), key=lambda e: _SHUTDOWN_ORDER.get(e[0][0], 1))
        for (kind, _), item in items:
            if isinstance(item, Background):
                item.shutdown(min(timeout, 1.0) if kind == "events" else timeout)

    def reset(self) -> None:
        """Stop this runtime's threads and dispose its stores' connections, and make
        :func:`runtime` return a fresh one (tests: a clean process without forking)."""
        global _current
        self.shutdown(timeout=1.0)
        for store in self.stores():
            store.dispose()
        with _current_lock:
            if _current is self:
                _current = Runtime()


_current = Runtime()
_current_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime."""
    return _current


def _after_fork_in_child() -> None:
    """The one fork hook: the child gets a fresh runtime and new locks; the parent's runtime is
    marked forked and kept referenced (never used)."""
    global _current, _current_lock
    parent = _current
    parent.forked = True
    _current = Runtime()
    _current._parent = parent
    _current_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["Runtime", "runtime"]
