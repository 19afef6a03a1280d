"""The scheduled times every beat replica computes alike: interval ticks on multiples of the
interval since the epoch, a crontab's own due times, the keys, and the missed-tick policy."""

from __future__ import annotations

import datetime as dt

from celery import Celery
from celery.schedules import crontab, schedule

from celery_fence.beat import due_ticks, next_tick, tick_key

UTC = dt.timezone.utc


def at(h: int, m: int, s: float = 0) -> dt.datetime:
    return dt.datetime(2026, 12, 4, h, m, tzinfo=UTC) + dt.timedelta(seconds=s)


def test_interval_ticks_do_not_depend_on_when_a_replica_looks() -> None:
    every = schedule(dt.timedelta(seconds=15))
    assert next_tick(every, at(10, 0, 1.2)) == next_tick(every, at(10, 0, 14.9)) == at(10, 0, 15)
    assert next_tick(every, at(10, 0, 15)) == at(10, 0, 30)  # strictly after


def test_crontab_ticks_are_its_due_times() -> None:
    five = crontab(minute="*/5", app=Celery(set_as_current=False))
    assert next_tick(five, at(10, 5, 30)) == at(10, 10)
    assert next_tick(five, at(10, 10)) == at(10, 15)
    assert due_ticks(five, at(10, 5, 30), at(10, 21), missed="catch_up", catch_up_max=10) == [
        at(10, 10),
        at(10, 15),
        at(10, 20),
    ]
    assert due_ticks(five, at(10, 5, 30), at(10, 21), missed="skip", catch_up_max=10) == [
        at(10, 20)
    ]


def test_missed_interval_ticks_by_policy() -> None:
    every = schedule(2.0)
    after, now = at(10, 0, 1), at(10, 0, 11.5)
    assert due_ticks(every, after, now, missed="skip", catch_up_max=3) == [at(10, 0, 10)]
    assert due_ticks(every, after, now, missed="catch_up", catch_up_max=3) == [
        at(10, 0, 6),
        at(10, 0, 8),
        at(10, 0, 10),
    ]
    assert due_ticks(every, after, now, missed="catch_up", catch_up_max=99) == [
        at(10, 0, s) for s in (2, 4, 6, 8, 10)
    ]
    assert due_ticks(every, at(10, 0, 10), at(10, 0, 11.9), missed="skip", catch_up_max=3) == []


def test_the_key_is_utc_to_the_second() -> None:
    paris = dt.timezone(dt.timedelta(hours=1))
    when = dt.datetime(2026, 12, 4, 11, 0, 5, 999_000, tzinfo=paris)
    assert tick_key("report", when) == "beat:report:2026-12-04T10:00:05Z"


def test_a_crontab_is_read_in_the_apps_timezone_and_keyed_in_utc() -> None:
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    nightly = crontab(hour=3, minute=0, app=app)
    tick = next_tick(nightly, at(0, 0))
    assert tick == at(2, 0)  # 03:00 in Paris, in winter
    assert tick_key("nightly", tick) == "beat:nightly:2026-12-04T02:00:00Z"
