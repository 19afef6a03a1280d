"""The fenced blocks of one attempt (``fence.blocks``): which are open, on which thread, the
refusal of a fenced commit, and a lease loss seen while one was open. The blocks themselves are
:mod:`celery_fence.body.transaction`'s (``transaction()``, ``session()``) and
:mod:`celery_fence.contrib.django.atomic`'s (``atomic()``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import sqlalchemy as sa

from celery_fence.errors import FenceError, LeaseLost

if TYPE_CHECKING:
    from celery_fence.body.fence import Fence
    from celery_fence.leases.lease import HeldLease


@dataclass
class Block:
    """The outermost open block of one attempt on one thread: its engine, its connection, and
    the refusal of its commit (kept so a refusal swallowed inside the block still ends it)."""

    engine: sa.Engine
    conn: sa.Connection
    thread: int = field(default_factory=threading.get_ident)
    #: When its last statement ended, and how long it had been idle when the latest began (a
    #: PostgreSQL block idle past the lease TTL is ended by the server).
    active_at: float = field(default_factory=time.monotonic)
    idle: float = 0.0
    refused: FenceError | None = None


class AtomicAliases:
    """The Django aliases with an open outermost ``fence.atomic()`` block, per thread: Django's
    connections are per thread, so each thread's block is on a connection of its own and is
    fenced on its own (:mod:`celery_fence.contrib.django.atomic`). True while any thread has one
    open."""

    def __init__(self) -> None:
        self._by_thread: dict[int, set[str]] = {}
        self._lock = threading.Lock()

    def here(self) -> frozenset[str]:
        """This thread's aliases with an open fenced ``atomic()`` block."""
        with self._lock:
            return frozenset(self._by_thread.get(threading.get_ident(), ()))

    def add(self, alias: str) -> None:
        with self._lock:
            self._by_thread.setdefault(threading.get_ident(), set()).add(alias)

    def discard(self, alias: str) -> None:
        with self._lock:
            mine = self._by_thread.get(threading.get_ident())
            if mine is not None:
                mine.discard(alias)
                if not mine:
                    del self._by_thread[threading.get_ident()]

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._by_thread)


class OpenBlocks:
    """The fenced blocks of one attempt: its open outermost ``transaction()``/``session()``
    blocks (one per thread at most), the Django aliases with an open ``atomic()`` block (per
    thread), the
    refusal of a fenced commit (every later block is refused too), and a lease loss seen while a
    block was open, whose record waits for the last one to close."""

    def __init__(self) -> None:
        self._open: dict[int, Block] = {}
        self._lock = threading.Lock()
        self._loss_seen = False
        #: Django aliases with an open ``fence.atomic()`` block, per thread.
        self.atomic = AtomicAliases()
        #: A fenced commit found a newer generation: no later block of this attempt commits.
        self.refused: FenceError | None = None

    @property
    def any_open(self) -> bool:
        """Whether a ``transaction()``/``session()`` or an ``atomic()`` block is open now."""
        return bool(self._open) or bool(self.atomic)

    def raise_refused(self) -> None:
        """Raise (a fresh copy of) the refusal of an earlier fenced commit, if any."""
        if self.refused is not None:
            raise again(self.refused)

    def current(self) -> Block | None:
        """This thread's open block."""
        return self._open.get(threading.get_ident())

    def add(self, block: Block) -> None:
        with self._lock:
            self._open[block.thread] = block

    def defer_loss(self, lease: HeldLease) -> bool:
        """True when the lease is lost while a block is open: the caller raises
        :func:`unrecorded_loss`, and :meth:`remove` records the loss."""
        with self._lock:
            if self._open and lease.lost:
                self._loss_seen = True
                return True
            return bool(self.atomic) and lease.lost

    def remove(self, block: Block, lease: HeldLease) -> None:
        """``block`` closed (its connection holds no lock any more): the last one to close
        records a loss seen meanwhile — once, whatever the threads did."""
        with self._lock:
            self._open.pop(block.thread, None)
            if self._open:
                return
            seen, self._loss_seen = self._loss_seen, False
        try:
            lease.check()  # records a loss (HeldLease.mark_lost: once)
        except LeaseLost:
            return
        if seen:  # raised inside the block, then a late renewal moved the deadline on:
            # what was raised stands.
            lease.mark_lost("deadline passed without a confirmed renewal")


def unrecorded_loss(fence: Fence) -> LeaseLost:
    """The ``LeaseLost`` of a check while a block is open, whose loss is recorded (and
    signalled) once the blocks have closed: :meth:`OpenBlocks.remove`."""
    return LeaseLost(
        f"lease lost for key {fence.key!r} at generation {fence.generation}: "
        f"{fence.lease.lost_reason or 'deadline passed without a confirmed renewal'}",
        key=fence.key,
        generation=fence.generation,
    )


def again(refused: FenceError) -> FenceError:
    """A fresh exception with the refusal's message and context (a raised exception object
    carries its traceback; do not raise the same one twice)."""
    return type(refused)(str(refused), **refused.context)


__all__ = ["AtomicAliases", "Block", "OpenBlocks", "again", "unrecorded_loss"]
