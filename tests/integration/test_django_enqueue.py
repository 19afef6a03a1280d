"""``celery_fence.contrib.django.enqueue(task, ...)`` (and the deprecated ``enqueue(None, ...)``)
on Django's connection against the real stores and the Redis broker,
without workers: the message goes with the outermost commit, and a row rolled back with a
savepoint — a nested ``atomic()`` or a manual ``transaction.savepoint()`` — sends nothing.

Django is configured by :mod:`tests.integration.test_django_atomic`'s fixtures (``default`` on
the session's PostgreSQL database, ``lite`` on the test's SQLite file).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from types import ModuleType

import pytest
import redis

import celery_fence
from celery_fence import ConfigurationError
from celery_fence.store import Store
from tests.integration.test_django_atomic import alias, django_setup  # noqa: F401 (fixtures)
from tests.support.env import BROKER_URL


def _queued(queue: str) -> int:
    return int(redis.Redis.from_url(BROKER_URL).llen(queue))


def _sent_keys(queue: str) -> list[str]:
    """The ``fence_key`` header of each message waiting in the Redis broker's queue."""
    raw = redis.Redis.from_url(BROKER_URL).lrange(queue, 0, -1)
    return sorted(json.loads(m)["headers"]["fence_key"] for m in raw)


def _status(store: Store, key: str) -> str | None:
    record = store.get(key)
    return None if record is None else record.status


def test_a_row_rolled_back_with_a_manual_savepoint_sends_nothing(
    alias: str,  # noqa: F811
    client_app: ModuleType,
    store: Store,
    worker_env: dict[str, str],
) -> None:
    from django.db import transaction

    from celery_fence.contrib.django import enqueue

    client_app.app.conf.fence_database = alias
    queue = worker_env["FENCE_T_QUEUE"]
    manual, nested, released, kept = (f"dj:{uuid.uuid4().hex[:8]}" for _ in range(4))
    utc = dt.datetime.now(dt.timezone.utc).replace(microsecond=0) + dt.timedelta(hours=2)
    eta = utc.astimezone(dt.timezone(dt.timedelta(hours=-5)))  # (Django's cursor: UTC too)

    # Given, in one atomic block, a job enqueued inside a manual savepoint rolled back, one inside
    # a nested atomic() rolled back, one inside a manual savepoint released, and one outside
    with transaction.atomic(using=alias):
        sid = transaction.savepoint(using=alias)
        assert enqueue(client_app.work, args=(manual,)).created
        transaction.savepoint_rollback(sid, using=alias)
        with pytest.raises(RuntimeError), transaction.atomic(using=alias):
            enqueue(client_app.work, args=(nested,))
            raise RuntimeError("rolled back to the nested block's savepoint")
        sid = transaction.savepoint(using=alias)
        enqueue(client_app.work, args=(released,))
        transaction.savepoint_commit(sid, using=alias)
        enqueue(client_app.work, args=(kept,), eta=eta)
        assert _queued(queue) == 0  # nothing before the commit
    # When the outermost block commits
    # Then only the jobs whose rows committed are sent, each once
    assert _status(store, manual) is None and _status(store, nested) is None
    assert _status(store, released) == "pending" and _status(store, kept) == "pending"
    assert _sent_keys(queue) == sorted([released, kept])
    record = store.get(kept)
    assert record is not None and record.retry_at is not None
    stored = record.retry_at
    assert (stored if stored.tzinfo else stored.replace(tzinfo=dt.timezone.utc)) == utc


def test_outside_atomic_it_is_refused(
    alias: str,  # noqa: F811
    client_app: ModuleType,
    store: Store,
    worker_env: dict[str, str],
) -> None:
    from celery_fence.contrib.django import enqueue

    client_app.app.conf.fence_database = alias
    key = f"dj:{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigurationError, match=r"transaction\.atomic"):
        enqueue(client_app.work, args=(key,))
    assert _status(store, key) is None and _queued(worker_env["FENCE_T_QUEUE"]) == 0


def test_enqueue_none_still_writes_on_djangos_connection_and_says_it_is_deprecated(
    alias: str,  # noqa: F811
    client_app: ModuleType,
    store: Store,
    worker_env: dict[str, str],
) -> None:
    from django.db import transaction

    client_app.app.conf.fence_database = alias
    queue = worker_env["FENCE_T_QUEUE"]
    kept, dropped = (f"dj:{uuid.uuid4().hex[:8]}" for _ in range(2))
    # Given the old spelling, celery_fence.enqueue(None, ...), in a committed atomic block and
    # in one rolled back
    with transaction.atomic(using=alias):
        with pytest.warns(DeprecationWarning, match=r"celery_fence\.contrib\.django\.enqueue"):
            assert celery_fence.enqueue(None, client_app.work, args=(kept,)).created
        assert _queued(queue) == 0
    with pytest.raises(RuntimeError), transaction.atomic(using=alias):
        with pytest.warns(DeprecationWarning):
            celery_fence.enqueue(None, client_app.work, args=(dropped,))
        raise RuntimeError("rolled back")
    # Then it did what contrib.django.enqueue does: the committed row, sent once; nothing else
    assert _status(store, kept) == "pending" and _status(store, dropped) is None
    assert _sent_keys(queue) == [kept]
