"""What ``enqueue()`` stores with a job is what recovery re-sends: every publish option it keeps
is one of the execution options a re-send reads back, and the due time is a UTC instant."""

from __future__ import annotations

import datetime as dt

from celery_fence import durable
from celery_fence.store.records import EXECUTION_OPTIONS


def test_every_stored_publish_option_is_re_sent() -> None:
    assert set(durable.PUBLISH_OPTIONS) | {"eta"} <= set(EXECUTION_OPTIONS)


def test_the_due_time_is_a_utc_instant() -> None:
    west = dt.timezone(dt.timedelta(hours=-5))
    at = dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=west)
    utc = dt.datetime(2030, 1, 2, 8, 4, 5, tzinfo=dt.timezone.utc)
    assert durable._due({"eta": at}) == utc
    assert durable._due({"eta": at}).tzinfo == dt.timezone.utc  # type: ignore[union-attr]
    assert durable._due({"eta": at.isoformat()}) == utc
    assert durable._due({"eta": utc.replace(tzinfo=None)}) == utc  # naive: UTC, as Celery
    assert durable._due({}) is None
