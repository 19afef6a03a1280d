"""Logging helpers: the current attempt on the task's own log records, payloads out of Celery's.

Two filters, installed in the worker through Celery's logging signals (their receivers,
:data:`RECEIVERS`, are connected by :func:`celery_fence.install`, which a fenced task runs for
its app; they act only when the current app, or another app of the process, is installed;
nothing happens outside a worker unless you install the filters yourself):

- :class:`FenceContextFilter` puts the running fenced attempt on every record logged while its
  body runs: attributes ``fence_key``, ``generation`` and ``attempt_id`` (for JSON formatters and
  custom formats) and ``fence_context`` (`` key=... generation=... attempt=...``, or ``""``
  outside a fenced body). Installed on the handlers of the root logger and of Celery's task logger
  (``celery.task``, the parent of every ``get_task_logger(...)`` logger); when the task logger
  uses Celery's ``TaskFormatter`` with a ``[%(task_id)s]`` format (the default), the format gains
  ``%(fence_context)s`` after the task id, so existing task log lines tell attempts apart::

      ... tasks.report[5d1c...] key=report:42 generation=3 attempt=9f2e...: collecting rows

- :class:`RedactCeleryPayloads` (setting ``fence_redact_celery_logs=True``) removes payloads from
  Celery's own records: the return value of the success line (``celery.app.trace``), the message
  body of the DEBUG pool line (``celery.pool``, worker main process), the args/kwargs reprs that
  the received, success and failure lines carry in their arguments and in ``record.data`` (for
  JSON formatters), and the bodies printed for unknown, invalid or undecodable messages. It is
  installed on those Celery loggers themselves (so it applies whatever handlers you add) and on
  Celery's handlers, in the main process and in every pool process. Exception messages and
  tracebacks are left as they are: keep payloads out of the exceptions your tasks raise.

With a ``setup_logging`` receiver of your own (Celery then skips its logging setup and these
signals), add the filters yourself: ``handler.addFilter(FenceContextFilter())`` and
:func:`install_redaction`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery import signals as celery_signals
from celery._state import get_current_task
from celery.utils.dispatch import Signal

from celery_fence.app_state import installed, installed_apps
from celery_fence.errors import ConfigurationError
from celery_fence.settings import read_setting

logger = logging.getLogger("celery_fence")

#: What a redacted payload is replaced with.
REDACTED = "<redacted>"
#: Keys of Celery's log-context dicts (``record.args``, ``record.data``) that hold payloads.
PAYLOAD_KEYS = frozenset({"args", "kwargs", "argsrepr", "kwargsrepr", "return_value", "body"})
#: Celery loggers whose records can carry payloads; the redaction filter sits on each of them.
CELERY_PAYLOAD_LOGGERS = (
    "celery.app.trace",
    "celery.pool",
    "celery.worker.strategy",
    "celery.worker.request",
    "celery.worker.consumer.consumer",
)
#: Attempt attributes set on records (the same names as the ``extra`` keys of fence's own lines).
CONTEXT_ATTRS = ("fence_key", "generation", "attempt_id")


def _current_fence() -> Any:
    task = get_current_task()  # None outside a task (and on other threads)
    if task is None:
        return None
    return getattr(task.request, "fence", None)


class FenceContextFilter(logging.Filter):
    """Add the running fenced attempt (key, generation, attempt id) to every record.

    Never overwrites attributes a record already has (fence's own records carry them as ``extra``)
    and never rejects a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        fence = _current_fence()
        if fence is None:
            if not hasattr(record, "fence_context"):
                setattr(record, "fence_context", "")  # noqa: B010 - LogRecord has no such field
            return True
        values = (fence.key, fence.generation, fence.attempt_id)
        for name, value in zip(CONTEXT_ATTRS, values, strict=True):
            if not hasattr(record, name):
                setattr(record, name, value)
        if not hasattr(record, "fence_context"):
            context = f" key={fence.key} generation={fence.generation} attempt={fence.attempt_id}"
            setattr(record, "fence_context", context)  # noqa: B010
        return True


def fenced_task_format(fmt: str) -> str:
    """Celery's task log format with the attempt after the task id (unchanged if not found)."""
    if "fence_context" in fmt or "[%(task_id)s]" not in fmt:
        return fmt
    return fmt.replace("[%(task_id)s]", "[%(task_id)s]%(fence_context)s", 1)


def _payload_templates() -> dict[str, tuple[int, ...]]:
    """Celery's message templates whose positional arguments hold payloads -> their positions."""
    from celery.worker.consumer import consumer

    return {
        "TaskPool: Apply %s (args:%s kwargs:%s)": (1, 2),
        consumer.UNKNOWN_FORMAT: (0,),
        consumer.UNKNOWN_TASK_ERROR: (1, 2),
        consumer.INVALID_TASK_ERROR: (1,),
        consumer.MESSAGE_DECODE_ERROR: (3, 4),
    }


def _redacted_mapping(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (REDACTED if k in PAYLOAD_KEYS else v) for k, v in values.items()}


class RedactCeleryPayloads(logging.Filter):
    """Replace the payloads in Celery's own log records with ``<redacted>``; never rejects one.

    Mapping arguments (Celery's ``Task %(name)s[%(id)s] ...`` lines) lose their ``args``,
    ``kwargs``, ``return_value`` ... entries on records of ``celery.*`` loggers; the known
    positional templates (pool line, unknown/invalid message reports) lose the body positions,
    whichever logger logs them. ``record.data`` (Celery's copy for JSON handlers) is redacted too.
    """

    def __init__(self) -> None:
        super().__init__()
        self._templates: dict[str, tuple[int, ...]] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, Mapping):
            if record.name.startswith("celery.") and PAYLOAD_KEYS.intersection(args):
                record.args = _redacted_mapping(args)
        elif args and isinstance(record.msg, str):
            if self._templates is None:
                self._templates = _payload_templates()
            positions = self._templates.get(record.msg)
            if positions:
                record.args = tuple(
                    REDACTED if i in positions else arg for i, arg in enumerate(args)
                )
        data = getattr(record, "data", None)
        if (
            isinstance(data, Mapping)
            and record.name.startswith("celery.")
            and PAYLOAD_KEYS.intersection(data)
        ):
            setattr(record, "data", _redacted_mapping(data))  # noqa: B010
        return True


_context_filter = FenceContextFilter()
_redaction_filter = RedactCeleryPayloads()


def install_context(target: logging.Logger | logging.Handler) -> None:
    """Add the attempt-context filter to a logger's handlers (or to one handler); idempotent."""
    handlers = target.handlers if isinstance(target, logging.Logger) else [target]
    for handler in handlers:
        handler.addFilter(_context_filter)


def _amend_task_formatter(task_logger: logging.Logger) -> None:
    from celery.app.log import TaskFormatter

    for handler in task_logger.handlers:
        old = handler.formatter
        if not isinstance(old, TaskFormatter) or type(old) is not TaskFormatter:
            continue  # a formatter of the user's own: only the filter's attributes are added
        fmt = fenced_task_format(old._fmt or "")
        if fmt != old._fmt:
            handler.setFormatter(
                TaskFormatter(fmt, datefmt=old.datefmt, use_color=getattr(old, "use_color", False))
            )


def install_redaction(*handler_loggers: logging.Logger) -> None:
    """Add the redaction filter to Celery's payload loggers and to the handlers of the given
    loggers (e.g. the root logger); idempotent. Acts whatever the settings: the signal receivers
    below call it only for apps with ``fence_redact_celery_logs=True``."""
    for name in CELERY_PAYLOAD_LOGGERS:
        logging.getLogger(name).addFilter(_redaction_filter)
    for target in handler_loggers:
        for handler in target.handlers:
            handler.addFilter(_redaction_filter)


def uninstall_redaction(*handler_loggers: logging.Logger) -> None:
    """Undo :func:`install_redaction` (tests)."""
    for name in CELERY_PAYLOAD_LOGGERS:
        logging.getLogger(name).removeFilter(_redaction_filter)
    for target in handler_loggers:
        for handler in target.handlers:
            handler.removeFilter(_redaction_filter)


def redaction_enabled(app: Any) -> bool:
    """Whether ``app`` sets ``fence_redact_celery_logs`` (an invalid value logs and counts as on).

    Reads this one setting only: logging is set up before any task validates the others.
    """
    try:
        return bool(read_setting(app.conf, "redact_celery_logs"))
    except ConfigurationError as exc:
        logger.error("%s; redacting Celery's payload log lines anyway", exc)
        return True


def _current_app() -> Any:
    from celery import current_app

    return current_app._get_current_object()


def _fenced_app() -> Any:
    """The app whose settings the logging receivers follow: the current app when it is
    installed, else an installed app of this process, else None (nothing to do)."""
    app = _current_app()
    if installed(app):
        return app
    apps = installed_apps()
    return apps[0] if apps else None


def _on_setup_logger(**kwargs: Any) -> None:
    app = _fenced_app()
    if app is None:
        return
    root = kwargs.get("logger") or logging.getLogger()
    install_context(root)
    if redaction_enabled(app):
        install_redaction(root)


def _on_setup_task_logger(**kwargs: Any) -> None:
    app = _fenced_app()
    if app is None:
        return
    task_logger = kwargs.get("logger") or logging.getLogger("celery.task")
    install_context(task_logger)
    _amend_task_formatter(task_logger)
    if redaction_enabled(app):
        install_redaction(task_logger)


def _on_worker_process_init(**_: Any) -> None:
    """Pool processes inherit the filters by fork; this covers the other start methods."""
    app = _fenced_app()
    if app is not None and redaction_enabled(app):
        install_redaction(logging.getLogger(), logging.getLogger("celery.task"))


#: The process-wide receivers :func:`celery_fence.install` connects, once.
RECEIVERS: tuple[tuple[Signal, Any], ...] = (
    (celery_signals.after_setup_logger, _on_setup_logger),
    (celery_signals.after_setup_task_logger, _on_setup_task_logger),
    (celery_signals.worker_process_init, _on_worker_process_init),
)


__all__ = [
    "CELERY_PAYLOAD_LOGGERS",
    "PAYLOAD_KEYS",
    "RECEIVERS",
    "REDACTED",
    "FenceContextFilter",
    "RedactCeleryPayloads",
    "fenced_task_format",
    "install_context",
    "install_redaction",
    "redaction_enabled",
    "uninstall_redaction",
]
