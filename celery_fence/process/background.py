"""The process's background threads, one lifecycle for all four: the lease renewer, the event
sender, the background writer and the database watchdog.

- **start**: on first use (:meth:`Background.start`), a daemon thread named after its job;
- **stop**: :meth:`Background.shutdown` finishes the queued work, then stops the thread, bounded
  by its ``timeout`` (a worker process that exits:
  :meth:`~celery_fence.process.runtime.Runtime.shutdown` stops them all);
- **after a fork**: never touched in the child. Each one lives on the process's
  :class:`~celery_fence.process.runtime.Runtime`, and a forked child's runtime makes its own on
  first use.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from celery_fence.actions import LogAction

logger = logging.getLogger("celery_fence")

#: Off-thread writes waiting for the background writer; beyond this they are dropped (logged).
MAX_PENDING_WRITES = 1_000

WRITER_THREAD_NAME = "celery-fence-writer"


class Background:
    """An object with a daemon thread of its own. A base class, not a protocol: the runtime stops
    what derives from it, and a Redis client's ``shutdown()`` would stop the Redis server."""

    #: The thread's name (``ps -T``, ``py-spy dump``).
    thread_name: ClassVar[str] = "celery-fence"

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> bool:
        """Start the thread unless it runs; True when this call started it."""
        if self.running:
            return False
        with self._start_lock:
            if self.running:
                return False
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()
            return True

    def join(self, timeout: float) -> bool:
        """Wait (bounded) for the thread to end; True when it is not running."""
        thread = self._thread
        if thread is None:
            return True
        if thread is threading.current_thread():  # it cannot wait for itself
            return False
        thread.join(max(0.0, timeout))
        return not thread.is_alive()

    def shutdown(self, timeout: float) -> None:
        """Finish the queued work and stop the thread, within ``timeout`` seconds."""
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError


class BackgroundWriter(Background):
    """One daemon thread running writes that must not happen on the caller's thread (the renewal
    thread records a lost lease here, so a slow database never delays other leases' renewals).

    :meth:`submit` never blocks: past :data:`MAX_PENDING_WRITES` a write is dropped and logged.
    """

    thread_name = WRITER_THREAD_NAME

    def __init__(self, maxsize: int = MAX_PENDING_WRITES) -> None:
        super().__init__()
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None]
        self._queue = queue.Queue(maxsize)
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
        self.start()
        return True

    def shutdown(self, timeout: float) -> None:
        self.drain(timeout)

    def drain(self, timeout: float) -> bool:
        """Run the queued writes and stop the thread (bounded); True when it finished."""
        if not self.running:
            return True
        end = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        return self.join(end - time.monotonic())

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


__all__ = ["MAX_PENDING_WRITES", "WRITER_THREAD_NAME", "Background", "BackgroundWriter"]
