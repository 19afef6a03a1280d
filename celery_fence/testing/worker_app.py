"""What a plugin-started worker runs: ``celery -A celery_fence.testing.worker_app worker``.

It imports the user's own app (``CELERY_FENCE_TESTING``'s ``"app"``, as ``celery -A`` would),
applies the test's settings over the app's own (the test's store, Redis key prefix, queue, short
TTL), and installs the fault points the chaos windows use. Nothing else differs from the user's
worker: the same tasks, the same ``FencedTask``, the same signals.

The fault points, driven from the test process through Redis (``<prefix>:testing:*``): one-shot
flags of :mod:`celery_fence.testing.faults`, keyed on the Celery task id, whose value says what
to do:

- ``start`` — at the start of the task body (for a fenced task: after the claim and the
  registration, with ``self.fence`` set): ``hold`` blocks the body until the test releases it.
- ``block`` — inside an open ``fence.atomic()`` block, after its writes and before its fenced
  commit (the ``block_committing`` signal): ``hold`` blocks there until the test releases it.
- ``step`` — inside a fenced step (``fence.run_step()`` / ``fence.step()``), after the step's
  body and before its row and fenced commit: ``hold:<k>`` blocks inside the body's ``k``-th step
  (1, 2, ...; steps replayed from the store count too) until the test releases it.
- ``commit`` — after the completion committed and before the message is acked (the fence's
  ``job_completed`` signal; Celery's ``task_success`` for a task that is not fenced): ``kill``
  SIGKILLs the pool process, so Celery gives the message back and it is delivered again.

The ``block`` point is also met by the outermost ``fence.transaction()`` / ``fence.session()``
block, after the block's own code and before its fenced commit; each of those blocks that
committed is recorded (``block_committed``, with ``t0``: the time just before its commit began),
which :meth:`~celery_fence.testing.chaos.FenceChaos.assert_converged` checks.

Every body start and return and every finished delivery is recorded as one JSON line in
``<prefix>:testing:events``: task id, pid, fence key, generation, attempt id, the names of staged
outbox effects and Celery's final state — never arguments, results or payloads.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from celery import Celery
from celery.app.utils import find_app
from celery.signals import task_postrun, task_success, worker_init

from celery_fence import signals as fence_signals
from celery_fence.config import FenceConfig
from celery_fence.testing import faults

ENV = "CELERY_FENCE_TESTING"  # environment.WORKER_ENV
SKIP_PREFIXES = ("celery.", "celery_fence.")
HOLD_SECONDS = 120.0  # a held body waits at most this long for the test to release it


class Hooks:
    """The fault points of one worker process tree, reading and writing ``<prefix>:testing``."""

    def __init__(self, app: Any, ledger_url: str, base: str) -> None:
        import redis

        self.app = app
        self.base = base
        self.ledger = redis.Redis.from_url(ledger_url, socket_timeout=HOLD_SECONDS + 10)

    def record(self, **event: Any) -> None:
        event.setdefault("pid", os.getpid())
        event.setdefault("t", time.time())
        self.ledger.rpush(f"{self.base}:events", json.dumps(event, separators=(",", ":")))

    def take(self, point: str, task_id: str | None) -> str | None:
        """The fault set for this point and task id, consumed (one delivery meets it once)."""
        if not task_id:
            return None
        return faults.take_value(self.ledger, self.base, faults.FAULT_POINT, point, task_id)

    def wrap_tasks(self, **_: Any) -> None:
        """Wrap each user task's ``run`` (in the main process, before the pool forks and Celery
        builds its tracers, so plain tasks get the wrapper too)."""
        for name, task in list(self.app.tasks.items()):
            if name.startswith(SKIP_PREFIXES) or getattr(task, "_fence_testing_wrapped", False):
                continue
            task.run = self._wrapped(task, task.run)
            task._fence_testing_wrapped = True

    def _wrapped(self, task: Any, run: Any) -> Any:
        @functools.wraps(run)
        def body(*args: Any, **kwargs: Any) -> Any:
            request = task.request
            fence = getattr(request, "fence", None)
            attempt = {
                "tid": request.id,
                "task": task.name,
                "key": getattr(fence, "key", None),
                "gen": getattr(fence, "generation", None),
                "attempt": getattr(fence, "attempt_id", None),
            }
            fault = self.take("start", request.id)
            self.record(ev="start", held=fault == "hold", **attempt)
            if fault == "hold":
                self.ledger.blpop([f"{self.base}:release:{request.id}"], timeout=HOLD_SECONDS)
                self.record(ev="released", **attempt)
            outer = (
                getattr(_body, "fence", None),
                getattr(_body, "tid", None),
                getattr(_body, "write_met", True),
            )
            steps = getattr(_body, "steps", 0)
            _body.fence, _body.tid, _body.write_met, _body.steps = fence, request.id, False, 0
            try:
                with _django_statements_watched(self):
                    result = run(*args, **kwargs)
            finally:
                _body.fence, _body.tid, _body.write_met = outer
                _body.steps = steps
            staged = [e.name for e in fence.effects.staged] if fence is not None else []
            self.record(ev="return", staged=staged, **attempt)
            return result

        return body

    def at_write(self, where: str) -> None:
        """The ``write`` fault point: the body's first statement outside a fenced block, or the
        moment a ``fence.check()`` / ``guard()`` of the body returned (outside a block)."""
        fence, task_id = getattr(_body, "fence", None), getattr(_body, "tid", None)
        if fence is None or _in_block(fence) or getattr(_body, "write_met", True):
            return
        _body.write_met = True  # one Redis round trip per body, not one per statement
        if self.take("write", task_id) == "hold":
            attempt = {"tid": task_id, "gen": getattr(fence, "generation", None), "where": where}
            self.record(ev="write", **attempt)
            self.ledger.blpop([f"{self.base}:release:{task_id}"], timeout=HOLD_SECONDS)
            self.record(ev="released", **attempt)

    def inside_block(self, sender: Any = None, **_: Any) -> None:
        from celery import current_task

        request = getattr(current_task, "request", None)
        task_id = getattr(request, "id", None)
        if self.take("block", task_id) == "hold":
            fence = getattr(request, "fence", None)
            attempt = {"tid": task_id, "gen": getattr(fence, "generation", None)}
            self.record(ev="block", **attempt)
            self.ledger.blpop([f"{self.base}:release:{task_id}"], timeout=HOLD_SECONDS)
            self.record(ev="released", **attempt)
        _body.committing = time.time()  # fence.atomic(): its check and commit start now

    def inside_step(self, step: Any) -> None:
        """The ``step`` fault point: the body's ``k``-th step, its body run, not committed."""
        _body.steps = k = getattr(_body, "steps", 0) + 1
        task_id = getattr(_body, "tid", None)
        if task_id is None or step.done:
            return
        flag = faults.flag(self.base, faults.FAULT_POINT, "step", task_id)
        if self.ledger.get(flag) != f"hold:{k}".encode() or self.take("step", task_id) is None:
            return
        fence = step.fence
        attempt = {"tid": task_id, "gen": fence.generation, "step": k, "name": step.name}
        self.record(ev="step", **attempt)
        self.ledger.blpop([f"{self.base}:release:{task_id}"], timeout=HOLD_SECONDS)
        self.record(ev="released", **attempt)

    def committed_block(self, fence: Any, began: float) -> None:
        """An outermost fenced block committed (``began``: just before its commit started)."""
        from celery import current_task

        request = getattr(current_task, "request", None)
        self.record(
            ev="block_committed",
            tid=getattr(request, "id", None),
            key=fence.key,
            gen=fence.generation,
            attempt=fence.attempt_id,
            t0=began,
        )
        if self.take("after_block", getattr(request, "id", None)) == "kill":
            self.record(ev="kill", tid=getattr(request, "id", None))
            os.kill(os.getpid(), signal.SIGKILL)

    def after_commit(self, sender: Any = None, **_: Any) -> None:
        task_id = getattr(getattr(sender, "request", None), "id", None)
        if self.take("commit", task_id) == "kill":
            self.record(ev="kill", tid=task_id)
            os.kill(os.getpid(), signal.SIGKILL)

    def finished(
        self, sender: Any = None, task_id: str | None = None, state: str | None = None, **_: Any
    ) -> None:
        self.record(ev="done", tid=task_id, task=getattr(sender, "name", None), state=state)


_body = threading.local()  # .fence, .tid: the fenced body running on this thread


def _in_block(fence: Any) -> bool:
    blocks = getattr(fence, "blocks", None)
    return blocks is not None and (blocks.current() is not None or bool(blocks.atomic))


def watch_writes(hooks: Hooks) -> None:
    """The ``write`` fault point (window ``pause-at-write``): met before the body's first
    SQLAlchemy statement outside a fenced block (the fence's own statements aside), and right
    after a ``fence.check()`` (called by the body itself) or ``guard()``'s check returns."""
    import sqlalchemy as sa

    from celery_fence.body.fence import Fence
    from celery_fence.store.engine import OWN

    def before_statement(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if getattr(_body, "fence", None) is None or conn.get_execution_options().get(OWN):
            return  # no body runs, or the store's own statement
        hooks.at_write("statement")

    if not sa.event.contains(sa.Engine, "before_cursor_execute", before_statement):
        sa.event.listen(sa.Engine, "before_cursor_execute", before_statement)

    check = Fence.check
    if not getattr(check, "_fence_testing_wrapped", False):

        def checked(fence: Any) -> None:
            check(fence)
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not str(caller).startswith("celery_fence."):  # the body's own check
                hooks.at_write("check")

        checked._fence_testing_wrapped = True  # type: ignore[attr-defined]
        setattr(Fence, "check", functools.wraps(check)(checked))  # noqa: B010

    guard = Fence.guard
    if not getattr(guard, "_fence_testing_wrapped", False):

        @contextlib.contextmanager
        def guarded(fence: Any) -> Iterator[Any]:
            with guard(fence) as value:
                hooks.at_write("guard")
                yield value

        guarded._fence_testing_wrapped = True  # type: ignore[attr-defined]
        setattr(Fence, "guard", functools.wraps(guard)(guarded))  # noqa: B010


def _django_statements_watched(hooks: Hooks) -> contextlib.AbstractContextManager[Any]:
    """In a process with Django configured: the ``write`` fault point before each Django
    statement of the body (Django is never imported here when the app does not use it)."""
    conf = sys.modules.get("django.conf")
    try:
        configured = conf is not None and "django.db" in sys.modules and conf.settings.configured
    except Exception:
        configured = False
    if not configured:
        return contextlib.nullcontext()
    from django.db import connections

    def wrapper(execute: Any, sql: Any, params: Any, many: Any, context: Any) -> Any:
        if not _fence_statement(str(sql)):
            hooks.at_write("statement")
        return execute(sql, params, many, context)

    stack = contextlib.ExitStack()
    for connection in connections.all():
        stack.enter_context(connection.execute_wrapper(wrapper))
    return stack


def _fence_statement(statement: str) -> bool:
    """A statement on the fence's own tables (``fence.atomic()``'s ownership check runs on
    Django's connection): not a write of the body's, for the pause point only."""
    from celery_fence import schema

    return any(t.name in statement for t in (schema.jobs, schema.transitions, schema.outbox))


def watch_blocks(hooks: Hooks) -> None:
    """Give the outermost ``fence.transaction()`` / ``fence.session()`` block the ``block``
    fault point before its commit (``fence.atomic()`` meets it at its ``block_committing``
    signal), and record each outermost block of the three that committed."""
    from celery_fence.body.fence import Fence

    for name in ("transaction", "session", "atomic"):
        original = getattr(Fence, name)
        if getattr(original, "_fence_testing_wrapped", False):
            continue

        def wrapped(
            fence: Any, *args: Any, __original: Any = original, __name: str = name, **kwargs: Any
        ) -> Any:
            # Outermost: no block of its kind is open yet on this thread (the current blocks
            # API: OpenBlocks.current() for transaction()/session(), OpenBlocks.atomic for
            # fence.atomic()'s aliases). A nested block is a savepoint: it commits nothing.
            if __name == "atomic":
                outermost = not fence.blocks.atomic
            else:
                outermost = fence.blocks.current() is None
            block = __original(fence, *args, **kwargs)
            return _watched(hooks, fence, block, outermost=outermost, atomic=__name == "atomic")

        wrapped._fence_testing_wrapped = True  # type: ignore[attr-defined]
        setattr(Fence, name, functools.wraps(original)(wrapped))


@contextlib.contextmanager
def _watched(
    hooks: Hooks, fence: Any, block: Any, *, outermost: bool, atomic: bool
) -> Iterator[Any]:
    with block as value:
        yield value
        if outermost and not atomic:  # (atomic(): at its block_committing signal)
            hooks.inside_block()
        began = time.time()  # the block's fenced commit starts as it closes
        _body.committing = None
    if atomic and getattr(_body, "committing", None) is not None:
        began = _body.committing  # atomic()'s check and commit began at its signal
    if outermost:
        hooks.committed_block(fence, began)


def watch_steps(hooks: Hooks) -> None:
    """Give every fenced step the ``step`` fault point, after its body and before its row and
    commit (a step that raised meets none)."""
    from celery_fence.body.steps import Step

    original = Step.__exit__
    if getattr(original, "_fence_testing_wrapped", False):
        return

    def wrapped(step: Any, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            hooks.inside_step(step)
        return original(step, exc_type, exc, tb)

    wrapped._fence_testing_wrapped = True  # type: ignore[attr-defined]
    Step.__exit__ = functools.wraps(original)(wrapped)  # type: ignore[method-assign]


def record_outbox(hooks: Hooks) -> None:
    """Deliver every outbox effect to a recording handler instead of the app's own (which may
    email real people, or charge a real provider account production shares): each delivery is
    recorded as an ``outbox`` event (effect name and idempotency key, never the payload). A name
    with no handler of the app's still fails as it would in production."""
    from celery_fence.ops.outbox import Outbox

    original = Outbox.handler_for
    if getattr(original, "_fence_testing_wrapped", False):
        return

    def handler_for(outbox: Any, name: str) -> Any:
        if original(outbox, name) is None:
            return None

        def recording(payload: Any, *, idempotency_key: str) -> None:
            hooks.record(ev="outbox", effect=name, idem=idempotency_key)

        return recording

    handler_for._fence_testing_wrapped = True  # type: ignore[attr-defined]
    setattr(Outbox, "handler_for", functools.wraps(original)(handler_for))  # noqa: B010


def load(spec: dict[str, Any]) -> Celery:
    """The user's app, configured for the test, with the fault points installed."""
    app: Celery = find_app(spec["app"])
    if spec.get("django_databases"):  # pytest-django's test databases, not the project's own
        from django.conf import settings

        for alias, name in spec["django_databases"].items():
            settings.DATABASES[alias]["NAME"] = name
    app.conf.update(spec["conf"])
    FenceConfig.forget(app)  # FenceConfig.from_app's cache: read the new settings
    hooks = Hooks(app, spec["ledger_url"], spec["ledger_base"])
    worker_init.connect(hooks.wrap_tasks, weak=False)
    fence_signals.job_completed.connect(hooks.after_commit, weak=False)
    fence_signals.block_committing.connect(hooks.inside_block, weak=False)
    watch_blocks(hooks)
    watch_steps(hooks)
    watch_writes(hooks)
    if not spec.get("real_outbox"):
        record_outbox(hooks)
    task_success.connect(hooks.after_commit, weak=False)
    task_postrun.connect(hooks.finished, weak=False)
    return app


app = load(json.loads(os.environ[ENV]))
