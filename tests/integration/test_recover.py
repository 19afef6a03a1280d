"""Stranded jobs: the store's scan and compare-and-set, ``fence ls --stuck``, ``fence recover``
and ``fence requeue --force`` against real Redis (leases and broker) and SQLite/PostgreSQL.

The messages a recovery sends are read back from the Redis broker's queue list (no worker):
task name, task id, key header, arguments and routing. ``tests/acceptance/test_recover_windows.py``
runs them through real workers.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import importlib
import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.ops import recovery
from celery_fence.store import JobRecord, Store
from celery_fence.store.records import Completion, Dead, DeadUnregistered, RetryScheduled
from tests.integration.test_cli import assert_one_line_error, fence_cli, ok
from tests.support.env import BROKER_URL

WORK = "tests.support.app.work"


@pytest.fixture
def broker(worker_env: dict[str, str]) -> Iterator[redis.Redis]:
    """The Redis broker; this test's queue is deleted afterwards."""
    client = redis.Redis.from_url(BROKER_URL)
    yield client
    client.delete(worker_env["FENCE_T_QUEUE"])
    client.close()


def _request(key: str, queue: str, **options: Any) -> dict[str, Any]:
    return {
        "task": WORK,
        "args": [key],
        "kwargs": {"marker": "m"},
        "options": {"routing_key": queue, "exchange": queue, "priority": None, **options},
    }


def _stranded(
    store: Store, queue: str, status: str, *, key: str | None = None, generation: int = 1
) -> JobRecord:
    """A job left ``status`` by an attempt whose lease is gone (none was ever taken in Redis)."""
    key = key or f"stuck:{uuid.uuid4().hex[:10]}"
    attempt = uuid.uuid4().hex
    store.register(
        key,
        generation=generation,
        attempt_id=attempt,
        task_name=WORK,
        request=_request(key, queue),
    )
    if status == "retrying":
        store.end(
            key,
            RetryScheduled(
                generation=generation,
                attempt_id=attempt,
                error=ConnectionError("down"),
                retry_at=dt.datetime.now(dt.timezone.utc),
                reason="test",
            ),
        )
    elif status == "completed":
        store.end(key, Completion(generation=generation, attempt_id=attempt, result=1))
    elif status == "dead":
        store.end(
            key, Dead(generation=generation, attempt_id=attempt, error=ValueError("x"), reason="t")
        )
    record = store.get(key)
    assert record is not None and record.status == status
    return record


def _messages(broker: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The messages waiting in a Redis-broker queue: headers, body and delivery info."""
    out = []
    for raw in broker.lrange(queue, 0, -1):
        message = json.loads(raw)
        body = json.loads(base64.b64decode(message["body"]))
        out.append({**message, "body": body})
    return out


# -- the store ------------------------------------------------------------------------------------


def test_stranded_is_unfinished_and_not_moved_and_the_take_is_compare_and_set(
    fence_store: Store, prefix: str
) -> None:
    queue = f"{prefix}-q"
    running = _stranded(fence_store, queue, "running")
    retrying = _stranded(fence_store, queue, "retrying")
    done = _stranded(fence_store, queue, "completed")
    dead = _stranded(fence_store, queue, "dead")
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=60)

    def keys(**kw: Any) -> set[str]:
        return {r.key for r in fence_store.admin.stranded(**kw)} & {
            running.key,
            retrying.key,
            done.key,
            dead.key,
        }

    # Not moved for 30 s as seen 60 s from now: both unfinished jobs; finished ones never.
    assert keys(older_than=30, now=later) == {running.key, retrying.key}
    # Moved less than 120 s before then: none.
    assert keys(older_than=120, now=later) == set()
    # A retry due only in the future is not stranded until its retry time has passed too.
    future = _stranded(fence_store, queue, "running")
    fence_store.end(
        future.key,
        RetryScheduled(
            generation=1,
            attempt_id=future.attempt_id,
            error=None,
            retry_at=later + dt.timedelta(seconds=600),
            reason="test",
        ),
    )
    assert future.key not in {r.key for r in fence_store.admin.stranded(older_than=30, now=later)}

    # Two recoveries that read the same row: one takes it, the other gets None.
    first = fence_store.admin.take_for_resend(running, reason="test")
    second = fence_store.admin.take_for_resend(running, reason="test")
    assert first is not None and first.status == "pending" and second is None
    stored = fence_store.get(running.key)
    assert stored is not None
    assert (stored.status, stored.generation, stored.attempts) == ("pending", 1, 1)
    assert [t.action for t in fence_store.transitions.history(running.key)][-1] == "recovered"
    # The attempt that was running cannot write any more (its writes need ``running``).
    with pytest.raises(Exception, match="rejected"):
        fence_store.end(
            running.key, Completion(generation=1, attempt_id=running.attempt_id, result=2)
        )


def test_a_requeued_unkeyed_message_whose_key_fails_again_goes_back_to_dead(
    fence_store: Store,
) -> None:
    key = f"unkeyed:{WORK}:{uuid.uuid4().hex}"
    assert fence_store.end(
        key,
        DeadUnregistered(
            task_name=WORK, request={"task": WORK}, error=ValueError("1"), reason="fence_key"
        ),
    )
    fence_store.admin.requeue(key)
    assert (fence_store.get(key) or pytest.fail()).status == "pending"
    assert fence_store.end(
        key,
        DeadUnregistered(
            task_name=WORK, request={"task": WORK}, error=ValueError("2"), reason="fence_key"
        ),
    )
    record = fence_store.get(key)
    assert record is not None and record.status == "dead" and record.error_message == "2"
    # a dead (or any other) row is never overwritten by a DeadUnregistered ending
    assert not fence_store.end(
        key,
        DeadUnregistered(task_name=WORK, request=None, error=ValueError("3"), reason="fence_key"),
    )


# -- the CLI --------------------------------------------------------------------------------------


def test_ls_stuck_and_recover_resend_stranded_jobs_under_their_key(
    fence_store: Store,
    worker_env: dict[str, str],
    leases: LeaseStore,
    broker: redis.Redis,
    prefix: str,
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    running = _stranded(fence_store, queue, "running")
    retrying = _stranded(fence_store, queue, "retrying")
    # a job left pending by a requeue that died between its commit and its send
    requeued = _stranded(fence_store, queue, "dead")
    fence_store.admin.requeue(requeued.key)
    # held: unfinished and not moved, but a live lease holds it
    held = _stranded(fence_store, queue, "running")
    token = uuid.uuid4().hex
    generation = leases.claim(held.key, token, 30_000)
    ours = {running.key, retrying.key, requeued.key, held.key}

    # ls --stuck lists exactly the stranded ones (not the one a lease holds)
    listed = json.loads(ok(fence_cli(worker_env, "ls", "--stuck", "--older-than", "0", "--json")))
    assert {j["key"] for j in listed} & ours == {running.key, retrying.key, requeued.key}
    # at the default thresholds, the running job whose lease is gone is stranded at once; the
    # others have not been quiet for 3 x TTL yet (TTL 30 s here: a slow CLI start on a loaded
    # machine must not age the rows past the default threshold)
    slow = {**worker_env, "FENCE_T_TTL": "30"}
    default = json.loads(ok(fence_cli(slow, "ls", "--stuck", "--json")))
    assert {j["key"] for j in default} & ours == {running.key}

    # --dry-run sends nothing and changes nothing
    dry = json.loads(
        ok(fence_cli(worker_env, "recover", "--older-than", "0", "--dry-run", "--json"))
    )
    assert set(dry["keys"]["stranded"]) & ours == {running.key, retrying.key, requeued.key}
    assert dry["sent"] == 0 and broker.llen(queue) == 0
    assert (fence_store.get(running.key) or pytest.fail()).status == "running"

    report = json.loads(ok(fence_cli(worker_env, "recover", "--older-than", "0", "--json")))
    assert set(report["keys"]["sent"]) & ours == {running.key, retrying.key, requeued.key}
    messages = [m for m in _messages(broker, queue) if m["body"][0][0] in ours]
    assert sorted(m["body"][0][0] for m in messages) == sorted(
        [running.key, retrying.key, requeued.key]
    )
    for m in messages:
        key = m["body"][0][0]
        assert m["headers"]["task"] == WORK
        assert m["headers"]["fence_key"] == key  # the key travels with the message
        assert m["body"][1] == {"marker": "m"}
        assert m["properties"]["delivery_info"]["routing_key"] == queue
        record = fence_store.get(key)
        assert record is not None and record.status == "pending"
        assert record.attempts == (0 if key == requeued.key else 1)  # a requeue reset it
        before = {running.key: running, retrying.key: retrying, requeued.key: requeued}[key]
        assert record.updated_at > before.updated_at  # it moved: the threshold starts again
    leases.release(leases.keys_for(held.key).lease, f"{token}:{generation}")


def test_a_stranded_job_behind_more_held_jobs_than_the_limit_is_still_found(
    fence_store: Store,
    worker_env: dict[str, str],
    leases: LeaseStore,
    broker: redis.Redis,
    client_app: ModuleType,
) -> None:
    # Given more long-running jobs than the scan's limit, older than the threshold but each held
    # by a live lease (healthy: recovery must leave them), and a stranded job newer than them all
    queue = worker_env["FENCE_T_QUEUE"]
    held = [_stranded(fence_store, queue, "running") for _ in range(3)]
    token = uuid.uuid4().hex
    claims = [(r.key, leases.claim(r.key, token, 30_000)) for r in held]
    stuck = _stranded(fence_store, queue, "running")
    try:
        # When ls --stuck and recover look with a limit of 2
        listed = json.loads(
            ok(
                fence_cli(
                    worker_env, "ls", "--stuck", "--older-than", "0", "--limit", "2", "--json"
                )
            )
        )
        report = recovery.recover(client_app.app, older_than=0, limit=2)
        # Then the scan goes past the held ones: the stranded job is listed and re-sent once
        assert stuck.key in {j["key"] for j in listed}
        assert report.sent.count(stuck.key) == 1
        assert not {r.key for r in held} & set(report.stranded)
        assert [m["body"][0][0] for m in _messages(broker, queue)] == [stuck.key]
    finally:
        for key, generation in claims:
            leases.release(leases.keys_for(key).lease, f"{token}:{generation}")


def test_ls_stuck_filters_before_its_limit(
    fence_store: Store, worker_env: dict[str, str], db_url: str, client_app: ModuleType
) -> None:
    import sqlalchemy as sa

    from celery_fence import enqueue

    # Given two stranded running jobs, then a never-claimed enqueued one (newest)
    queue = worker_env["FENCE_T_QUEUE"]
    running = [_stranded(fence_store, queue, "running") for _ in range(2)]
    never = f"never:{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        enqueue(conn, client_app.work, args=(never,))
    engine.dispose()
    # When ls --stuck asks for never-claimed jobs, or for pending ones, one at most
    for flag in ("--never-claimed", "--status=pending"):
        args = ("ls", "--stuck", "--older-than", "0", "--limit", "1", flag, "--json")
        listed = json.loads(ok(fence_cli(worker_env, *args)))
        # Then it shows that job: the filter picks before the limit cuts
        assert [j["key"] for j in listed] == [never], flag
    assert all((fence_store.get(r.key) or pytest.fail()).status == "running" for r in running)


def test_two_recover_runs_at_once_send_each_job_once(
    worker_env: dict[str, str],
    broker: redis.Redis,
    sqlite_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # SQLite file of this test's own: every stranded row in it is ours
    store = Store(sqlite_url)
    queue = worker_env["FENCE_T_QUEUE"]
    keys = {_stranded(store, queue, "running").key for _ in range(20)}
    for name, value in {**worker_env, "FENCE_T_DB": sqlite_url}.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("tests.support.app", None)
    app = importlib.import_module("tests.support.app").app
    # Given two recover runs that have both read every stranded row before either takes one
    # (each waits for the other once its scan returned), so only the compare-and-set decides,
    both_scanned = threading.Barrier(2, timeout=60)
    scan = recovery.stranded_jobs

    def scan_then_wait(*args: Any, **kwargs: Any) -> Any:
        found = scan(*args, **kwargs)
        both_scanned.wait()
        return found

    monkeypatch.setattr(recovery, "stranded_jobs", scan_then_wait)
    time.sleep(1.2)  # the rows must not have moved for 1 s (the threshold), not a wait on an event
    reports: list[recovery.RecoveryReport] = []

    def run() -> None:
        reports.append(recovery.recover(app, older_than=1.0))

    threads = [threading.Thread(target=run) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
    finally:
        app.close()
        sys.modules.pop("tests.support.app", None)
    # then both found every job, each job was sent once between the two runs, and each run
    # lost to the other exactly the jobs the other sent.
    assert len(reports) == 2
    assert [sorted(r.stranded) for r in reports] == [sorted(keys)] * 2
    sent = [k for r in reports for k in r.sent]
    assert sorted(sent) == sorted(keys)
    assert sorted(reports[0].raced) == sorted(reports[1].sent)
    assert sorted(reports[1].raced) == sorted(reports[0].sent)
    assert sorted(m["body"][0][0] for m in _messages(broker, queue)) == sorted(keys)
    store.dispose()


def test_requeue_force(
    fence_store: Store,
    worker_env: dict[str, str],
    leases: LeaseStore,
    broker: redis.Redis,
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    held = _stranded(fence_store, queue, "running")
    token = uuid.uuid4().hex
    generation = leases.claim(held.key, token, 30_000)
    # not dead, no --force: refused
    assert_one_line_error(fence_cli(worker_env, "requeue", held.key), 1, "not dead", "--force")
    # --force, but a live lease holds it: refused, nothing sent
    assert_one_line_error(
        fence_cli(worker_env, "requeue", "--force", held.key), 1, "live lease", "not re-sent"
    )
    assert broker.llen(queue) == 0
    # the lease is gone: re-sent under its key, attempt count kept
    leases.release(leases.keys_for(held.key).lease, f"{token}:{generation}")
    out = ok(fence_cli(worker_env, "requeue", "--force", held.key))
    assert out.startswith(f"requeued {held.key}:")
    (message,) = _messages(broker, queue)
    assert message["headers"]["fence_key"] == held.key and message["body"][0] == [held.key]
    record = fence_store.get(held.key)
    assert record is not None and (record.status, record.attempts) == ("pending", 1)
    # a completed job is never re-sent, forced or not
    done = _stranded(fence_store, queue, "completed")
    assert_one_line_error(fence_cli(worker_env, "requeue", "--force", done.key), 1, "completed")


def test_recover_routes_to_the_exchange_and_routing_key_as_delivered(
    fence_store: Store, worker_env: dict[str, str], client_app: ModuleType
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    record = _stranded(fence_store, queue, "running")

    def routed(request: dict[str, Any]) -> dict[str, Any]:
        return recovery.routing_for(dataclasses.replace(record, request=request), client_app.app)

    # delivered through a topic exchange (as RabbitMQ reports it): the same exchange and key
    topic = _request(record.key, "", exchange="jobs.topic", routing_key="jobs.work.eu")
    assert routed(topic) == {"exchange": "jobs.topic", "routing_key": "jobs.work.eu"}
    # through a queue this app declares: named, so Celery declares it before the send
    assert routed(_request(record.key, queue)) == {"queue": queue}
    # through the default exchange: the routing key is the queue's name
    assert routed(_request(record.key, "q0", exchange="")) == {"queue": "q0"}
    # a row stored before the routing key was kept ("queue" held the delivered routing key)
    assert routed({"task": WORK, "args": [], "options": {"queue": "q1"}}) == {"queue": "q1"}


def test_a_stranded_job_without_a_stored_request_goes_dead_not_stuck_forever(
    worker_env: dict[str, str], sqlite_url: str
) -> None:
    env = {**worker_env, "FENCE_T_DB": sqlite_url}
    store = Store(sqlite_url)
    key = f"stuck:{uuid.uuid4().hex[:10]}"
    store.register(key, generation=1, attempt_id="a", task_name=WORK, request=None)
    report = json.loads(ok(fence_cli(env, "recover", "--older-than", "0", "--json")))
    assert report["keys"]["dead"] == [key] and report["sent"] == 0
    record = store.get(key)
    assert record is not None and record.status == "dead"
    assert record.error_message is not None and "no stored request" in record.error_message
    assert json.loads(ok(fence_cli(env, "ls", "--stuck", "--older-than", "0", "--json"))) == []
    store.dispose()


# -- per-task settings and workflows ---------------------------------------------------------------

OWN_PREFIX_TASK = "tests.support.app.own_prefix"  # own lease prefix, fence_recover_after=2
OWN_DATABASE_TASK = "tests.support.app.own_database"  # its own database (FENCE_T_OWN_DB)


def _stranded_row(
    store: Store, key: str, task: str, queue: str, *, retrying: bool = False, **execution: Any
) -> None:
    request: dict[str, Any] = {"task": task, "id": None, "args": [key], "kwargs": {}}
    request["options"] = {"exchange": queue, "routing_key": queue, "priority": None}
    if execution:
        request["execution"] = execution
    attempt = uuid.uuid4().hex
    store.register(key, generation=1, attempt_id=attempt, task_name=task, request=request)
    if retrying:  # its attempt scheduled a retry whose message was lost
        now = dt.datetime.now(dt.timezone.utc)
        retry = RetryScheduled(
            generation=1,
            attempt_id=attempt,
            error=ConnectionError("down"),
            retry_at=now,
            reason="test",
        )
        assert store.end(key, retry)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_recover_scans_a_task_s_own_database_and_judges_each_job_by_its_task_s_threshold(
    fence_store: Store, worker_env: dict[str, str], broker: redis.Redis, tmp_path: Path
) -> None:
    own_url = f"sqlite:///{tmp_path / 'own.sqlite3'}"
    env = {**worker_env, "FENCE_T_OWN_DB": own_url}
    own_store = Store(own_url)
    own_store.create_schema()
    queue = worker_env["FENCE_T_QUEUE"]
    # (check covers the task's database as well as the app's)
    assert f"database: ok ({own_url}, schema current)" in ok(fence_cli(env, "check"))
    # Given a stranded retrying job in a task's own database, one of a task whose
    # fence_recover_after is 2 s, and one of a task with the app's (3 x its 2 s TTL = 6 s), none
    # moved for 2 s (a running job is judged by its lease alone: retrying ones here),
    own = f"own-db:{uuid.uuid4().hex[:8]}"
    short = f"short:{uuid.uuid4().hex[:8]}"
    default = f"default:{uuid.uuid4().hex[:8]}"
    _stranded_row(own_store, own, OWN_DATABASE_TASK, queue, retrying=True)
    _stranded_row(fence_store, short, OWN_PREFIX_TASK, queue, retrying=True)
    _stranded_row(fence_store, default, WORK, queue, retrying=True)
    time.sleep(2.1)
    # when recover runs with each task's own threshold,
    first = json.loads(ok(fence_cli(env, "recover", "--json")))
    # then only the job past its own task's threshold is re-sent;
    assert first["keys"]["sent"] == [short]
    # with a threshold of 0 for all, the others too, the one in the task's own database included
    # (the pending one, re-sent a moment ago, may go again: a threshold of 0 says so)
    second = json.loads(ok(fence_cli(env, "recover", "--older-than", "0", "--json")))
    assert set(second["keys"]["sent"]) - {short} == {own, default}
    assert (own_store.get(own) or pytest.fail()).status == "pending"
    sent = {m["body"][0][0]: m for m in _messages(broker, queue)}
    assert set(sent) == {own, short, default}
    assert sent[own]["headers"]["task"] == OWN_DATABASE_TASK
    # and ls/show find the job in the task's database.
    assert json.loads(ok(fence_cli(env, "show", own, "--json")))["status"] == "pending"
    own_store.dispose()


def test_a_never_claimed_enqueued_job_is_recovered_after_the_shorter_pending_threshold(
    client_app: ModuleType, db_url: str, fence_store: Store, worker_env: dict[str, str], broker: Any
) -> None:
    import sqlalchemy as sa

    from celery_fence import enqueue

    queue = worker_env["FENCE_T_QUEUE"]
    # (a 30 s lease TTL: fence_recover_after, 3 x 30 s, is far above the pending threshold)
    env = {**worker_env, "FENCE_T_RECOVER_PENDING_AFTER": "1", "FENCE_T_TTL": "30"}
    # Given, with no worker, two enqueued jobs whose messages are lost, one of them due in an
    # hour (countdown), and a running job whose lease is gone,
    never, later = (f"never:{uuid.uuid4().hex[:8]}" for _ in range(2))
    with sa.create_engine(db_url).begin() as conn:
        enqueue(conn, client_app.work, args=(never,))
        enqueue(conn, client_app.work, args=(later,), countdown=3600)
    broker.delete(queue)
    running = _stranded(fence_store, queue, "running").key
    # (fence ls shows the enqueued ones as never claimed, and lists only them when asked)
    table = ok(fence_cli(env, "ls", "--task", WORK)).splitlines()
    assert {line.split()[0] for line in table if "pending (never claimed)" in line} >= {
        never,
        later,
    }
    listed = json.loads(ok(fence_cli(env, "ls", "--never-claimed", "--json")))
    assert {never, later} <= {j["key"] for j in listed} and running not in str(listed)
    assert all(j["never_claimed"] for j in listed)
    time.sleep(1.2)  # past fence_recover_pending_after=1: a clock, no event to wait on
    # when recover runs with each job's own threshold,
    report = json.loads(ok(fence_cli(env, "recover", "--json")))
    # then the never-claimed job is sent again, and the running one whose lease is gone (no
    # quiet time: its lease's absence is the signal); the one with a countdown waits for its
    # due time
    assert sorted(report["keys"]["sent"]) == sorted([never, running])
    assert sorted(m["body"][0][0] for m in _messages(broker, queue)) == sorted([never, running])
    assert (fence_store.get(running) or pytest.fail()).status == "pending"
    assert (fence_store.get(later) or pytest.fail()).generation == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_recover_re_sends_the_stored_workflow_with_the_message(
    fence_store: Store, worker_env: dict[str, str], broker: redis.Redis
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    key = f"workflow:{uuid.uuid4().hex[:8]}"
    nxt = {"task": "tests.support.app.follow", "args": ["b"], "kwargs": {}, "options": {}}
    err = {"task": "tests.support.app.echo", "args": ["e"], "kwargs": {}, "options": {}}
    _stranded_row(
        fence_store,
        key,
        WORK,
        queue,
        chain=[nxt],
        chord=err,
        link=[nxt],
        link_error=[err],
        root_id="root-1",
        parent_id="parent-1",
        group_id="group-1",
        group_index=0,
        time_limit=30,
        soft_time_limit=20,
        headers={"tenant": "t1"},
    )
    report = json.loads(ok(fence_cli(worker_env, "recover", "--older-than", "0", "--json")))
    assert report["keys"]["sent"] == [key]
    (message,) = _messages(broker, queue)
    headers, embed = message["headers"], message["body"][2]
    assert (embed["chain"], embed["callbacks"], embed["errbacks"]) == ([nxt], [nxt], [err])
    assert embed["chord"] == err
    assert (headers["root_id"], headers["parent_id"]) == ("root-1", "parent-1")
    assert (headers["group"], headers["group_index"]) == ("group-1", 0)
    assert headers["timelimit"] == [30, 20]
    assert (headers["tenant"], headers["fence_key"]) == ("t1", key)
