"""Retention: finished jobs and their history deleted once they are older than a set age.

``fence_retention`` (seconds; unset: keep everything) with the beat task :data:`PURGE_TASK`
(registered by :func:`celery_fence.install` on each app that has a fenced task)::

    beat_schedule = {"fence-purge": {"task": "celery_fence.purge", "schedule": 3600.0}}

Each run deletes the ``completed`` jobs finished more than ``fence_retention`` seconds ago, with
their transition history, in batches of short transactions (:meth:`Store.purge`). ``dead`` jobs
stay for an operator (``celery fence purge --include-dead`` deletes them). It purges the app's
store only and leaves the outbox alone: jobs in a task's own ``fence_database_url`` and delivered
outbox rows are purged by ``celery fence purge``.

A completed job's row is what makes a late redelivery of its message replay the result instead
of running the body again, so the age must outlast any message that can still arrive: the
setting is at least an hour (:data:`~celery_fence.settings.MIN_RETENTION`), and should exceed the
broker's redelivery delay (the Redis broker's ``visibility_timeout``) and
``fence_retry_backoff_max``.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from celery_fence.actions import LogAction
from celery_fence.config import FenceConfig
from celery_fence.pipeline.backends import store_for
from celery_fence.schema import COMPLETED

logger = logging.getLogger("celery_fence.retention")

#: The beat task: ``{"task": PURGE_TASK, "schedule": 3600.0}``.
PURGE_TASK = "celery_fence.purge"


def purge_expired(app: Any, *, now: dt.datetime | None = None) -> int:
    """Delete the completed jobs (and history) older than ``fence_retention``; the count.
    Nothing when the setting is unset."""
    config = FenceConfig.from_app(app)
    if config.retention is None:
        logger.info(
            "fence purge: fence_retention is not set, nothing deleted",
            extra={"action": LogAction.PURGE, "reason": "no retention set"},
        )
        return 0
    cutoff = (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(seconds=config.retention)
    count = store_for(config).admin.purge(finished_before=cutoff, statuses=(COMPLETED,))
    logger.info(
        "fence purge: %d completed job(s) finished before %s deleted",
        count,
        cutoff.isoformat(timespec="seconds"),
        extra={"action": LogAction.PURGE, "reason": f"older than {config.retention:g}s"},
    )
    return count


def purge_task(self: Any) -> int:
    """The beat task's body (:data:`PURGE_TASK`, registered per app by
    :func:`celery_fence.install`): one :func:`purge_expired` run on this worker's app."""
    return purge_expired(self.app)


__all__ = ["PURGE_TASK", "purge_expired", "purge_task"]
