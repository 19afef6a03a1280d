"""``self.fence``: the current attempt as the task body sees it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from .effects import StagedEffects
from .lease import HeldLease
from .orm import session as _session
from .transaction import OpenBlocks, unrecorded_loss
from .transaction import transaction as _transaction

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from .errors import FenceError
    from .store import Store


class Fence:
    """One execution attempt of one logical job.

    ``key`` is the stable logical key, ``attempt_id`` is new for every execution, ``generation``
    is the number this attempt's claim received. ``check()`` and ``guard()`` raise
    :class:`~celery_fence.LeaseLost` once the lease is lost: a check on entry, not a fence.
    Writes to the app's own tables go through ``transaction()`` or ``session()``, whose commit is
    fenced; effects on other systems through ``outbox``.
    """

    __slots__ = (
        "_atomic",
        "_before_block",
        "_blocks",
        "_lease",
        "_refused",
        "_store",
        "attempt_id",
        "attempts",
        "generation",
        "key",
        "outbox",
    )

    def __init__(
        self,
        *,
        key: str,
        attempt_id: str,
        generation: int,
        attempts: int,
        lease: HeldLease,
        store: Store | None = None,
        before_block: Callable[[], None] | None = None,
    ) -> None:
        self.key = key
        self.attempt_id = attempt_id
        self.generation = generation
        self.attempts = attempts
        self.outbox = StagedEffects(key)
        self._lease = lease
        self._store = store
        #: Run before a fenced block opens: registers a deferred first claim (it has no row yet,
        #: and the block's ownership check is a statement on that row).
        self._before_block = before_block
        self._blocks = OpenBlocks()  # the open fence.transaction()/session() blocks
        self._atomic: set[str] = set()  # Django aliases with an open fence.atomic() block
        self._refused: FenceError | None = None  # a fenced commit found a newer generation

    def check(self) -> None:
        """Raise ``LeaseLost`` if this attempt no longer holds its lease (decided locally)."""
        if self._blocks.defer_loss(self._lease) or (self._atomic and self._lease.lost):
            # While a fence block is open the loss is recorded once it has closed: on SQLite the
            # block holds the database's write lock, which the record would wait for.
            raise unrecorded_loss(self)
        self._lease.check()

    @contextmanager
    def guard(self) -> Iterator[Fence]:
        """``with self.fence.guard(): publish(...)`` — checks the lease before the effect starts.

        A check on entry, not a fence: for the app's own tables use ``transaction()``."""
        self.check()
        yield self

    def transaction(self, bind: sa.Engine | None = None) -> AbstractContextManager[sa.Connection]:
        """``with self.fence.transaction() as conn:`` — a SQLAlchemy ``Connection`` in a
        transaction on the store's database (or on ``bind``, your own ``Engine`` on that same
        database) that commits only if this attempt still owns its key at commit time.

        Otherwise nothing of the block commits and :class:`~celery_fence.StaleGeneration` is
        raised out of it (the attempt then settles as stale). The lease is checked on entry and
        again just before the commit. Nested blocks are savepoints of the outermost one, which
        commits. See :mod:`celery_fence.transaction`.
        """
        return _transaction(self, bind)

    def session(
        self, factory: Callable[..., Session], bind: sa.Engine | None = None
    ) -> AbstractContextManager[Session]:
        """``with self.fence.session(SessionFactory) as session:`` — an ORM ``Session`` on a
        fenced connection: every ``session.commit()`` is fenced like ``transaction()``'s, and the
        block commits what is left at its end. ``bind`` defaults to the factory's own engine."""
        return _session(self, factory, bind)

    def atomic(self, using: str | None = None) -> AbstractContextManager[None]:
        """``with self.fence.atomic():`` — Django's ``transaction.atomic(using=using)`` whose
        commit is fenced: just before it, on the same connection and in the same transaction,
        the ownership check ``transaction()`` makes runs; stale, everything inside rolls back and
        :class:`~celery_fence.StaleGeneration` is raised. Needs the store in that alias's
        database (``CELERY_FENCE_DATABASE``). See :mod:`celery_fence.contrib.django.atomic`."""
        from .contrib.django.atomic import atomic  # Django is optional: imported when used

        return atomic(self, using)

    @property
    def remaining(self) -> float:
        """Seconds until the local lease deadline (negative once passed)."""
        return self._lease.remaining()

    @property
    def lost(self) -> bool:
        return self._lease.lost

    def __repr__(self) -> str:
        return f"<Fence key={self.key!r} generation={self.generation} attempt={self.attempt_id}>"
