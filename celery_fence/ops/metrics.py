"""The store gauges: one process (``celery -A proj fence metrics --serve``) reads them from the
store at each scrape; workers never do.

- ``celery_fence_jobs{task,status}``: jobs by status (every status; ``running``, ``retrying`` and
  ``pending`` are the unfinished ones, ``dead`` the dead ones);
- ``celery_fence_stuck_jobs{task}``: what ``celery fence ls --stuck`` lists (up to
  :data:`STUCK_LIMIT` a scrape);
- ``celery_fence_outbox_effects{status}`` and ``celery_fence_outbox_oldest_pending_age_seconds``;
- ``celery_fence_store_up``: 1 when the last read worked, else 0 (the others are then absent).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

from celery_fence.ops import recovery
from celery_fence.ops.scope import Scope
from celery_fence.schema import STATUSES, OutboxStatus, utcnow
from celery_fence.store import UNFINISHED

try:
    from prometheus_client.core import GaugeMetricFamily
except ImportError:  # ``fence metrics`` says which extra to install
    GaugeMetricFamily = None  # type: ignore[assignment,misc]

logger = logging.getLogger("celery_fence")

#: Stranded jobs one scrape looks for at most (the gauge then reads this many).
STUCK_LIMIT = 10_000

P = "celery_fence_"


def _utc(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)


class StoreCollector:
    """Reads the store of ``app``'s fenced tasks (every database they write to) at collect."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def describe(self) -> list[Any]:
        return []  # read at collect only: registering must not query the store

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily(P + "store_up", "1 when the last read of the store worked.")
        try:
            families = self._read()
        except Exception as exc:  # a scrape never fails: it says the store is unreadable
            logger.warning("celery-fence metrics: cannot read the store (%s)", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _read(self) -> list[Any]:
        jobs = GaugeMetricFamily(P + "jobs", "Jobs by task and status.", labels=["task", "status"])
        stuck = GaugeMetricFamily(
            P + "stuck_jobs", "Stranded jobs (celery fence ls --stuck).", labels=["task"]
        )
        effects = GaugeMetricFamily(
            P + "outbox_effects", "Outbox effects by status.", labels=["status"]
        )
        oldest = GaugeMetricFamily(
            P + "outbox_oldest_pending_age_seconds",
            "Age of the oldest pending outbox effect (0: none pending).",
        )
        counts: Counter[tuple[str, str]] = Counter()
        outbox: Counter[str] = Counter()
        oldest_pending: dt.datetime | None = None
        stranded: Counter[str] = Counter()
        with Scope(self.app) as scope:
            for db in scope.databases():
                counts.update(db.store.admin.status_counts())
                for status, (n, first) in db.store.outbox_rows.summary().items():
                    outbox[status] += n
                    if status == OutboxStatus.PENDING.value and first is not None:
                        first = _utc(first)
                        if oldest_pending is None or first < oldest_pending:
                            oldest_pending = first
            found = recovery.stranded_jobs(
                scope, limit=STUCK_LIMIT, resend_backoff=False, statuses=UNFINISHED
            )
            stranded.update(record.task_name for _, record in found)
        tasks = sorted({task for task, _ in counts})
        for task in tasks:
            for status in STATUSES:
                jobs.add_metric([task, status], counts.get((task, status), 0))
            stuck.add_metric([task], stranded.get(task, 0))
        for status in OutboxStatus:
            effects.add_metric([status.value], outbox.get(status.value, 0))
        age = 0.0 if oldest_pending is None else (utcnow() - oldest_pending).total_seconds()
        oldest.add_metric([], max(0.0, age))
        return [jobs, stuck, effects, oldest]


__all__ = ["STUCK_LIMIT", "StoreCollector"]
