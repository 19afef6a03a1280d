"""Fenced steps and checkpoints: ``self.fence.run_step()``, ``self.fence.step()``,
``self.fence.checkpoint()`` and ``self.fence.progress``.

**A step** is a fenced block (:func:`celery_fence.body.transaction.transaction`) plus one fenced
row write in the same transaction. At its start (the *step boundary*) the block reads, on its own
connection, whether this attempt still owns the running job and whether the step already
completed on an earlier attempt:

- another attempt owns the job: :class:`~celery_fence.StaleGeneration`, nothing of the step runs,
  and every later block and step of the attempt is refused too (a lease lost locally raises
  ``LeaseLost`` before the read, or ``StaleGeneration`` when the store says a newer attempt
  took the key over);
- the step completed before: its stored value is returned (``run_step``) or offered as
  ``step.done`` / ``step.value`` (the ``with`` form), and nothing runs;
- otherwise the step runs inside the block: its writes through ``self.fence.transaction()`` /
  ``session()`` / the step's ``conn`` join the block's transaction, and at its end its return
  value is stored under (key, step name) by an ``INSERT ... SELECT ... WHERE`` the job row is
  still owned by this attempt; the block's commit is then fenced as any other. The step's writes
  and its row commit together or not at all.

The value is JSON (as a task's result); it is returned as stored (a tuple comes back a list),
on the first run as on a replay.

**A checkpoint** is one fenced upsert of the job's progress (a reserved step row), in the open
block if there is one (so it commits with the work it describes), else in a block of its own.
A stale attempt's checkpoint is refused (``StaleGeneration``), never written over a newer
attempt's. Its JSON is bounded by ``fence_checkpoint_max_bytes``.

Steps and the checkpoint are deleted by the completion of an attempt that used them (in the
completion's statement), by a re-run from scratch (``celery fence requeue --completed``) and by
purge; ``celery fence show KEY`` lists them (names,
generation, when, sizes; values only with ``--values``). Values are never logged.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from celery_fence.errors import CheckpointTooLarge, FenceError, LeaseLost, StaleGeneration
from celery_fence.schema import CHECKPOINT, STEP_NAME_LENGTH
from celery_fence.settings import DEFAULT_CHECKPOINT_MAX_BYTES
from celery_fence.store.records import dumps_strict

if TYPE_CHECKING:
    import sqlalchemy as sa

    from celery_fence.body.fence import Fence
    from celery_fence.store import Store

T = TypeVar("T")


def checked_name(name: object) -> str:
    """A step name, or a clear error."""
    if not isinstance(name, str) or not name or len(name) > STEP_NAME_LENGTH:
        raise FenceError(
            f"fence.step({name!r}): a step name is a non-empty string of at most "
            f"{STEP_NAME_LENGTH} characters, unique within the task, e.g. 'charge'"
        )
    if name.startswith("@"):
        raise FenceError(
            f"fence.step({name!r}): names starting with '@' are reserved (the checkpoint is "
            "'@checkpoint'); name the step without it"
        )
    return name


class Step:
    """One fenced step: ``with self.fence.step("charge") as step:``.

    A ``with`` body cannot be skipped by Python, so the body says itself whether to run::

        with self.fence.step("charge") as step:
            if not step.done:
                step.conn.execute(...)          # the step's transaction
                step.result = {"charge_id": charge(...)}
        charge_id = step.value["charge_id"]

    ``step.done`` is True when the step completed on an earlier attempt (``step.value`` is its
    stored value, and nothing is written). Otherwise ``step.result`` (None if not set) is stored
    when the block ends without an exception, and ``step.value`` is it, as stored. An exception
    rolls the step back: it runs again on the next attempt. Prefer :meth:`Fence.run_step`, which
    cannot forget the ``if``.

    Used as a decorator (``@self.fence.step("charge")``), the function runs as a step each time
    it is called (:meth:`Fence.run_step`).
    """

    __slots__ = ("_stack", "conn", "done", "fence", "name", "result", "value")

    def __init__(self, fence: Fence, name: str) -> None:
        self.fence = fence
        self.name = checked_name(name)
        #: The step's block connection (None until entered): its transaction holds the step row.
        self.conn: sa.Connection | None = None
        self.done = False
        self.value: Any = None
        #: What to store as the step's value (set inside the ``with`` body).
        self.result: Any = None
        self._stack: contextlib.ExitStack | None = None

    def __call__(self, fn: Callable[..., T]) -> Callable[..., Any]:
        fence, name = self.fence, self.name

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            return fence.run_step(name, fn, *args, **kwargs)

        return run

    def __enter__(self) -> Step:
        if self._stack is not None:
            raise FenceError(f"fence.step({self.name!r}) is entered once; make a new one")
        fence = self.fence
        store = _store(fence)
        used(fence)
        self._stack = stack = contextlib.ExitStack()
        try:
            conn = stack.enter_context(fence.transaction())
        except LeaseLost as lost:
            newer = _taken_over(fence, store, f"step {self.name!r}")
            if newer is not None:
                raise newer from lost
            raise
        try:
            seen = store.steps.boundary(
                conn,
                fence.key,
                self.name,
                generation=fence.generation,
                attempt_id=fence.attempt_id,
            )
            if not seen.owner:
                raise refuse(fence, store, f"step {self.name!r}")
        except BaseException:
            stack.__exit__(*sys.exc_info())  # rolls the block back (and re-raises its error)
            raise
        self.conn = conn
        self.done = seen.done
        if seen.done:
            self.value = seen.value
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        stack = self._stack
        assert stack is not None
        if exc_type is None and not self.done:
            try:
                text = dumps_strict(self.result, f"value of step {self.name!r}")
                self._store(text)
                self.value = json.loads(text)
            except BaseException:
                stack.__exit__(*sys.exc_info())  # rolls the step back
                raise
        return bool(stack.__exit__(exc_type, exc, tb))

    def _store(self, text: str) -> None:
        """The step's row, fenced, in the step's transaction (``text``: its JSON value)."""
        fence = self.fence
        store = _store(fence)
        assert self.conn is not None
        written = store.steps.write_done(
            self.conn,
            fence.key,
            self.name,
            text,
            generation=fence.generation,
            attempt_id=fence.attempt_id,
        )
        if not written:
            raise refuse(fence, store, f"step {self.name!r}")


def run_step(fence: Fence, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """:meth:`Fence.run_step`."""
    with Step(fence, name) as step:
        if not step.done:
            step.result = fn(*args, **kwargs)
    return step.value


def checkpoint(fence: Fence, details: Any) -> None:
    """:meth:`Fence.checkpoint`."""
    text = dumps_strict(details, "checkpoint")
    size = len(text.encode())
    limit = max_bytes(fence)
    if size > limit:
        raise CheckpointTooLarge(
            f"fence.checkpoint() for {fence.key!r}: {size} bytes of JSON, more than "
            f"fence_checkpoint_max_bytes={limit}. Store a position (an id, an offset, a page "
            "token), not the data, or raise fence_checkpoint_max_bytes.",
            key=fence.key,
            size=size,
            limit=limit,
        )
    store = _store(fence)
    used(fence)
    with fence.transaction() as conn:
        written = store.steps.write_checkpoint(
            conn, fence.key, text, generation=fence.generation, attempt_id=fence.attempt_id
        )
        if not written:
            raise refuse(fence, store, "checkpoint")


def progress(fence: Fence) -> Any:
    """:attr:`Fence.progress`."""
    store = _store(fence)
    block = fence.blocks.current()
    return store.steps.value(fence.key, CHECKPOINT, None if block is None else block.conn)


def used(fence: Fence) -> None:
    """The attempt wrote (or may write) steps: its completion clears the job's."""
    if fence.execution is not None:
        fence.execution.steps_used = True


def max_bytes(fence: Fence) -> int:
    if fence.execution is None:
        return DEFAULT_CHECKPOINT_MAX_BYTES
    return int(fence.execution.config.checkpoint_max_bytes)


def refuse(fence: Fence, store: Store, what: str) -> StaleGeneration:
    """The refusal of a step's or a checkpoint's fenced write: kept on the attempt (every later
    block and step is refused too) and on the open block (its commit never happens)."""
    refused = store._rejected(fence.key, fence.generation, fence.attempt_id, what)
    fence.blocks.refused = refused
    block = fence.blocks.current()
    if block is not None:
        block.refused = refused
    return refused


def _taken_over(fence: Fence, store: Store, what: str) -> StaleGeneration | None:
    """After a lease loss at a step boundary: ``StaleGeneration`` when the store says another
    attempt owns the job now (one read), else None (the loss stands)."""
    try:
        record = store.get(fence.key)
    except Exception:
        return None
    if record is None or (record.generation, record.attempt_id) == (
        fence.generation,
        fence.attempt_id,
    ):
        return None
    if record.generation <= fence.generation:
        return None
    return refuse(fence, store, what)


def _store(fence: Fence) -> Store:
    if fence.store is None:
        raise FenceError(
            f"fence steps and checkpoints for {fence.key!r} need the store: they are only "
            "available inside a fenced task's body (self.fence, with "
            "@app.task(base=FencedTask, bind=True))"
        )
    return fence.store
