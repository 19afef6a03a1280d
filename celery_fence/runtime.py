"""One runtime per process: what a worker process shares between its tasks, reset by one fork hook.

A socket, a thread or a lock belongs to one process, and Celery's prefork pool forks its children
after the app (and often its first stores) were set up. So the process's SQL stores, Redis
clients, lease stores, renewers, retry budgets, event senders and its one background writer live
on one :class:`Runtime`. :func:`runtime` returns the current process's; an at-fork hook gives a
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from .watchdog import watchdog

if TYPE_CHECKING:
    from .config import FenceConfig
    from .events import EventSender
    from .lease import LeaseStore
    from .outbox import Outbox
    from .renewer import Renewer
    from .retry import RetryBudget, RetryPolicy
    from .store import Store

logger = logging.getLogger("celery_fence")

#: Off-thread writes waiting for the background writer; beyond this they are dropped (logged).
MAX_PENDING_WRITES = 1_000

WRITER_THREAD_NAME = "celery-fence-writer"

#: The settings a :class:`~celery_fence.store.Store` is made with, besides the database URL:
#: configurations equal in these share one store.
STORE_SETTINGS = (
    "record_transitions",
    "unfenced",
    "defer_first_registration",
    "error_message_length",
    "database_timeout",
    "lock_timeout",
)

_T = TypeVar("_T")


class Backends(NamedTuple):
    """What one fenced task uses, resolved once per task and process."""

    config: FenceConfig
    store: Store
    leases: LeaseStore
    policy: RetryPolicy
    renewer: Renewer
    runtime: Runtime


def client_identity(config: FenceConfig) -> tuple[Any, ...]:
    """What makes two configurations' Redis clients interchangeable: URL, client factory,
    cluster mode, TLS and transport options (the lease store and the retry budget share by it)."""
    return (
        config.redis_url,
        config.redis_client,
        config.redis_cluster,
        repr(sorted((config.redis_ssl or {}).items())),
        repr(sorted((config.redis_transport_options or {}).items())),
    )


class Runtime:
    """The process-wide objects of one process, created on first use; thread-safe."""

    def __init__(self) -> None:
        #: True in a forked child for its parent's runtime: ask :func:`runtime` for the child's.
        self.forked = False
        self._parent: Runtime | None = None
        self._lock = threading.RLock()  # creating a lease store creates its client
        self._stores: dict[tuple[Any, ...], Store] = {}
        self._clients: dict[tuple[Any, ...], Any] = {}
        self._leases: dict[tuple[Any, ...], tuple[LeaseStore, Renewer]] = {}
        self._budgets: dict[tuple[Any, ...], RetryBudget] = {}
        self._senders: dict[tuple[int, str], EventSender] = {}
        self.writer = BackgroundWriter()

    def _get(self, cache: dict[Any, _T], ident: Any, make: Callable[[], _T]) -> _T:
        item = cache.get(ident)
        if item is None:
            with self._lock:
                item = cache.get(ident)
                if item is None:
                    item = cache[ident] = make()
        return item

    def store(self, config: FenceConfig) -> Store:
        """The SQL store for ``config``'s database and store settings."""
        ident = (config.database_url, *(getattr(config, name) for name in STORE_SETTINGS))
        return self._get(self._stores, ident, lambda: _make_store(config))

    def redis_client(self, config: FenceConfig) -> Any:
        """The Redis client for ``config``'s lease Redis (URL, client factory, TLS, transport,
        cluster: :func:`client_identity`); leases and the retry budget share it."""
        return self._get(self._clients, client_identity(config), lambda: _make_client(config))

    def lease_store(self, config: FenceConfig) -> LeaseStore:
        """The lease store for ``config``'s Redis, key prefix and counter lifetime."""
        return self._lease_pair(config)[0]

    def renewer(self, config: FenceConfig) -> Renewer:
        """The heartbeat of :meth:`lease_store`'s leases."""
        return self._lease_pair(config)[1]

    def _lease_pair(self, config: FenceConfig) -> tuple[LeaseStore, Renewer]:
        def make() -> tuple[LeaseStore, Renewer]:
            from .lease import LeaseStore
            from .renewer import Renewer

            leases = LeaseStore(
                self.redis_client(config),
                prefix=config.key_prefix,
                generation_ttl=config.generation_ttl,
            )
            return leases, Renewer(leases)

        ident = (client_identity(config), config.key_prefix, config.generation_ttl)
        return self._get(self._leases, ident, make)

    def retry_budget(self, config: FenceConfig) -> RetryBudget:
        """The retry budgets (per task name) for ``config``'s Redis, prefix and budget settings."""

        def make() -> RetryBudget:
            from .retry import RetryBudget

            return RetryBudget(config, redis_client=self.redis_client(config))

        ident = (
            client_identity(config),
            config.key_prefix,
            config.retry_budget_ratio,
            config.retry_budget_floor,
            config.retry_budget_window,
        )
        return self._get(self._budgets, ident, make)

    def backends(self, config: FenceConfig) -> Backends:
        """Everything a fenced task with settings ``config`` uses in this process."""
        from .retry import RetryPolicy

        return Backends(
            config,
            self.store(config),
            self.lease_store(config),
            RetryPolicy(config, budget=self.retry_budget(config)),
            self.renewer(config),
            self,
        )

    def event_sender(self, app: Any, hostname: str) -> EventSender:
        """The Celery event sender of ``app`` as worker ``hostname``."""

        def make() -> EventSender:
            from .events import EventSender

            return EventSender(app, hostname)

        return self._get(self._senders, (id(app), hostname), make)

    def stores(self) -> list[Store]:
        """The SQL stores made so far (tests and fixtures dispose their connections)."""
        return list(self._stores.values())

    def flush_events(self, timeout: float) -> None:
        """Wait (bounded) until queued fence events were published (or dropped)."""
        end = time.monotonic() + timeout
        for sender in list(self._senders.values()):
            sender.flush(max(0.0, end - time.monotonic()))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Finish the background writes, send queued lease releases, stop the renewers and
        flush the event senders, each bounded by ``timeout`` (a worker process that exits)."""
        self.writer.drain(timeout)
        for _, renewer in list(self._leases.values()):
            renewer.flush(timeout)
            renewer.stop()
        self.flush_events(min(timeout, 1.0))

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


def _make_store(config: FenceConfig) -> Store:
    from .store import Store  # the store asks the runtime for itself: imported when first needed

    return Store(config.database_url, **{name: getattr(config, name) for name in STORE_SETTINGS})


def _make_client(config: FenceConfig) -> Any:
    from .redis_client import make_client

    return make_client(config)


class BackgroundWriter:
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
                extra={"action": "write_dropped", "reason": "queue full"},
            )
            return False
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name=WRITER_THREAD_NAME, daemon=True
                )
                self._thread.start()
        return True

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


_STATE_ATTRIBUTE = "_fence_state"


def app_state(app: Any) -> AppState:
    """The celery-fence state of ``app`` (kept on the app: it lives and dies with it)."""
    state: AppState | None = app.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        state = app.__dict__.setdefault(_STATE_ATTRIBUTE, AppState())
    return state


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
    "Backends",
    "BackgroundWriter",
    "Runtime",
    "app_state",
    "client_identity",
    "runtime",
]
