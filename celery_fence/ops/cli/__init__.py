"""``celery -A proj fence ...``: the operator's view of fenced jobs.

Registered as a Celery sub-command through the ``celery.commands`` entry point; the app (and so
the settings) comes from ``celery -A proj``. The CLI talks to the store, the lease store and, to
re-send a job, the broker; it imports the app's task modules for their settings and never runs a
task. Every failure — unknown key, bad option value, unreachable database, Redis or
broker — ends with one line on stderr and a non-zero exit code (2 for usage errors, 1 otherwise),
never a traceback.

:mod:`~celery_fence.ops.cli.common` holds the ``fence`` group and what the verbs share;
:mod:`~celery_fence.ops.cli.read` the verbs that only look (``check``, ``ls``, ``show``);
:mod:`~celery_fence.ops.cli.write` those that change state (``init-db``, ``requeue``, ``recover``,
``purge``); :mod:`~celery_fence.ops.cli.outbox` the ``fence outbox`` group (``ls``,
``requeue``); :mod:`~celery_fence.ops.cli.metrics` the ``metrics`` verb (the store's
gauges for Prometheus); :mod:`~celery_fence.ops.cli.beat` the ``fence beat`` group (``ls``).
Importing the verb modules here registers their commands on ``fence``.
"""

from __future__ import annotations

from celery_fence.ops.cli import beat, metrics, outbox, read, write
from celery_fence.ops.cli.common import EX_FAILURE, EX_USAGE, FenceCLIError, describe, fence
from celery_fence.ops.cli.write import parse_before

__all__ = [
    "EX_FAILURE",
    "EX_USAGE",
    "FenceCLIError",
    "beat",  # imported for its commands
    "describe",
    "fence",
    "metrics",  # imported for its command
    "outbox",  # imported for its commands
    "parse_before",
    "read",  # imported for its commands
    "write",  # imported for its commands
]
