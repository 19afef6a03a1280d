"""``self.fence``: the current attempt as the task body sees it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .outbox import StagedEffects
from .renewer import HeldLease


class Fence:
    """One execution attempt of one logical job.

    ``key`` is the stable logical key, ``attempt_id`` is new for every execution, ``generation``
    is the number this attempt's claim received. ``check()`` and ``guard()`` raise
    :class:`~celery_fence.LeaseLost` once the lease is lost; call one before each side effect.
    """

    __slots__ = ("_lease", "attempt_id", "attempts", "generation", "key", "outbox")

    def __init__(
        self, *, key: str, attempt_id: str, generation: int, attempts: int, lease: HeldLease
    ) -> None:
        self.key = key
        self.attempt_id = attempt_id
        self.generation = generation
        self.attempts = attempts
        self.outbox = StagedEffects(key)
        self._lease = lease

    def check(self) -> None:
        """Raise ``LeaseLost`` if this attempt no longer holds its lease (decided locally)."""
        self._lease.check()

    @contextmanager
    def guard(self) -> Iterator[Fence]:
        """``with self.fence.guard(): publish(...)`` — checks the lease before the effect starts."""
        self._lease.check()
        yield self

    @property
    def remaining(self) -> float:
        """Seconds until the local lease deadline (negative once passed)."""
        return self._lease.remaining()

    @property
    def lost(self) -> bool:
        return self._lease.lost

    def __repr__(self) -> str:
        return f"<Fence key={self.key!r} generation={self.generation} attempt={self.attempt_id}>"
