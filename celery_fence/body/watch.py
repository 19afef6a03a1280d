"""Which fenced attempt a write belongs to, and what a write no fenced block covers gets.

The fence sees the app's writes by what the database says, on every connection (for SQLAlchemy:
:mod:`celery_fence.body.sqla`; for Django's ORM: :mod:`celery_fence.contrib.django`). Both ask
this module two things:

- **Whose write is it?** :func:`current_attempt`: the fenced attempt the calling code runs for —
  the context variable the attempt sets around its body (``asyncio.to_thread`` and every task
  of the body's event loop copy it), else this thread's attempt (a thread-local the body's thread
  carries), else, for a thread no attempt and no worker claimed (a ``threading.Thread`` or a
  ``ThreadPoolExecutor`` the body started), the process's only running fenced attempt. With
  several fenced attempts running at once (the threads pool) such a thread's write is
  ambiguous: :func:`attribution` says so, and the callers refuse it while any of them has a block
  open (:func:`ambiguous_error`) and let it pass otherwise. Threads that run Celery tasks, and
  the fence's own threads, are never attributed by that fallback (:func:`detach_thread`).
- **What does it get?** Beside an open block: :func:`beside_block_error` (the caller rolls the
  write back and raises it). Outside every block: :func:`unfenced_write` applies
  ``fence_unfenced_writes``.

Never the app's write, never refused nor flagged: what runs inside :func:`bookkeeping` (Celery's
own ``update_state``/``store_result`` with the database result backend, kombu's SQLAlchemy
transport publishing a message, the fence's own writes) and the store's own connections.

The checks cost nothing while no fenced body runs: :data:`WATCH` ``.idle`` is one attribute.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from celery_fence.errors import ConfigurationError

if TYPE_CHECKING:
    from celery_fence.body.fence import Fence

logger = logging.getLogger("celery_fence")

#: What ``fence_unfenced_writes`` defaults to for a fence made by hand (no execution).
DEFAULT_MODE = "warn"


class _Watch:
    """The process's running fenced bodies. ``idle``: none runs (the listeners' first test)."""

    __slots__ = ("held", "idle", "lock", "running")

    def __init__(self) -> None:
        self.idle = True
        self.lock = threading.Lock()
        #: The fences whose body runs now, in the order they started.
        self.running: list[Fence] = []
        #: Checks under way that must finish even if every body ends meanwhile (a transaction
        #: of the fence's own around an autocommit statement): ``idle`` stays False.
        self.held = 0

    def update(self) -> None:
        self.idle = not self.running and not self.held


WATCH: Final = _Watch()


class _Ambiguous:
    """Several fenced attempts run and nothing says which one the calling thread works for."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "AMBIGUOUS"


AMBIGUOUS: Final = _Ambiguous()


class _NotAttempt:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_AN_ATTEMPT"


#: This thread runs no fenced attempt now (a worker thread between tasks, a fence thread).
_NOT_ATTEMPT: Final = _NotAttempt()

_attempt: contextvars.ContextVar[Fence | None] = contextvars.ContextVar(
    "celery_fence_attempt", default=None
)
_bookkeeping: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "celery_fence_bookkeeping", default=False
)
_thread = threading.local()  # .attempt: Fence | _NOT_ATTEMPT (absent: a thread nobody claimed)


@contextlib.contextmanager
def running(fence: Fence) -> Iterator[Fence]:
    """The body of ``fence``'s attempt runs inside: its writes are attributed to it."""
    token = _attempt.set(fence)
    outer = getattr(_thread, "attempt", None)
    _thread.attempt = fence
    with WATCH.lock:
        WATCH.running.append(fence)
        WATCH.update()
    try:
        yield fence
    finally:
        with WATCH.lock:
            with contextlib.suppress(ValueError):
                WATCH.running.remove(fence)
            WATCH.update()
        # The thread ran an attempt: after it, never attributed by the fallback.
        _thread.attempt = _NOT_ATTEMPT if outer is None else outer
        _attempt.reset(token)


def hold() -> None:
    """A check is under way that must run to its end: the listeners stay awake until
    :func:`release`."""
    with WATCH.lock:
        WATCH.held += 1
        WATCH.update()


def release() -> None:
    with WATCH.lock:
        WATCH.held = max(0, WATCH.held - 1)
        WATCH.update()


def detach_thread() -> None:
    """This thread is no fenced attempt's unless one runs on it (a Celery worker thread, one of
    the fence's own threads): a write here is never attributed to the process's running
    attempt by the fallback."""
    if getattr(_thread, "attempt", None) is None:
        _thread.attempt = _NOT_ATTEMPT


def attribution() -> Fence | _Ambiguous | None:
    """The fenced attempt the calling code writes for, :data:`AMBIGUOUS`, or None (no attempt:
    nothing to check). See the module docstring."""
    if WATCH.idle or _bookkeeping.get():
        return None
    fence = _attempt.get()
    if fence is not None:
        return fence if fence in WATCH.running else None
    mine = getattr(_thread, "attempt", None)
    if mine is not None:
        return None if mine is _NOT_ATTEMPT or mine not in WATCH.running else mine
    running = WATCH.running
    if len(running) == 1:
        return running[0]
    return AMBIGUOUS if running else None


def current_attempt() -> Fence | None:
    """The fenced attempt the calling code runs for (None: none, or several and nothing says
    which): the context variable, the thread's attempt, the process's only running attempt."""
    found = attribution()
    return found if not isinstance(found, _Ambiguous) else None


def is_running(fence: Fence) -> bool:
    """Whether ``fence``'s body runs (inside :func:`running`)."""
    return fence in WATCH.running


def block_open_anywhere() -> bool:
    """Whether any running attempt has a fenced block open now."""
    return any(fence.blocks.any_open for fence in list(WATCH.running))


@contextlib.contextmanager
def bookkeeping() -> Iterator[None]:
    """Writes inside are not the task's (Celery's own bookkeeping: the result backend's
    ``update_state``/``store_result``, a message published through kombu's SQLAlchemy
    transport; the fence's own): never refused, never flagged. Also for a thread of your own
    that writes for no task (a metrics flusher): enter it there."""
    token = _bookkeeping.set(True)
    try:
        yield
    finally:
        _bookkeeping.reset(token)


def in_bookkeeping() -> bool:
    """Whether the calling code runs inside :func:`bookkeeping`."""
    return _bookkeeping.get()


# -- what a write gets ----------------------------------------------------------------------------

_FIX_BLOCK = (
    "Write through the block: `with self.fence.transaction() as conn: conn.execute(...)`, or "
    "`with self.fence.session(YourSession) as session:` for the ORM (a Flask-SQLAlchemy app: "
    "self.fence.session(db.session)); with Django, `with self.fence.atomic():`"
)


def beside_block_error(where: str) -> ConfigurationError:
    """The refusal of a transaction that wrote on ``where`` (a connection the open fenced block
    does not cover) while a block of the attempt is open: the caller has rolled it back. The fix
    comes first: the store keeps the first 500 characters of a dead job's error."""
    return ConfigurationError(
        "a write on a connection that is not the fenced block's, while a fenced block is open "
        "(rolled back): the block's fenced commit covers its own connection only, so the write "
        "would commit unchecked and a stale worker's write would land. Write through the block: "
        "`with self.fence.transaction() as conn:`, or `with self.fence.session(YourSession) as "
        "session:` (Flask-SQLAlchemy: self.fence.session(db.session); Django: "
        f"self.fence.atomic()), or write after the block. The connection: {where}."
    )


def ambiguous_error(where: str) -> ConfigurationError:
    """The refusal of a write on ``where`` from a thread no attempt claims, while several fenced
    attempts run in this process and one of them has a block open."""
    return ConfigurationError(
        f"a write on {where} from a thread that no fenced attempt claims, while several fenced "
        "attempts run in this process (the threads pool) and one of them has a fenced block "
        "open: the fence cannot tell whose write it is, so it was rolled back. Write through "
        "the block on the attempt's own thread, or copy the attempt's context into your thread "
        "(contextvars.copy_context().run(...), as asyncio.to_thread does)."
    )


def raw_commit_error(where: str) -> ConfigurationError:
    """The block's own transaction ended under it (a raw ``COMMIT`` on its connection)."""
    return ConfigurationError(
        f"the fenced block's transaction on {where} ended before the block's commit: a raw "
        "COMMIT (conn.exec_driver_sql('COMMIT'), a DB-API connection's commit(), a library that "
        "commits on the connection it is given) committed the block's writes so far WITHOUT the "
        "fence's ownership check, so a stale worker's write may have landed (and statements "
        "after it may have committed one by one, outside any transaction); what was still open "
        "was rolled back. Never commit a fenced block's connection yourself: conn.commit() / "
        "session.commit() are fenced, the end of the block commits."
    )


_warned_tasks: set[str] = set()
_warned_lock = threading.Lock()


def judge(subject: Fence | _Ambiguous, *, where: str, table: str | None = None) -> None:
    """A transaction on the connection ``where`` names wrote for ``subject`` (an attempt, or
    :data:`AMBIGUOUS`): raise to refuse it (the caller rolls it back), return to let it commit.
    Beside an open block: refused; outside every block: :func:`unfenced_write`; a write no
    attempt can be told for: refused while any block is open, else passed."""
    if isinstance(subject, _Ambiguous):
        if block_open_anywhere():
            raise ambiguous_error(where)
        return
    if subject.blocks.any_open:
        raise beside_block_error(where)
    unfenced_write(subject, where=where, table=table)


def unfenced_write(fence: Fence, *, where: str, table: str | None = None) -> None:
    """A write on ``where`` (e.g. ``"SQLAlchemy engine postgresql://.../db"``, ``"Django
    'default'"``) that no fenced block covers is about to commit for ``fence``'s attempt (the
    caller checked: it wrote, it is not the store's, not bookkeeping, no block is open).
    Applies ``fence_unfenced_writes``: ``"allow"`` nothing; ``"warn"`` one WARNING per task name
    and process, an ``unfenced_write`` transition row and signal per attempt, and returns;
    ``"error"`` the same row and signal, then raises :class:`ConfigurationError` (the caller
    rolls the write back)."""
    execution = fence.execution
    mode = DEFAULT_MODE if execution is None else execution.config.unfenced_writes
    if mode == "allow":
        return
    task = "?" if execution is None else execution.task_name
    what = f"table {table}" if table else "a table not known"
    if execution is not None:
        try:
            execution.unfenced_write(where=where, table=table, refused=mode == "error")
        except Exception:  # the record is history; the decision below stands
            logger.debug("could not announce the unfenced write", exc_info=True)
    if mode == "error":
        raise ConfigurationError(
            f"fenced task {task} (key {fence.key!r}) wrote {what} on {where} outside any fenced "
            "block (fence_unfenced_writes='error'): that write would commit without the fence, "
            f"so a stale worker's write would land. It was rolled back. {_FIX_BLOCK}."
        )
    with _warned_lock:
        if task in _warned_tasks:
            return
        _warned_tasks.add(task)
    logger.warning(
        "fence unfenced write: fenced task %s wrote %s on %s outside any fenced block (key=%s "
        "generation=%s attempt=%s): it committed without the fence, so a stale attempt's write "
        "lands there. %s. (Logged once per task and process; fence_unfenced_writes='error' "
        "refuses it, 'allow' silences this.)",
        task,
        what,
        where,
        fence.key,
        fence.generation,
        fence.attempt_id,
        _FIX_BLOCK,
        extra={
            "action": "unfenced_write",
            "fence_key": fence.key,
            "attempt_id": fence.attempt_id,
            "generation": fence.generation,
            "reason": f"unfenced write on {where}",
        },
    )


__all__ = [
    "AMBIGUOUS",
    "WATCH",
    "ambiguous_error",
    "attribution",
    "beside_block_error",
    "block_open_anywhere",
    "bookkeeping",
    "current_attempt",
    "detach_thread",
    "hold",
    "in_bookkeeping",
    "is_running",
    "raw_commit_error",
    "release",
    "running",
    "unfenced_write",
]
