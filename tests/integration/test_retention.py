"""Retention: the beat task deletes completed jobs older than ``fence_retention``, only those."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from celery import Celery

from celery_fence import install
from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError
from celery_fence.ops.retention import PURGE_TASK, purge_expired
from celery_fence.store import Store
from celery_fence.store.records import Completion, Dead


def _app(db_url: str, **settings: object) -> Celery:
    app = Celery(f"retention-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(fence_database_url=db_url, **settings)
    return app


def test_completed_jobs_older_than_the_retention_go_the_rest_stay(
    store: Store, db_url: str
) -> None:
    # Given a completed job, a dead one and a running one, all finished or moved just now
    done, dead, running = (f"ret:{uuid.uuid4().hex}" for _ in range(3))
    for key in (done, dead, running):
        store.register(key, generation=1, attempt_id="A", task_name="t")
    store.end(done, Completion(generation=1, attempt_id="A", result=1))
    store.end(dead, Dead(generation=1, attempt_id="A", error=ValueError("x"), reason="r"))
    app = _app(db_url, fence_retention=86400)
    # When the purge runs now, then a day and a minute later
    purge_expired(app)
    assert store.get(done) is not None  # younger than a day: kept
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1, minutes=1)
    assert purge_expired(app, now=later) >= 1
    # Then only the completed job and its history are gone
    assert store.get(done) is None and store.transitions.history(done) == []
    assert store.get(dead) is not None and store.get(running) is not None
    # And the beat task is registered under its public name once the app is installed (here by
    # hand: the app has no fenced task of its own)
    install(app)
    assert PURGE_TASK in app.tasks


def test_no_retention_set_deletes_nothing(store: Store, db_url: str) -> None:
    key = f"ret:{uuid.uuid4().hex}"
    store.register(key, generation=1, attempt_id="A", task_name="t")
    store.end(key, Completion(generation=1, attempt_id="A", result=1))
    far = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=3650)
    assert purge_expired(_app(db_url), now=far) == 0
    assert store.get(key) is not None


def test_a_retention_shorter_than_an_hour_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigurationError) as err:
        FenceConfig.from_mapping({"CELERY_FENCE_RETENTION": 60})
    assert "CELERY_FENCE_RETENTION" in str(err.value) and "late redelivery" in str(err.value)
