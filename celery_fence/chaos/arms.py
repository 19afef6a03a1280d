"""The control arms: demonstrations with one safety mechanism taken out, so the chaos harness can
show that each safety column fires without it. Never for production; nothing outside
:mod:`celery_fence.chaos` (and the tests that prove the checks can fail) uses them.

- :class:`UnfencedTask` (``--unfenced``): its store has no generation fence. Its writes match the
  key alone (last writer wins), a registration takes any live job, and a fenced block is what it
  replaces: ``guard()`` on entry, then a plain transaction.
- :class:`UnsettledTask` (``--unsettled``): Celery's own exits are left as plain Celery leaves
  them. A hard time limit, an expired or revoked message are acked without a store state; an
  exit that is not an ``Exception`` escapes with its lease still held and renewed; invalid
  settings fail the message instead of re-sending it (and the worker starts with them); a request
  the database refuses is re-sent in a loop; the fence's re-send keeps ``expires``.
- :class:`UnfencedStepsTask` (``--unfenced-steps``): ``fence.run_step()`` just calls the function
  (no boundary check, nothing stored, nothing skipped) and ``fence.checkpoint()`` stores nothing:
  the same body as plain code. A later attempt runs every step again, and a superseded attempt
  runs its next steps until something else stops it.
- :class:`UnwatchedTask` (``--unwatched``): nobody watches the body's writes on connections that
  are not a fenced block's (:mod:`celery_fence.body.sqla`'s listeners are never added in the
  worker): a write beside an open block commits unchecked, whatever its text, and a write
  outside every block is not flagged. The store's fence and the blocks' own commits stay on.
- :class:`TTLLockTask` (``--ttl-lock``): no uniqueness key in the store; celery-once's Redis
  lock instead (``SET NX EX`` before the send, deleted when the body returns). A send that finds
  the lock taken is discarded (``apply_async`` returns None); a holder killed mid-run strands the
  lock for its whole timeout.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from celery.worker.request import Request
from sqlalchemy import exc as sa_exc

from celery_fence.adapters.task import FencedTask
from celery_fence.adapters.worker import FencedRequest
from celery_fence.body import sqla
from celery_fence.body.fence import Fence
from celery_fence.body.steps import Step
from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError
from celery_fence.pipeline import outcomes as o
from celery_fence.pipeline.backends import Backends, backends
from celery_fence.pipeline.execution import Execution
from celery_fence.store import Store, queries, session_sql
from celery_fence.store.blocks import BlockOwner, Blocks


class UnfencedBlocks(Blocks):
    """Blocks without the fence (``--unfenced``): a plain transaction, every commit allowed."""

    def begin(self, conn: sa.Connection, ttl: float) -> None:
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql(session_sql.begin("sqlite", immediate=False))

    def bounds(self, ttl: float) -> str:
        return "SELECT 1"

    def owner(self, conn: sa.Connection, owner: BlockOwner) -> bool:
        return True

    def owner_cursor(self, cursor: Any, owner: BlockOwner) -> bool:
        return True


def loosened(
    statements: queries.Statements, names: tuple[str, ...], old: str, new: str
) -> queries.Statements:
    """``statements`` with ``old`` replaced by ``new`` in each of ``names`` (every dialect's
    text). A text without ``old`` is kept as it is (a mutation check's broken copy of
    queries.sql must still import): tests/unit/test_queries.py checks that every arm's
    statement differs from the product's."""
    texts = {
        (name, dialect): text.replace(old, new)
        for (name, dialect), text in statements.texts.items()
        if name in names
    }
    return statements.replaced(texts)


#: The endings of a running attempt, fenced on the owner in the product (queries.sql).
OWNER_ENDINGS = (
    "complete",
    "retry",
    "retry_with_error",
    "dead",
    "dead_with_error",
    "dead_counted",
    "dead_counted_with_error",
    "caller_failed",
    "caller_failed_with_error",
)
#: The ``--unfenced`` arm's statements: the endings match the key alone (last writer wins), a
#: completion stamps the row with its own generation and attempt (so the history shows whose
#: write it was), a registration takes any live job (no generation term).
UNFENCED_STATEMENTS = loosened(
    loosened(
        loosened(queries.STATEMENTS, OWNER_ENDINGS, queries.OWNED, "key = :key"),
        ("complete",),
        "error_message = NULL\n",
        "error_message = NULL, generation = :generation, attempt_id = :attempt_id\n",
    ),
    ("register",),
    queries.NEWER_LIVE,
    "fence_jobs.status NOT IN ('completed', 'dead')",
)


class UnfencedStore(Store):
    """A store without the generation fence (the ``--unfenced`` control arm): its statements are
    :data:`UNFENCED_STATEMENTS`, its blocks :class:`UnfencedBlocks`."""

    statements = UNFENCED_STATEMENTS
    _blocks_class = UnfencedBlocks


class UnfencedTask(FencedTask, fence_base=True):
    """A fenced task whose store has no fence (``--unfenced``)."""

    def _make_backends(self, config: FenceConfig) -> Backends:
        return backends(config, store_class=UnfencedStore)


#: The ``--async-endings`` arm's statements: an ending's commit condition is the registration's
#: (PostgreSQL: no wait for its WAL flush); on SQLite it is not synced to disk at its commit.
ASYNC_ENDINGS_STATEMENTS = queries.STATEMENTS.replaced(
    {
        ("durable_commit", "postgresql"): queries.STATEMENTS.template("async_commit", "postgresql"),
        ("sync_ending", "sqlite"): queries.STATEMENTS.template("sync_default", "sqlite"),
    }
)


class AsyncEndingsStore(Store):
    """A store whose endings of a job (completion, retry, dead) commit without waiting for their
    WAL flush, as the registration does (the ``--async-endings`` control arm): the message is
    acked after a completion a database crash can still lose."""

    statements = ASYNC_ENDINGS_STATEMENTS


class AsyncEndingsTask(FencedTask, fence_base=True):
    """A fenced task whose store commits its endings asynchronously (``--async-endings``)."""

    def _make_backends(self, config: FenceConfig) -> Backends:
        return backends(config, store_class=AsyncEndingsStore)


class UnsettledRequest(FencedRequest):
    """Celery's own request: the exits Celery drives are not settled (``--unsettled``)."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        Request.on_timeout(self, soft, timeout)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        Request.on_failure(self, exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> None:
        Request._announce_revoked(self, reason, terminated, signum, expired)


class UnsettledExecution(Execution):
    """An execution whose non-``Exception`` exits escape with the lease held (``--unsettled``),
    and whose refused request is re-sent in a loop instead of recorded dead."""

    def _execute(self, *args: Any, **kwargs: Any) -> o.Outcome:
        try:
            return super()._execute(*args, **kwargs)
        except Exception:
            raise
        except BaseException:
            self.claim = replace(self.claim, lease=None)  # never discarded: the renewer keeps it
            raise

    def refused_registration(self, error: sa_exc.DataError, request: str | None) -> o.Outcome:
        return o.Unavailable(error, "store refused registration")


class UnwatchedExecution(Execution):
    """An execution in a process where the write watcher's listeners are never added
    (``--unwatched``)."""

    def _execute(self, *args: Any, **kwargs: Any) -> o.Outcome:
        sqla._installed = True  # install() adds nothing in this (control-arm) worker
        return super()._execute(*args, **kwargs)


class UnwatchedTask(FencedTask, fence_base=True):
    """A fenced task whose body's other connections nobody watches (``--unwatched``)."""

    _execution_class = UnwatchedExecution


class PlainStep(Step):
    """A step that is a plain call: no block, no boundary read, nothing stored (its value is
    returned as a stored one would be)."""

    __slots__ = ()

    def __enter__(self) -> PlainStep:
        self._stack = contextlib.ExitStack()
        return self

    def _store(self, text: str) -> None:
        return None


class PlainStepsFence(Fence):
    """A fence whose steps and checkpoints are plain code (``--unfenced-steps``)."""

    __slots__ = ()

    def step(self, name: str) -> PlainStep:
        return PlainStep(self, name)

    def run_step(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with PlainStep(self, name) as step:
            step.result = fn(*args, **kwargs)
        return step.value

    def checkpoint(self, details: Any) -> None:
        return None

    @property
    def progress(self) -> Any:
        return None


class UnfencedStepsExecution(Execution):
    """An execution whose fence runs steps as plain calls (``--unfenced-steps``)."""

    fence_class = PlainStepsFence


class UnfencedStepsTask(FencedTask, fence_base=True):
    """A fenced task whose steps are not fenced (``--unfenced-steps``)."""

    _execution_class = UnfencedStepsExecution


class UnsettledTask(FencedTask, fence_base=True):
    """A fenced task whose Celery exits are left unsettled (``--unsettled``)."""

    Request = f"{__name__}:UnsettledRequest"
    _execution_class = UnsettledExecution
    settings_checked_at_start = False

    def _invalid_settings(self, error: ConfigurationError) -> o.Disposition:
        raise error  # acked as a failure: the job is lost

    def _resend_options(self) -> dict[str, Any]:
        return {}  # the re-send keeps expires: it may expire unsettled


class TTLLockTask(FencedTask, fence_base=True):
    """celery-once's ``QueueOnce`` on a fenced task (``--ttl-lock``): before each send a Redis
    lock ``<lock_prefix>:<task>:<first argument>`` is taken with ``SET NX EX lock_timeout``; a
    send that finds it taken is discarded (None, celery-once's ``graceful``); the body's return
    (``after_return``) deletes it. Subclasses set ``lock_redis``, ``lock_prefix`` and
    ``lock_timeout`` (seconds)."""

    lock_redis: Any = None
    lock_prefix = "qo"
    lock_timeout = 3600

    def lock_key(self, args: Any) -> str:
        return f"{self.lock_prefix}:{self.name}:{(args or ['-'])[0]}"

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        if not self._fence_send(task_id, options) and not self.lock_redis.set(
            self.lock_key(args), 1, nx=True, ex=self.lock_timeout
        ):  # a new send (not the fence's own re-send) meets the lock: discarded
            return None
        return super().apply_async(args, kwargs, task_id, **options)

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        task_args = args[3] if len(args) > 3 else kwargs.get("args")
        self.lock_redis.delete(self.lock_key(task_args))


__all__ = [
    "ASYNC_ENDINGS_STATEMENTS",
    "UNFENCED_STATEMENTS",
    "AsyncEndingsStore",
    "AsyncEndingsTask",
    "PlainStepsFence",
    "TTLLockTask",
    "UnfencedStepsExecution",
    "UnfencedStepsTask",
    "UnfencedStore",
    "UnfencedTask",
    "UnsettledExecution",
    "UnsettledRequest",
    "UnsettledTask",
    "UnwatchedExecution",
    "UnwatchedTask",
]
