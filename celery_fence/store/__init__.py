"""The fenced result store: the one place that runs SQL on celery-fence's tables (their DDL is
:mod:`celery_fence.schema`'s and the migrations'; :mod:`celery_fence.body.transaction` sends the
block statements of :mod:`.session_sql` on the user's own connection).

- :file:`queries.sql` (loaded by :mod:`.queries`): the fenced writes, written out and named;
- :mod:`.sql`: the Core reads and the operator's statements; :mod:`.outbox_sql`: the outbox's;
  :mod:`.session_sql`: the statements that set up a session and its transactions;
- :mod:`.engine`: the engine, its bounds on every wait, the raw path; :mod:`.driver_errors`:
  driver errors reduced to what may be logged;
- :mod:`.fenced`: the one fenced write (statement + transition rows + outbox rows, atomically);
- :mod:`.jobs`: :class:`Store`, the verbs of a task's path and the read of one job;
- :mod:`.admin`: the operator's and the recovery's verbs and reads, composed as ``store.admin``;
- :mod:`.blocks`: a fenced block's side of the store (its bounds, its commit check), composed as
  ``store.blocks``;
- :mod:`.pending`: what ``enqueue()`` writes in the caller's transaction, composed as
  ``store.pending``;
- :mod:`.urls`: whether a URL names the store's database;
- :mod:`.outbox`: the outbox's rows, composed as ``store.outbox_rows``;
- :mod:`.transitions`: the reads of the transition rows (history, last exit), composed as
  ``store.transitions``;
- :mod:`.beat`: the beat scheduler's last tick per entry, composed as ``store.beat_ticks``.

Its values (records, requests, effects) live in :mod:`celery_fence.store.records`.
"""

from __future__ import annotations

from celery_fence.schema import COMPLETED, DEAD, FAILED, PENDING, RETRYING, RUNNING, utcnow
from celery_fence.store.admin import UNFINISHED
from celery_fence.store.beat import BeatTick, BeatTicks
from celery_fence.store.jobs import Store
from celery_fence.store.outbox import OutboxRow, OutboxRows
from celery_fence.store.records import (
    Effect,
    JobRecord,
    Registration,
    Transition,
    decode_request,
    dumps_strict,
)

__all__ = [
    "COMPLETED",
    "DEAD",
    "FAILED",
    "PENDING",
    "RETRYING",
    "RUNNING",
    "UNFINISHED",
    "BeatTick",
    "BeatTicks",
    "Effect",
    "JobRecord",
    "OutboxRow",
    "OutboxRows",
    "Registration",
    "Store",
    "Transition",
    "decode_request",
    "dumps_strict",
    "utcnow",
]
