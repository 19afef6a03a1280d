"""One runtime per process: what a worker process shares between its tasks, reset by one fork hook.

A socket, a thread or a lock belongs to one process, and Celery's prefork pool forks its children
after the app (and often its first stores) were set up. So the process's SQL stores, Redis
clients, lease stores, renewers, retry budgets, event senders and its one background writer live
on one :class:`Runtime`, a registry that knows none of them (:mod:`celery_fence.backends` makes
them). :func:`runtime` returns the current process's; an at-fork hook gives a
forked child a fresh, empty one, which builds its own on first use. The parent's objects are left
alone in the child: its threads are not there, and its engines and clients are kept referenced
but never used, so garbage collection does not close a socket the parent still uses.

Whoever caches an object got from the runtime checks :attr:`Runtime.forked` (an attribute read,
no system call) to know the copy it holds belongs to a parent.

Per-app state set up at import time, before the pool forks (the settings read from ``app.conf``,
the outbox's handlers), is not per process: :func:`app_state` keeps it on the app.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from .actions import LogAction
from .watchdog import watchdog

if TYPE_CHECKING:
    from .config import FenceConfig
    from .outbox import Outbox

logger = logging.getLogger("celery_fence")

#: Off-thread writes waiting for the background writer; beyond this they are dropped (logged).
MAX_PENDING_WRITES = 1_000

WRITER_THREAD_NAME = "celery-fence-writer"

_T = TypeVar("_T")


class Background:
    """The base of an object that runs a background thread of its own (the renewer, an event
    sender, the background writer): its thread starts on first use; :meth:`shutdown` finishes
    its queued work and stops it, bounded by ``timeout``. After a fork the child never touches
    it: the child's runtime makes its own. (A base class, not a protocol: a Redis client has a
    ``shutdown`` method too, which stops the server.)"""

    def shutdown(self, timeout: float) -> None:
        raise NotImplementedError


class Runtime:
    """The process-wide objects of one process, made on first use by the factory their caller
    passes (see :mod:`celery_fence.backends`); thread-safe. A registry: it knows no kind of
    object, only how to keep one per identity and how to stop the ones with a thread."""

    def __init__(self) -> None:
        #: True in a forked child for its parent's runtime: ask :func:`runtime` for the child's.
        self.forked = False
        self._parent: Runtime | None = None
        self._lock = threading.RLock()  # a factory may ask for another object (a store's client)
        self._items: dict[tuple[str, Any], Any] = {}
        self.writer = BackgroundWriter()

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
        """Finish the background writes, then every background object's queued work (lease
        releases, events), each bounded by ``timeout`` (a worker process that exits)."""
        self.writer.shutdown(timeout)
        items = sorted(self._items.items(), key=lambda entry: entry[0][0] == "events")
        for (kind, _), item in items:  # events last: the others may still queue one
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


class BackgroundWriter(Background):
    """One daemon thread running writes that must not happen on the caller's thread (the renewal
    thread records a lost lease here, so a slow database never delays other leases' renewals).

    :meth:`submit` never blocks: past :data:`MAX_PENDING_WRITES` a write is dropped and logged.
    """

    def __init__(self, maxsize: int = MAX_PENDING_WRITES) -> None:
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None]
        self._queue = queue.Queue(maxsize)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the writer thread; False when the queue is full (dropped)."""
        try:
            self._queue.put_nowait((fn, args))
        except queue.Full:
            self.dropped += 1
            logger.warning(
                "background write queue full: %s dropped",
                getattr(fn, "__name__", "a write"),
                extra={"action": LogAction.WRITE_DROPPED, "reason": "queue full"},
            )
            return False
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name=WRITER_THREAD_NAME, daemon=True
                )
                self._thread.start()
        return True

    def shutdown(self, timeout: float) -> None:
        self.drain(timeout)

    def drain(self, timeout: float) -> bool:
        """Run the queued writes and stop the thread (bounded); True when it finished."""
        with self._lock:
            thread = self._thread
        if thread is None or not thread.is_alive():
            return True
        end = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        thread.join(max(0.0, end - time.monotonic()))
        return not thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                fn, args = item
                try:
                    fn(*args)
                except Exception:
                    logger.exception("background write %s failed", getattr(fn, "__name__", fn))
            finally:
                self._queue.task_done()


@dataclass
class AppState:
    """Per-app state that survives the pool's fork: made in the parent, shared by the children."""

    #: The app's settings (:meth:`FenceConfig.from_app`); None until first read.
    config: FenceConfig | None = None
    #: The app's :class:`~celery_fence.outbox.Outbox` (its handler registry), if one was made.
    outbox: Outbox | None = None
    #: Whether the worker sends task events (``-E`` sets the worker's flag, not ``app.conf``);
    #: None until ``worker_init`` says (see :func:`celery_fence.events.task_events_enabled`).
    task_events: bool | None = None
    #: What the worker was started with, as an operator types it again: ``celery -A proj``;
    #: None until ``worker_init`` says (see :func:`celery_fence.worker.celery_command`).
    celery_command: str | None = None
    #: Whether :func:`celery_fence.install` ran for the app (its receivers act on it).
    installed: bool = False


_STATE_ATTRIBUTE = "_fence_state"


def app_state(app: Any) -> AppState:
    """The celery-fence state of ``app`` (kept on the app: it lives and dies with it)."""
    state: AppState | None = app.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        state = app.__dict__.setdefault(_STATE_ATTRIBUTE, AppState())
    return state


#: The apps :func:`celery_fence.install` ran for in this process (inherited by a forked child).
_installed_apps: weakref.WeakSet[Any] = weakref.WeakSet()


def real_app(app: Any) -> Any:
    """``app`` itself, or the app behind Celery's ``current_app`` proxy."""
    resolve = getattr(app, "_get_current_object", None)
    return resolve() if callable(resolve) else app


def mark_installed(app: Any) -> bool:
    """Record that ``app`` is installed; False when it already was (idempotent)."""
    state = app_state(app)
    if state.installed:
        return False
    state.installed = True
    _installed_apps.add(app)
    return True


def installed(app: Any) -> bool:
    """Whether ``app`` (a Celery app, a proxy to one, or None) was installed; never creates
    state on an app that was not: the receivers ask this of every app a signal names."""
    if app is None:
        return False
    state = getattr(real_app(app), "__dict__", {}).get(_STATE_ATTRIBUTE)
    return isinstance(state, AppState) and state.installed


def installed_apps() -> list[Any]:
    """The apps installed in this process (in no particular order)."""
    return list(_installed_apps)


_current = Runtime()
_current_lock = threading.Lock()


def runtime() -> Runtime:
    """This process's runtime."""
    return _current


def _after_fork_in_child() -> None:
    """The one fork hook: the child gets a fresh runtime and new locks; the parent's runtime is
    marked forked and kept referenced (never used), and the database watchdog starts empty."""
    global _current, _current_lock
    parent = _current
    parent.forked = True
    _current = Runtime()
    _current._parent = parent
    _current_lock = threading.Lock()
    watchdog.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = [
    "AppState",
    "Background",
    "BackgroundWriter",
    "Runtime",
    "app_state",
    "installed",
    "installed_apps",
    "mark_installed",
    "real_app",
    "runtime",
]
