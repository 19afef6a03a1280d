"""A message sent with ``apply_async(serializer=..., compression=..., ignore_result=...)`` (not
through :func:`celery_fence.enqueue`) is re-sent as it was published: by recovery, from what the
worker stored at its claim, and by the fence's own re-send (a busy lease), from the message the
worker holds. Real workers on SQLite and PostgreSQL; the re-sent messages are read from the Redis
broker as a worker receives them (kombu's ``basic_get``) or, for one a worker already holds, as
the broker keeps it.
"""

from __future__ import annotations

import json
import uuid
from types import ModuleType
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_fence import recover
from celery_fence.adapters.sending import RESENDS_HEADER
from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.testing import faults
from tests.support import ledger
from tests.support.env import BROKER_URL
from tests.support.worker import SpawnWorker, wait_until

pytestmark = pytest.mark.acceptance

PICKLE = "application/x-python-serialize"
ZLIB = "application/x-gzip"  # kombu's compression header for "zlib"
PUBLISHED: dict[str, Any] = {
    "serializer": "pickle",
    "compression": "zlib",
    "ignore_result": True,
    "delivery_mode": 1,
}
#: How a message published with :data:`PUBLISHED` reads on the broker (:func:`_published`).
AS_PUBLISHED = {
    "content_type": PICKLE,
    "compression": ZLIB,
    "ignore_result": True,
    "delivery_mode": 1,
}
#: A worker that takes pickle (Celery refuses to start one as root unless told to).
PICKLE_WORKER = {"FENCE_T_ACCEPT": "json,pickle", "C_FORCE_ROOT": "1"}


def _published(content_type: str, headers: Any, properties: Any) -> dict[str, Any]:
    return {
        "content_type": content_type,
        "compression": headers.get("compression"),
        "ignore_result": headers.get("ignore_result"),
        "delivery_mode": properties.get("delivery_mode"),
    }


def _take_messages(queue: str) -> list[Any]:
    """Every message waiting in ``queue``, taken off it with kombu (as a worker receives it)."""
    out = []
    with Connection(BROKER_URL) as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            message.accept = {"application/json", PICKLE}
            out.append(message)
    return out


def _lose_unacked(broker: redis.Redis, task_id: str) -> int:
    """What a broker that lost the message a killed worker held leaves: nothing."""
    lost = 0
    for tag, raw in broker.hgetall("unacked").items():
        if json.loads(raw)[0]["headers"].get("id") == task_id:
            broker.hdel("unacked", tag)
            broker.zrem("unacked_index", tag)
            lost += 1
    return lost


def _raw_messages(broker: redis.Redis, queue: str, task_id: str) -> list[dict[str, Any]]:
    """The messages of ``task_id`` the Redis broker keeps: waiting in ``queue``, or held (unacked)
    by a worker, as published (content type, headers, properties). A message being fetched is in
    neither for a moment (moved from the list to the hash): use what a wait found, not a re-read."""
    raws = [json.loads(raw) for raw in broker.lrange(queue, 0, -1)]
    raws += [json.loads(raw)[0] for raw in broker.hgetall("unacked").values()]
    return [m for m in raws if m["headers"].get("id") == task_id]


def test_recovery_re_sends_a_worker_registered_job_as_apply_async_published_it(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
    worker_env: dict[str, str],
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    broker = redis.Redis.from_url(BROKER_URL)
    key = f"published:{uuid.uuid4().hex[:8]}"
    # Given a job sent with apply_async's publish options, claimed and registered by a worker
    # that is killed mid-body, its message then lost ...
    faults.arm(redis_client, prefix, "hang", key)
    worker = spawn_worker("doomed", **PICKLE_WORKER)
    sent = client_app.work.apply_async((key,), {"marker": "m"}, **PUBLISHED)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    worker.kill()
    assert _lose_unacked(broker, sent.id) == 1
    wait_until(lambda: leases.remaining(key)[0] is None, 10, what="lease expired")
    record = fence_store.get(key)
    assert record is not None and record.status == "running"
    # ... when recovery re-sends it,
    assert key in recover(client_app.app, older_than=0).sent
    (again,) = _take_messages(queue)
    broker.close()
    # then the re-sent message is published as apply_async published the first one.
    assert again.headers["fence_key"] == key
    assert _published(again.content_type, again.headers, again.properties) == AS_PUBLISHED
    args, kwargs, _ = again.decode()
    assert (list(args), kwargs) == ([key], {"marker": "m"})
    # (kept in the row the registration wrote)
    assert record.request is not None
    stored = record.request["execution"]
    assert (stored["serializer"], stored["compression"], stored["ignore_result"]) == (
        "pickle",
        ZLIB,
        True,
    )


def test_the_fences_own_re_send_keeps_the_messages_serializer_and_compression(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    broker = redis.Redis.from_url(BROKER_URL)
    key = f"busy:{uuid.uuid4().hex[:8]}"
    # Given a job whose key a hanging attempt holds ...
    faults.arm(redis_client, prefix, "hang", key)
    spawn_worker("w", concurrency=2, **PICKLE_WORKER)
    client_app.work.delay(key)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    # ... when a duplicate published with apply_async's options meets the busy lease,
    duplicate = client_app.work.apply_async((key,), {"marker": "dup"}, **PUBLISHED)

    def re_sent() -> list[dict[str, Any]]:
        found = _raw_messages(broker, queue, duplicate.id)
        return [m for m in found if m["headers"].get(RESENDS_HEADER)]  # a fence re-send

    found = wait_until(re_sent, 30, what="the duplicate re-sent")
    # then the fence's re-send is published as the duplicate was.
    message = found[0]
    published = _published(message["content-type"], message["headers"], message["properties"])
    assert published == AS_PUBLISHED
    faults.arm(redis_client, prefix, "unhang", key)
    wait_until(lambda: _status(fence_store, key) == "completed", 30, what="completed")
    broker.close()


def test_the_bodys_own_retry_keeps_the_messages_serializer_and_compression(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    broker = redis.Redis.from_url(BROKER_URL)
    key = f"retry:{uuid.uuid4().hex[:8]}"
    # Given a message published with apply_async's options whose body calls self.retry(),
    spawn_worker("w", **PICKLE_WORKER)
    sent = client_app.control.apply_async((key,), {"kind": "retry", "countdown": 60}, **PUBLISHED)

    def retried() -> list[dict[str, Any]]:
        found = _raw_messages(broker, queue, sent.id)
        return [m for m in found if m["headers"].get("retries")]  # the retry's message

    found = wait_until(retried, 30, what="the retry message published")
    # then the retry's message is published with the message's serializer and compression.
    message = found[0]
    published = _published(message["content-type"], message["headers"], message["properties"])
    assert (published["content_type"], published["compression"]) == (PICKLE, ZLIB)
    assert published["delivery_mode"] == 1
    wait_until(lambda: _status(fence_store, key) == "retrying", 30, what="retrying")
    broker.close()


def _status(store: Store, key: str) -> str | None:
    record = store.get(key)
    return None if record is None else record.status
