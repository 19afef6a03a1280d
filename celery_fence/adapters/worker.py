"""What runs in the worker around fenced tasks: the settings check at start, the release of
leases at process shutdown, and FencedRequest, which settles the exits Celery drives itself.

The signal receivers here are connected by :func:`celery_fence.install` (once per process, see
:data:`RECEIVERS`), not by importing this module; each acts only for an installed app.

A worker whose fence settings are invalid refuses to start (``worker_init``), before it consumes
anything, with one line that names the setting and the fix.

Three ways a fenced message can end without its task body's settle step running:

- **Hard time limit.** The pool kills the process running the attempt; Celery (with
  ``acks_on_timeout``, the default) would ack the message and leave the job ``running`` for good.
  Here the message is given back to the broker instead, after a ``time_limit`` transition is
  recorded: the next delivery claims the key once the killed attempt's lease runs out, and the job
  ends ``completed`` on a later attempt, or ``dead`` with reason "time limit" once
  ``fence_max_attempts`` executions are spent.
- **Expired or revoked before it ran.** Celery acks such a message without running it. Here the
  job is settled first: a job that has no row yet is recorded ``dead`` (reason ``expired`` or
  ``revoked``) so an operator sees it and can requeue it; a job whose only message this is (the
  default key, the Celery task id) and that is waiting for it (``retrying``/``pending``) goes
  ``dead`` the same way. A job under a ``fence_key`` that other messages may share goes ``dead``
  only when it waits for this very message (its stored request has this task id: its own retry,
  re-send or requeue); otherwise it keeps its state and gets a transition row. If the store
  cannot be written, the message is given back.
- **Revoked with ``terminate=True`` while it ran.** The pool kills the attempt and Celery acks
  the message. Here the job is recorded ``dead``, reason "revoked", when its row is still
  unfinished under this message (its stored request has this task id; a row that has completed
  meanwhile keeps its result), so ``fence recover`` does not re-send what the operator stopped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import click
from billiard.exceptions import TimeLimitExceeded
from celery.signals import (
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from celery.utils.dispatch import Signal
from celery.worker.request import Request

from celery_fence.actions import LogAction
from celery_fence.adapters.request import encode_request
from celery_fence.app_state import app_state, installed, installed_apps
from celery_fence.body import watch
from celery_fence.errors import ConfigurationError
from celery_fence.ops.recovery_thread import start_recovery_thread
from celery_fence.pipeline import outcomes as o
from celery_fence.pipeline.exits import settle_exit
from celery_fence.process.runtime import runtime
from celery_fence.store.driver_errors import missing_database

if TYPE_CHECKING:
    from celery_fence.pipeline.execution import Execution

logger = logging.getLogger("celery_fence")


class FencedRequest(Request):
    """The worker-side request of a :class:`~celery_fence.FencedTask` message: the exits Celery
    drives here, in the worker's main process, are settled by
    :func:`~celery_fence.pipeline.exits.settle_exit` (an
    :class:`~celery_fence.pipeline.execution.Execution` of the task names the job)."""

    _fence_time_limit_settled = False

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        # The body's request (Task.request) then says how the message was serialized, as AMQP's
        # properties already do (Redis' lack it): the stored request and the fence's re-sends
        # publish with the same serializer (request.message_publish_options).
        if self._content_type:
            properties = dict(self._request_dict.get("properties") or {})
            properties.setdefault("content_type", self._content_type)
            properties.setdefault("content_encoding", self._content_encoding)
            self._request_dict["properties"] = properties

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            self._settle_time_limit(timeout)
        super().on_timeout(soft, timeout)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        # The pool reports a hard time limit as a failure too, in either order with on_timeout;
        # whichever comes first gives the message back before Celery would ack it.
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # billiard's ExceptionWithTraceback
        if isinstance(exc, TimeLimitExceeded):
            self._settle_time_limit(exc.args[0] if exc.args else None)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> None:
        why = "expired" if expired else "revoked"
        self._apply(self._settle_unrun(why, terminated))
        super()._announce_revoked(reason, terminated, signum, expired)

    def _settle_time_limit(self, timeout: float | None) -> None:
        if self._fence_time_limit_settled:
            return
        self._fence_time_limit_settled = True
        try:
            try:
                key = self._key()
            except ConfigurationError:
                key = str(self.id)
            disposition = settle_exit(self._execution(key), o.TimeLimited(timeout))
        except Exception as exc:  # no execution (settings): the message goes back all the same
            logger.warning(
                "fence could not record the hard time limit of task=%s id=%s: %s",
                self.task_name,
                self.id,
                type(exc).__name__,
                extra={"action": LogAction.STORE_ERROR, "reason": "time limit"},
            )
            disposition = o.Requeue("hard time limit")
        self._apply(disposition)  # Celery's own ack that follows is then a no-op

    def _settle_unrun(self, why: str, terminated: bool) -> o.Disposition:
        """Settle the job of a message Celery will not run (or, ``terminated``, whose running
        attempt ``revoke(terminate=True)`` killed)."""
        try:
            task: Any = self.task
            task.fence_backends()  # invalid settings: the message goes back (below)
            try:
                key = self._key()
            except ConfigurationError:
                return o.Acknowledge()  # an unkeyed message that never ran: nothing to record
            execution = self._execution(key)
            request = encode_request(self.task_name, self.args, self.kwargs, self._context)
        except Exception as exc:
            logger.error(
                "fence could not settle the %s task=%s id=%s: %s; the message goes back",
                why,
                self.task_name,
                self.id,
                type(exc).__name__,
                extra={"action": LogAction.STORE_ERROR, "reason": why},
            )
            return o.Requeue(f"{why}: settings or store unavailable")
        unrun = o.Unrun(why, self.id, request, terminated, shared_key=key != self.id)
        return settle_exit(execution, unrun)

    def _key(self) -> str:
        """This message's key as its body would read it: the ``fence_key`` header of a
        recovery's or a requeue's re-send (the job's own key, which the arguments may no longer
        give), else the task's ``fence_key`` of the arguments (or the task id)."""
        task: Any = self.task
        header = self.request_dict.get("fence_key")
        key: str = task.message_key(self.args, self.kwargs, self.id, header)
        return key

    def _execution(self, key: str) -> Execution:
        """The execution that names the job ``key`` in this process: it claims nothing."""
        task: Any = self.task
        execution: Execution = task.fence_execution(key, message_id=self.id, hostname=self.hostname)
        return execution

    def _apply(self, disposition: o.Disposition) -> None:
        """The worker's side of a disposition: give the message back, or let Celery ack it."""
        if isinstance(disposition, o.Requeue):
            self.reject(requeue=True)


def _release_on_shutdown(sender: Any = None, **_: Any) -> None:
    """A worker process that exits finishes its background writes and sends its queued lease
    releases and events first: a prefork child (``worker_process_shutdown``, no app given: when
    the process has an installed app), and the worker's main process on every pool
    (``worker_shutdown``, sent by the worker: when its app is installed; solo, threads and gevent
    run their tasks there). Safe to run twice: a second call finds nothing left to send."""
    app: Any = getattr(sender, "app", None)
    if not (installed(app) if app is not None else installed_apps()):
        return
    runtime().shutdown()


def celery_command(app: Any) -> str:
    """``celery -A <app>`` as this worker's operator would type it, for the hints a worker's
    messages print: the ``-A`` value the worker was started with, else the app's ``main`` name."""
    known = app_state(app).celery_command
    if known:
        return known
    main = getattr(app, "main", None)
    return f"celery -A {main if main and main != '__main__' else '<app>'}"


def _remember_celery_command(sender: Any = None, **_: Any) -> None:
    """Remember the ``-A`` value of ``celery -A proj worker`` (the command line's, read in the
    main process before the pool forks, so prefork children inherit it)."""
    app: Any = getattr(sender, "app", None)
    if not installed(app):
        return
    ctx = click.get_current_context(silent=True)
    given = ctx.find_root().params.get("app") if ctx is not None else None
    if isinstance(given, str) and given:
        app_state(app).celery_command = f"celery -A {given}"


def _check_settings_at_start(sender: Any = None, **_: Any) -> None:
    """Refuse to start when a fenced task's settings are invalid, or its store's PostgreSQL
    database does not exist: one line, nothing consumed."""
    app: Any = getattr(sender, "app", None)
    if not installed(app):
        return
    databases: dict[str, float] = {}
    for task in list(app.tasks.values()):
        if getattr(task, "settings_checked_at_start", False):
            try:
                config = task.fence_config()
            except ConfigurationError as exc:
                message = f"celery-fence: invalid settings, the worker does not start: {exc}"
                logger.critical(message)
                raise SystemExit(message) from None
            databases.setdefault(config.database_url, config.database_timeout)
    for url, timeout in databases.items():
        missing = missing_database(url, timeout, celery_command(app))
        if missing is not None:  # every claim would fail: refuse, rather than loop on re-sends
            message = f"celery-fence: {missing}; the worker does not start"
            logger.critical(message)
            raise SystemExit(message)


def _start_recovery(sender: Any = None, **_: Any) -> None:
    """The worker's main process, ready: start its recovery thread
    (:mod:`celery_fence.ops.recovery_thread`; not with ``fence_recover_interval=0``)."""
    app: Any = getattr(sender, "app", None)
    if not installed(app):
        return
    try:
        start_recovery_thread(app, owner=str(getattr(sender, "hostname", "") or ""))
    except Exception as exc:  # the worker runs; recovery is then beat's or the operator's
        logger.error(
            "fence could not start the recovery thread: %s",
            type(exc).__name__,
            extra={"action": LogAction.RECOVER_FAILED, "reason": str(exc)},
        )


def _detach_thread(sender: Any = None, **_: Any) -> None:
    """A worker's own thread (its main thread, a pool thread about to run a task): a write on
    it is a running fenced attempt's only when that attempt runs on it
    (:func:`celery_fence.body.watch.detach_thread`)."""
    watch.detach_thread()


#: ``FencedTask.Request``: how Celery finds :class:`FencedRequest`.
FENCED_REQUEST = f"{__name__}:FencedRequest"

#: The process-wide receivers :func:`celery_fence.install` connects, in this order, once.
RECEIVERS: tuple[tuple[Signal, Any], ...] = (
    (worker_init, _remember_celery_command),
    (worker_init, _check_settings_at_start),
    (worker_process_shutdown, _release_on_shutdown),
    (worker_shutdown, _release_on_shutdown),
    (worker_ready, _start_recovery),
    (worker_init, _detach_thread),
    (worker_process_init, _detach_thread),
    (task_prerun, _detach_thread),
)
