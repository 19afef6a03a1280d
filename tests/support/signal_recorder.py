"""Worker-side recorders for the transition tests (imported by app.py when FENCE_T_SIGNALS=1).

- Every celery-fence signal a worker process sends is appended, as JSON, to the Redis list
  ``<prefix>:signals`` (signal name, sender, key, attempt id, generation, reason, extras, thread).
- ``FENCE_T_SIGNALS_RAISE=1`` also connects a receiver that raises on every signal: the fenced
  path must not notice.
- ``FENCE_T_LOG_CAPTURE=<path>`` adds a handler to the root and task loggers (after Celery set
  them up) that writes every record, whole (message, args, extras, traceback), to
  ``<path>.<pid>.jsonl``: what a JSON log formatter could show.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

import redis
from celery import signals as celery_signals

from celery_fence import signals as fence_signals

E = os.environ
PREFIX = E.get("FENCE_T_PREFIX", "t")
_ledger = redis.Redis.from_url(E.get("FENCE_T_REDIS", "redis://127.0.0.1:6379/1"))

SIGNALS = {
    name: getattr(fence_signals, name)
    for name in (
        "lease_claimed",
        "lease_renewed",
        "lease_lost",
        "lease_busy",
        "job_completed",
        "job_replayed",
        "stale_rejected",
        "job_retry_scheduled",
        "job_dead",
        "job_taken_over",
    )
}


def _record(signal: Any = None, sender: Any = None, **kwargs: Any) -> None:
    entry = {
        "signal": signal.name if signal is not None else None,
        "sender": getattr(sender, "name", None),
        "thread": threading.current_thread().name,
        "pid": os.getpid(),
        "at": time.time(),
        **kwargs,
    }
    _ledger.rpush(f"{PREFIX}:signals", json.dumps(entry, default=repr))


def _raise(signal: Any = None, **_: Any) -> None:
    raise RuntimeError(f"receiver of {getattr(signal, 'name', signal)} failed on purpose")


for _signal in SIGNALS.values():
    _signal.connect(_record, weak=False)
    if E.get("FENCE_T_SIGNALS_RAISE") == "1":
        _signal.connect(_raise, weak=False)


class _JsonLinesHandler(logging.Handler):
    """Every record, whole, one JSON object a line, one file per process."""

    def __init__(self, base: str) -> None:
        super().__init__(logging.NOTSET)
        self.base = base

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception as exc:  # a broken format is still captured
            message = f"<unformattable: {exc!r}>"
        whole = {k: repr(v) for k, v in record.__dict__.items()}
        if record.exc_info:
            whole["formatted_exc_info"] = logging.Formatter().formatException(record.exc_info)
        line = json.dumps({"name": record.name, "message": message, "record": whole})
        with open(f"{self.base}.{os.getpid()}.jsonl", "a", encoding="utf-8") as out:
            out.write(line + "\n")


_capture = E.get("FENCE_T_LOG_CAPTURE")
if _capture:
    _handler = _JsonLinesHandler(_capture)

    @celery_signals.after_setup_logger.connect(weak=False)
    def _capture_root(logger: logging.Logger | None = None, **_: Any) -> None:
        (logger or logging.getLogger()).addHandler(_handler)

    @celery_signals.after_setup_task_logger.connect(weak=False)
    def _capture_task(logger: logging.Logger | None = None, **_: Any) -> None:
        (logger or logging.getLogger("celery.task")).addHandler(_handler)
