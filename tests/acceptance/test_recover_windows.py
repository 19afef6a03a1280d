"""Stranded jobs with real workers: lost messages, recoveries racing late originals, a requeue
killed between its commit and its send — each ends with exactly one completion.

The workload (tests/support/app.py) writes a ledger to Redis: one ``runs`` entry per body start,
one ``effects`` entry per side effect. A flag ``<prefix>:hang:<key>`` makes the body hang once
(so a worker can be killed or paused while it holds the key); ``<prefix>:unhang:<key>`` ends it.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import kombu
import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import JobRecord, Store
from celery_fence.testing import faults
from tests.integration.test_cli import APP, CELERY, fence_cli, ok
from tests.support import ledger
from tests.support.env import AMQP_URL, BROKER_URL
from tests.support.worker import ROOT, SpawnWorker, wait_until


@pytest.fixture
def broker(worker_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(BROKER_URL)
    yield client
    client.delete(worker_env["FENCE_T_QUEUE"])
    client.close()


def _status(store: Store, key: str) -> str | None:
    record = store.get(key)
    return None if record is None else record.status


def _completions(store: Store, key: str) -> int:
    return sum(1 for t in store.transitions.history(key) if t.action == "completed")


def _lease_gone(leases: LeaseStore, key: str) -> bool:
    return leases.remaining(key)[0] is None


def _unacked(broker: redis.Redis, key: str) -> list[tuple[Any, list[Any]]]:
    """The Redis broker's unacked entries (delivery tag, [message, exchange, routing key]) of
    messages for ``key`` — where a message sits while a killed worker had it."""
    found = []
    for tag, raw in broker.hgetall("unacked").items():
        entry = json.loads(raw)
        args = json.loads(base64.b64decode(entry[0]["body"]))[0]
        if args and args[0] == key:
            found.append((tag, entry))
    return found


def _message_key(raw: Any) -> Any:
    """The first argument (the key) of a message the Redis broker holds in a queue."""
    body = json.loads(base64.b64decode(json.loads(raw)["body"]))
    return body[0][0] if body and body[0] else None


def _queued(broker: redis.Redis, queue: str, key: str) -> int:
    """This key's messages in ``queue`` (recover scans every row of the store: another job's
    stranded row, re-sent without routing, lands in the app's default queue too)."""
    return sum(1 for raw in broker.lrange(queue, 0, -1) if _message_key(raw) == key)


def _lose_unacked(broker: redis.Redis, key: str) -> int:
    """What a broker that lost the message leaves: nothing (no redelivery, ever)."""
    entries = _unacked(broker, key)
    for tag, _ in entries:
        broker.hdel("unacked", tag)
        broker.zrem("unacked_index", tag)
    return len(entries)


def _redeliver_unacked(broker: redis.Redis, key: str, queue: str) -> int:
    """What the Redis broker does once the visibility timeout passed: the original message goes
    back to its queue (here, at once)."""
    entries = _unacked(broker, key)
    for tag, (message, _exchange, _routing_key) in entries:
        broker.lpush(queue, json.dumps(message))
        broker.hdel("unacked", tag)
        broker.zrem("unacked_index", tag)
    return len(entries)


def _claimed_then_killed(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    key: str,
    **kw: Any,
) -> Any:
    """A worker claims ``key`` and is SIGKILLed (main process and pool) while the body runs."""
    faults.arm(redis_client, prefix, "hang", key)
    worker = spawn_worker("doomed", **kw)
    client_app.work.delay(key)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    worker.kill()
    return worker


def _one_completion(store: Store, redis_client: redis.Redis, prefix: str, key: str) -> JobRecord:
    record = store.get(key)
    assert record is not None and record.status == "completed"
    assert _completions(store, key) == 1
    effects = ledger.effects(redis_client, prefix, key)
    assert effects == [f"{record.generation}:{record.attempt_id}"]
    assert record.result["attempt_id"] == record.attempt_id
    return record


def test_a_claimed_job_whose_worker_died_and_message_was_lost_is_recovered_once(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
    worker_env: dict[str, str],
) -> None:
    # Given a job claimed by a worker that was killed, its message lost (purged queue, lost
    # unacked message) ...
    key = f"lost:{uuid.uuid4().hex[:8]}"
    _claimed_then_killed(spawn_worker, client_app, redis_client, prefix, key)
    broker.delete(worker_env["FENCE_T_QUEUE"])
    assert _lose_unacked(broker, key) == 1
    wait_until(lambda: _lease_gone(leases, key), 10, what="lease expired")
    assert _status(fence_store, key) == "running"  # stranded: no lease, no message
    spawn_worker("rescuer")
    # ... when recover runs (ls --stuck shows the job first),
    stuck = json.loads(ok(fence_cli(worker_env, "ls", "--stuck", "--older-than", "1", "--json")))
    assert key in {j["key"] for j in stuck}
    out = ok(fence_cli(worker_env, "recover", "--older-than", "1"))
    assert f"{key}: re-sent" in out
    # then it completes exactly once, under its key, with a newer generation.
    wait_until(lambda: _status(fence_store, key) == "completed", 30, what="completed")
    record = _one_completion(fence_store, redis_client, prefix, key)
    assert record.generation == 2 and record.attempts == 2
    assert ledger.run_count(redis_client, prefix, key) == 2
    assert "recovered" in [t.action for t in fence_store.transitions.history(key)]
    assert key not in ok(fence_cli(worker_env, "ls", "--stuck", "--older-than", "0"))


def test_a_late_original_message_racing_the_recovery_yields_one_completion(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    pg_url: str,
    leases: LeaseStore,
    worker_env: dict[str, str],
) -> None:
    store = Store(pg_url)
    env = {**worker_env, "FENCE_T_DB": pg_url}
    # Given a stranded job whose original message is not lost, only late ...
    key = f"late:{uuid.uuid4().hex[:8]}"
    _claimed_then_killed(spawn_worker, client_app, redis_client, prefix, key, FENCE_T_DB=pg_url)
    wait_until(lambda: _lease_gone(leases, key), 10, what="lease expired")
    # ... when a recovery re-sends it and the original comes back at the same moment,
    assert f"{key}: re-sent" in ok(fence_cli(env, "recover", "--older-than", "1"))
    assert _redeliver_unacked(broker, key, worker_env["FENCE_T_QUEUE"]) == 1
    assert _queued(broker, worker_env["FENCE_T_QUEUE"], key) == 2
    spawn_worker("racer", concurrency=2, FENCE_T_DB=pg_url)  # both messages at once
    # then one of them completes it and the other converges on that result.
    wait_until(lambda: _status(store, key) == "completed", 30, what="completed")
    wait_until(
        lambda: _queued(broker, worker_env["FENCE_T_QUEUE"], key) == 0, 30, what="both consumed"
    )
    wait_until(lambda: not _unacked(broker, key), 30, what="both acked")
    _one_completion(store, redis_client, prefix, key)
    assert ledger.run_count(redis_client, prefix, key) in (2, 3)  # killed run + one or both
    store.dispose()


def test_a_paused_original_attempt_loses_to_the_recovery(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    pg_url: str,
    leases: LeaseStore,
    worker_env: dict[str, str],
) -> None:
    store = Store(pg_url)
    env = {**worker_env, "FENCE_T_DB": pg_url}
    # Given an attempt paused (SIGSTOP) mid-body past its lease, that never checks its lease ...
    key = f"paused:{uuid.uuid4().hex[:8]}"
    faults.arm(redis_client, prefix, "hang", key)
    paused = spawn_worker("paused", FENCE_T_DB=pg_url)
    client_app.work.delay(key, check=False)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    paused.pause()
    wait_until(lambda: _lease_gone(leases, key), 10, what="lease expired")
    # ... when recovery re-sends it and another worker completes it,
    spawn_worker("rescuer", FENCE_T_DB=pg_url)
    assert f"{key}: re-sent" in ok(fence_cli(env, "recover", "--older-than", "1"))
    wait_until(lambda: _status(store, key) == "completed", 30, what="completed")
    done = store.get(key)
    assert done is not None
    # then the original, resumed, performs its effect (it never checks) but cannot complete.
    faults.arm(redis_client, prefix, "unhang", key)
    paused.resume()
    wait_until(lambda: len(ledger.effects(redis_client, prefix, key)) == 2, 30, what="late effect")
    wait_until(
        lambda: "stale" in [t.action for t in store.transitions.history(key)],
        30,
        what="stale rejected",
    )
    after = store.get(key)
    assert after is not None and (after.attempt_id, after.result) == (done.attempt_id, done.result)
    assert _completions(store, key) == 1
    store.dispose()


def _blackhole() -> socket.socket:
    """A listening socket that never accepts: a connection to it hangs (a broker gone silent)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def test_a_requeue_killed_between_commit_and_send_is_finished_by_recover(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    # Given a dead job (2 attempts, both failed; the cause is fixed now) ...
    spawn_worker("w", FENCE_T_MAX_ATTEMPTS="2")
    key = f"requeue:{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}:fail_times:{key}", 2)
    client_app.work.delay(key, fail="transient")
    wait_until(lambda: _status(fence_store, key) == "dead", 60, what="dead")
    # ... and a requeue that commits 'pending' and is killed while it sends (a silent broker),
    silent = _blackhole()
    port = silent.getsockname()[1]
    proc = subprocess.Popen(
        [CELERY, "-A", APP, "fence", "requeue", key],
        cwd=ROOT,
        env={
            **os.environ,
            **worker_env,
            "FENCE_T_BROKER": f"redis://127.0.0.1:{port}/0",
            "FENCE_T_BACKEND": BROKER_URL,
            "PYTHONPATH": str(ROOT),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: _status(fence_store, key) == "pending", 30, what="requeue committed")
        assert proc.poll() is None  # still sending
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        silent.close()
    assert _status(fence_store, key) == "pending"  # committed, never sent
    # when recover runs, the job runs again under its key and completes once.
    assert f"{key}: re-sent" in ok(fence_cli(worker_env, "recover", "--older-than", "0"))
    wait_until(lambda: _status(fence_store, key) == "completed", 30, what="completed")
    _one_completion(fence_store, redis_client, prefix, key)


def test_rabbitmq_topic_exchange_a_purged_job_is_recovered_to_its_queue(
    spawn_worker: SpawnWorker,
    redis_client: redis.Redis,
    prefix: str,
    sqlite_url: str,
    leases: LeaseStore,
    worker_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib
    import sys

    env = {
        **worker_env,
        "FENCE_T_DB": sqlite_url,
        "FENCE_T_BROKER": AMQP_URL,
        "FENCE_T_BACKEND": BROKER_URL,
        "FENCE_T_TOPIC": "1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("tests.support.app", None)
    client = importlib.import_module("tests.support.app")
    store = Store(sqlite_url)
    queue = worker_env["FENCE_T_QUEUE"]
    try:
        # Given a job delivered through a topic exchange, claimed, its worker killed and its
        # queue purged (RabbitMQ gave the unacked message back; the operator purged it) ...
        key = f"topic:{uuid.uuid4().hex[:8]}"
        faults.arm(redis_client, prefix, "hang", key)
        worker = spawn_worker("doomed", **env)
        client.work.apply_async(
            (key,), exchange=f"{queue}-topic", routing_key=f"{queue}.work.eu"
        )  # matches the queue's binding "<queue>.#"
        wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="started")
        stored = store.get(key)
        assert stored is not None and stored.request is not None
        assert stored.request["options"]["exchange"] == f"{queue}-topic"
        assert stored.request["options"]["routing_key"] == f"{queue}.work.eu"
        worker.kill()
        with kombu.Connection(AMQP_URL) as conn:
            wait_until(lambda: conn.default_channel.queue_purge(queue) or 0, 15, what="purged")
        wait_until(lambda: _lease_gone(leases, key), 10, what="lease expired")
        # ... when recover runs,
        out = ok(fence_cli(env, "recover", "--older-than", "1"))
        assert f"{key}: re-sent" in out
        # then the message reaches the queue through the exchange and routing key as delivered,
        spawn_worker("rescuer", **env)
        wait_until(lambda: _status(store, key) == "completed", 30, what="completed")
        _one_completion(store, redis_client, prefix, key)
        record = store.get(key)
        assert record is not None and record.request is not None
        assert record.request["options"]["routing_key"] == f"{queue}.work.eu"
    finally:
        with kombu.Connection(AMQP_URL) as conn:
            conn.default_channel.queue_delete(queue)
            conn.default_channel.exchange_delete(f"{queue}-topic")
        client.app.close()
        kombu.pools.reset()  # the AMQP connections (kombu's pools are global)
        sys.modules.pop("tests.support.app", None)
        store.dispose()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_live_attempt_of_a_task_with_its_own_redis_and_prefix_is_not_taken_for_stranded(
    request: pytest.FixtureRequest,
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    # Given a task whose leases live in its own Redis database under its own key prefix,
    # running (its lease renewed) ...
    key = f"own:{uuid.uuid4().hex[:8]}"
    own_redis = redis.Redis.from_url(client_app.OWN_REDIS)

    def cleanup() -> None:
        for k in own_redis.scan_iter(f"{client_app.OWN_PREFIX}:*", count=1000):
            own_redis.delete(k)
        own_redis.close()

    request.addfinalizer(cleanup)
    own = LeaseStore(own_redis, prefix=client_app.OWN_PREFIX)
    faults.arm(redis_client, prefix, "hang", key)
    env = {**worker_env, "FENCE_T_OWN_REDIS": "1"}
    spawn_worker("holder", FENCE_T_OWN_REDIS="1")
    client_app.own_prefix.delay(key)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    assert own.remaining(key)[0] is not None  # held, in the task's Redis, under its prefix
    assert LeaseStore(redis_client, prefix=client_app.OWN_PREFIX).remaining(key)[0] is None
    # ... and whose row has not moved for longer than the threshold (its own is 2 s),
    wait_until(
        lambda: _quiet_for(fence_store, key) > 2.5, 10, what="row unchanged past the threshold"
    )
    # when recover runs, with the task's own threshold and with an explicit one,
    first = json.loads(ok(fence_cli(env, "recover", "--json")))
    second = json.loads(ok(fence_cli(env, "recover", "--older-than", "1", "--json")))
    # then the live attempt is left alone, and completes.
    assert key not in first["keys"]["stranded"] + second["keys"]["stranded"]
    assert _status(fence_store, key) == "running"
    faults.arm(redis_client, prefix, "unhang", key)
    wait_until(lambda: _status(fence_store, key) == "completed", 30, what="completed")
    assert _completions(fence_store, key) == 1
    assert ledger.run_count(redis_client, prefix, key) == 1


def _quiet_for(store: Store, key: str) -> float:
    """Seconds since the job's row last moved."""
    record = store.get(key)
    if record is None:
        return 0.0
    moved = record.updated_at
    if moved.tzinfo is None:
        moved = moved.replace(tzinfo=dt.timezone.utc)
    return (dt.datetime.now(dt.timezone.utc) - moved).total_seconds()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_job_revoked_with_terminate_ends_dead_and_recover_leaves_it(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
    worker_env: dict[str, str],
) -> None:
    # Given a fenced job running on a prefork worker ...
    key = f"revoked:{uuid.uuid4().hex[:8]}"
    faults.arm(redis_client, prefix, "hang", key)
    spawn_worker("w")
    result = client_app.work.delay(key)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    # ... when it is revoked with terminate=True,
    client_app.app.control.revoke(result.id, terminate=True)
    # then its job is recorded dead, reason "revoked", and its message is gone (acked),
    wait_until(lambda: _status(fence_store, key) == "dead", 30, what="recorded dead")
    dead = [t for t in fence_store.transitions.history(key) if t.action == "dead"]
    assert [t.reason for t in dead] == ["revoked"]
    wait_until(lambda: _lease_gone(leases, key), 10, what="lease expired")
    wait_until(lambda: not _unacked(broker, key), 10, what="message acked")
    # and a recovery past the threshold does not re-send it.
    report = json.loads(ok(fence_cli(worker_env, "recover", "--older-than", "0", "--json")))
    assert key not in report["keys"]["stranded"]
    assert _queued(broker, worker_env["FENCE_T_QUEUE"], key) == 0
    assert _status(fence_store, key) == "dead"
    assert ledger.run_count(redis_client, prefix, key) == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("first", ["revoke recorded first", "body settled first"])
def test_a_job_revoked_with_terminate_on_a_gevent_worker_ends_dead_and_releases_its_lease(
    first: str,
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    fence_store: Store,
    leases: LeaseStore,
    worker_env: dict[str, str],
) -> None:
    # Given a fenced job running on a gevent-pool worker whose leases live 30 s ...
    key = f"revoked-green:{uuid.uuid4().hex[:8]}"
    faults.arm(redis_client, prefix, "hang", key)
    # (each order is forced: the other side waits 2 s)
    delay = (
        {"FENCE_T_UNRUN_DELAY": "2"}
        if first == "body settled first"
        else {"FENCE_T_INTERRUPT_SETTLE_DELAY": "2"}
    )
    spawn_worker("w", pool="gevent", concurrency=2, FENCE_T_TTL="30", FENCE_T_RENEW="5", **delay)
    result = client_app.work.delay(key)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    assert not _lease_gone(leases, key)
    # ... when it is revoked with terminate=True (GreenletExit in the body, whose settle step
    # writes `retrying`, while the worker records the revoke: either may reach the store first),
    client_app.app.control.revoke(result.id, terminate=True)
    # then its job is recorded dead, reason "revoked",
    wait_until(lambda: _status(fence_store, key) == "dead", 30, what="recorded dead")
    # its lease released (long before its 30 s TTL), its message acked and not re-sent,
    wait_until(lambda: _lease_gone(leases, key), 10, what="lease released")
    history = [(t.action, t.reason) for t in fence_store.transitions.history(key)]
    assert [reason for action, reason in history if action == "dead"] == ["revoked"]
    if first == "body settled first":
        assert history[:3] == [
            ("claimed", None),
            ("retry_scheduled", "interrupted by GreenletExit"),
            ("dead", "revoked"),
        ], history
    else:  # the body's settle then finds the job dead: its retry is refused (stale)
        assert history[:2] == [("claimed", None), ("dead", "revoked")], history
    wait_until(lambda: not _unacked(broker, key), 10, what="message acked")
    assert _queued(broker, worker_env["FENCE_T_QUEUE"], key) == 0
    record = fence_store.get(key)
    assert record is not None and record.status == "dead"
    # and a recovery past the threshold does not re-send it.
    report = json.loads(ok(fence_cli(worker_env, "recover", "--older-than", "0", "--json")))
    assert key not in report["keys"]["stranded"]
    assert _status(fence_store, key) == "dead"
    assert ledger.run_count(redis_client, prefix, key) == 1


def _revoked_while_waiting_for_its_retry(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    broker: redis.Redis,
    fence_store: Store,
    key: str,
    countdown: float,
    **worker: Any,
) -> Any:
    """A fenced job (``fence_key`` set) whose body called ``self.retry(countdown=...)``: its row
    ``retrying``, its retry message held by the worker until its ETA (unacked, the queue empty);
    then ``revoke(task id)`` (no terminate). Returns the worker."""
    started = spawn_worker("w", **worker)
    queue = started.queue
    result = client_app.control.delay(key, kind="retry", countdown=countdown)
    wait_until(
        lambda: (
            _status(fence_store, key) == "retrying"
            and _queued(broker, queue, key) == 0
            and len(_unacked(broker, key)) == 1
        ),
        30,
        what="the retry held by the worker",
    )
    client_app.app.control.revoke(result.id)
    return started


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_revoked_retry_of_a_fenced_job_ends_it_dead_and_recover_leaves_it(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    # Given a fenced job waiting for its retry (3 s), whose task id is revoked meanwhile ...
    key = f"revoked-retry:{uuid.uuid4().hex[:8]}"
    worker = _revoked_while_waiting_for_its_retry(
        spawn_worker, client_app, broker, fence_store, key, 3.0
    )
    # when the worker sees the revoke (at the retry's ETA), the job is recorded dead, reason
    # "revoked", and its message acked,
    wait_until(lambda: _status(fence_store, key) == "dead", 30, what="recorded dead")
    dead = [t for t in fence_store.transitions.history(key) if t.action == "dead"]
    assert [t.reason for t in dead] == ["revoked"]
    wait_until(lambda: not _unacked(broker, key), 10, what="message acked")
    # and once the worker restarted (its revoked set is gone), a recovery past the threshold
    # does not run it again.
    worker.stop()
    spawn_worker("w2")
    report = json.loads(ok(fence_cli(worker_env, "recover", "--older-than", "0", "--json")))
    assert key not in report["keys"]["stranded"]
    assert _queued(broker, worker_env["FENCE_T_QUEUE"], key) == 0
    assert _status(fence_store, key) == "dead"
    assert ledger.run_count(redis_client, prefix, key) == 1


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("statedb", [True, False], ids=["statedb", "no-statedb"])
def test_a_retry_revoked_then_restarted_before_the_worker_saw_it_needs_the_statedb(
    statedb: bool,
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
    tmp_path: Path,
) -> None:
    # Given a fenced job waiting for its retry (8 s), revoked, on a worker that is stopped
    # before the retry's ETA (its message goes back to the broker unseen) ...
    key = f"revoked-restart:{uuid.uuid4().hex[:8]}"
    state = ("--statedb", str(tmp_path / "worker.state")) if statedb else ()
    worker = _revoked_while_waiting_for_its_retry(
        spawn_worker, client_app, broker, fence_store, key, 8.0, extra_args=state
    )
    time.sleep(1.0)  # the revoke broadcast reaches the worker
    worker.stop()
    assert _status(fence_store, key) == "retrying"
    # when a worker starts again,
    spawn_worker("w2", extra_args=state)
    if statedb:
        # then with --statedb (Celery keeps its revoked ids there) the job ends dead, reason
        # "revoked", and recovery leaves it;
        wait_until(lambda: _status(fence_store, key) == "dead", 30, what="recorded dead")
        dead = [t for t in fence_store.transitions.history(key) if t.action == "dead"]
        assert [t.reason for t in dead] == ["revoked"]
        report = json.loads(ok(fence_cli(worker_env, "recover", "--older-than", "0", "--json")))
        assert key not in report["keys"]["stranded"]
        time.sleep(1.0)
        assert ledger.run_count(redis_client, prefix, key) == 1
    else:
        # without it the new worker never heard of the revoke (Celery keeps revoked ids in
        # memory): the retry runs, once, and the job completes.
        wait_until(lambda: _status(fence_store, key) == "completed", 30, what="completed")
        assert ledger.run_count(redis_client, prefix, key) == 2
        assert _completions(fence_store, key) == 1


def test_recover_does_not_re_send_a_backlogged_job_once_per_pass(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    broker: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    from celery_fence.ops.recovery import recover

    # Given a job left running by a worker that died (no lease), and no worker consuming its
    # queue (a backlog: every re-send waits there) ...
    queue = worker_env["FENCE_T_QUEUE"]
    key = f"backlog:{uuid.uuid4().hex[:8]}"
    request = {
        "task": client_app.work.name,
        "id": uuid.uuid4().hex,
        "args": [key],
        "kwargs": {},
        "options": {"routing_key": queue, "exchange": "", "priority": None},
    }
    fence_store.register(
        key, generation=1, attempt_id="gone", task_name=request["task"], request=request
    )
    # when recovery runs every 1.1 s with a 1 s threshold, six times,
    sent = 0
    for _ in range(6):
        time.sleep(1.1)
        sent += recover(client_app.app, older_than=1.0).sent.count(key)  # (this key's re-sends)
    # then the re-sent message, still waiting in the queue, is not re-sent at every pass: each
    # re-send nobody claimed doubles the wait before the next (1, 2, 4 thresholds),
    mine = [m for m in broker.lrange(queue, 0, -1) if _message_key(m) == key]
    assert len(mine) == sent  # (this key's messages only)
    assert sent <= 3, sent
    # while fence ls --stuck lists it all along (the back-off is for re-sends only),
    time.sleep(1.1)
    stuck = json.loads(ok(fence_cli(worker_env, "ls", "--stuck", "--older-than", "1", "--json")))
    assert key in {j["key"] for j in stuck}
    # and once a worker consumes the backlog, the job completes once (the others replay).
    spawn_worker("w")
    wait_until(lambda: _status(fence_store, key) == "completed", 30, what="completed")
    wait_until(
        lambda: _queued(broker, queue, key) == 0 and not _unacked(broker, key), 30, what="drained"
    )
    assert _completions(fence_store, key) == 1
    assert ledger.run_count(redis_client, prefix, key) == 1
