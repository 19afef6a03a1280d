"""``self.fence``: the current attempt as the task body sees it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from celery_fence import django_port
from celery_fence.body import steps as _steps
from celery_fence.body.blocks import OpenBlocks, unrecorded_loss
from celery_fence.body.effects import StagedEffects
from celery_fence.body.orm import session as _session
from celery_fence.body.transaction import transaction as _transaction
from celery_fence.leases.lease import HeldLease

if TYPE_CHECKING:
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from celery_fence.config import FenceConfig
    from celery_fence.store import Store


class Attempt(Protocol):
    """What the body's blocks, steps and write watch ask of the attempt a :class:`Fence` belongs
    to (:class:`celery_fence.pipeline.execution.Execution`, which makes the fence): its task and
    settings, the span around a fenced commit, the report of a write outside every block, and
    the mark that its completion clears the job's steps."""

    task_name: str
    config: FenceConfig
    steps_used: bool

    def committing(self, where: str) -> AbstractContextManager[Any]: ...

    def unfenced_write(self, *, where: str, table: str | None, refused: bool) -> None: ...


class Fence:
    """One execution attempt of one logical job.

    ``key`` is the stable logical key, ``attempt_id`` is new for every execution, ``generation``
    is the number this attempt's claim received. ``check()`` and ``guard()`` raise
    :class:`~celery_fence.LeaseLost` once the lease is lost: a check on entry, not a fence.
    Writes to the app's own tables go through ``transaction()`` or ``session()``, whose commit is
    fenced; effects on other systems are staged on ``effects`` (also reachable as ``outbox``).
    """

    __slots__ = (
        "attempt_id",
        "attempts",
        "blocks",
        "effects",
        "execution",
        "generation",
        "key",
        "lease",
        "store",
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
        execution: Attempt | None = None,
        run: int = 0,
        idempotency_namespace: str = "",
    ) -> None:
        self.key = key
        self.attempt_id = attempt_id
        self.generation = generation
        self.attempts = attempts
        #: The effects this attempt stages: ``self.fence.effects.add("email", {...})``.
        #: ``run``: the operator's re-run this attempt belongs to (``fence requeue --completed``).
        self.effects = StagedEffects(key, run, idempotency_namespace)
        #: This attempt's lease, and the store its fenced blocks check ownership in.
        self.lease = lease
        self.store = store
        #: The attempt this fence belongs to (an ``Execution``; None: a fence made by hand, e.g.
        #: in a test).
        self.execution = execution
        #: The open fence.transaction()/session()/atomic() blocks, and a refused commit.
        self.blocks = OpenBlocks()

    def check(self) -> None:
        """Raise ``LeaseLost`` if this attempt no longer holds its lease (decided locally)."""
        if self.blocks.defer_loss(self.lease):
            # While a fence block is open the loss is recorded once it has closed: on SQLite the
            # block holds the database's write lock, which the record would wait for.
            raise unrecorded_loss(self)
        self.lease.check()

    def prepare_block(self) -> None:
        """Before a fenced block opens: a refused commit stays refused, a lost lease stops the
        work (``guard()`` semantics)."""
        self.blocks.raise_refused()
        self.check()

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
        commits. See :mod:`celery_fence.body.transaction`.
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
        return django_port.django_side("self.fence.atomic()").atomic(self, using)

    def run_step(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``value = self.fence.run_step("charge", charge, order_id)`` — run ``fn(*args,
        **kwargs)`` as the fenced step ``name``, once per job: its return value (JSON) is stored
        under (key, name) in the same fenced transaction as the step's own writes (made through
        ``self.fence.transaction()``/``session()`` inside it), and a later attempt gets it back
        without running ``fn``. A stale attempt raises :class:`~celery_fence.StaleGeneration`
        here and runs nothing more. See :mod:`celery_fence.body.steps`."""
        return _steps.run_step(self, name, fn, *args, **kwargs)

    def step(self, name: str) -> _steps.Step:
        """``with self.fence.step("charge") as step: if not step.done: ...; step.result = v``,
        or ``@self.fence.step("charge")`` on a function: see :class:`~.steps.Step`."""
        return _steps.Step(self, name)

    def checkpoint(self, details: Any) -> None:
        """``self.fence.checkpoint({"after_id": 41_000})`` — store the job's progress (JSON, at
        most ``fence_checkpoint_max_bytes``) by a fenced write: in the open fenced block if any
        (it commits with the work it describes), else on its own. Refused for a stale attempt
        (:class:`~celery_fence.StaleGeneration`); never overwrites a newer attempt's."""
        _steps.checkpoint(self, details)

    @property
    def progress(self) -> Any:
        """The job's last committed checkpoint (None before the first): where a new attempt
        starts. Read from the store on each access: read it once, at the start."""
        return _steps.progress(self)

    @property
    def remaining(self) -> float:
        """Seconds until the local lease deadline (negative once passed)."""
        return self.lease.remaining()

    @property
    def lost(self) -> bool:
        return self.lease.lost

    def __repr__(self) -> str:
        return f"<Fence key={self.key!r} generation={self.generation} attempt={self.attempt_id}>"
