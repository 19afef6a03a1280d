"""``celery -A <app> fence ...`` run as a subprocess against real databases, Redis and a worker.

Every verb on SQLite and PostgreSQL (``db_url``), and every error path: a non-zero exit code and
exactly one line on stderr, never a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from celery_fence import migrate
from celery_fence.leases.lease import LeaseStore
from celery_fence.schema import metadata
from celery_fence.store import Effect, Store
from celery_fence.store.records import Completion, Dead, RetryScheduled
from tests.support.env import PG_ADMIN_URL
from tests.support.worker import ROOT, SpawnWorker, wait_until

CELERY = str(ROOT / ".venv" / "bin" / "celery")
APP = "tests.support.app"
UNREACHABLE_PG = "postgresql+psycopg2://postgres@127.0.0.1:1/nowhere"
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


def fence_cli(
    env: dict[str, str], *args: str, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CELERY, "-A", APP, "fence", *args],
        cwd=ROOT,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """A failed command: exit ``code``, one ``Error: ...`` line on stderr mentioning ``words``."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("Error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    return proc.stdout


@pytest.fixture
def task_name(prefix: str) -> str:
    """A task name of this test's own, so listings on the shared PostgreSQL database are ours."""
    return f"{prefix}.report"


def _job(
    store: Store,
    task_name: str,
    status: str,
    *,
    key: str | None = None,
    error: Exception | None = None,
) -> str:
    key = key or f"job:{uuid.uuid4().hex[:10]}"
    attempt = uuid.uuid4().hex
    store.register(key, generation=1, attempt_id=attempt, task_name=task_name, request=None)
    if status == "completed":
        store.end(key, Completion(generation=1, attempt_id=attempt, result={"ok": True}))
    elif status == "dead":
        store.end(
            key,
            Dead(generation=1, attempt_id=attempt, error=error or ValueError("bad"), reason="test"),
        )
    elif status == "retrying":
        store.end(
            key,
            RetryScheduled(
                generation=1,
                attempt_id=attempt,
                error=error or ConnectionError("down"),
                retry_at=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=30),
                reason="test",
            ),
        )
    return key


# -- init-db --------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database: no tables at all."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'fresh.sqlite3'}"
        return
    name = f"celery_fence_cli_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def _schema_diff(url: str) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(context, metadata)
    finally:
        engine.dispose()
    # the only table the models do not describe is our own version table
    return [d for d in diff if not (d[0] == "remove_table" and d[1].name == migrate.VERSION_TABLE)]


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("fresh_db_url", ["postgresql"], indirect=True)  # (SQLite makes its own)
def test_a_store_without_tables_names_init_db_for_this_app(
    fresh_db_url: str, worker_env: dict[str, str]
) -> None:
    proc = fence_cli({**worker_env, "FENCE_T_DB": fresh_db_url}, "ls")
    assert proc.returncode != 0
    assert f"run 'celery -A {APP} fence init-db'" in proc.stderr + proc.stdout, proc.stderr


def test_init_db_creates_exactly_the_schema_then_is_idempotent(
    fresh_db_url: str, worker_env: dict[str, str]
) -> None:
    env = {**worker_env, "FENCE_T_DB": fresh_db_url}
    out = ok(fence_cli(env, "init-db"))
    assert out.startswith("created:") and migrate.head() in out
    assert _tables(fresh_db_url) == set(metadata.tables) | {migrate.VERSION_TABLE}
    assert _schema_diff(fresh_db_url) == []  # the migration makes exactly schema.py's tables
    assert migrate.current(fresh_db_url) == (migrate.head(),)
    assert ok(fence_cli(env, "init-db")).startswith("current:")


def test_init_db_stamps_tables_made_by_create_all(
    fresh_db_url: str, worker_env: dict[str, str]
) -> None:
    engine = sa.create_engine(fresh_db_url)
    metadata.create_all(engine)
    engine.dispose()
    env = {**worker_env, "FENCE_T_DB": fresh_db_url}
    assert ok(fence_cli(env, "init-db")).startswith("stamped:")
    assert migrate.current(fresh_db_url) == (migrate.head(),)
    assert ok(fence_cli(env, "init-db")).startswith("current:")


def test_init_db_refuses_a_partial_schema(fresh_db_url: str, worker_env: dict[str, str]) -> None:
    engine = sa.create_engine(fresh_db_url)
    metadata.tables["fence_jobs"].create(engine)
    engine.dispose()
    proc = fence_cli({**worker_env, "FENCE_T_DB": fresh_db_url}, "init-db")
    assert_one_line_error(proc, 1, "fence_outbox", "fence_transitions")
    assert migrate.VERSION_TABLE not in _tables(fresh_db_url)


# -- ls -------------------------------------------------------------------------------------------


def test_ls_lists_filters_and_limits(
    fence_store: Store, worker_env: dict[str, str], task_name: str
) -> None:
    done = _job(fence_store, task_name, "completed")
    dead = _job(fence_store, task_name, "dead", error=ValueError("bad input"))
    running = _job(fence_store, task_name, "running")
    other = _job(fence_store, f"{task_name}.other", "dead")

    table = ok(fence_cli(worker_env, "ls", "--task", task_name)).splitlines()
    assert table[0].split() == ["KEY", "TASK", "STATUS", "ATTEMPTS", "GEN", "UPDATED", "ERROR"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert set(rows) == {done, dead, running}
    assert rows[dead][2] == "dead" and rows[dead][-1] == "ValueError"
    assert rows[done][2:5] == ["completed", "1", "1"]

    listed = json.loads(
        ok(fence_cli(worker_env, "ls", "--status", "dead", "--task", task_name, "--json"))
    )
    assert [j["key"] for j in listed] == [dead]
    assert listed[0]["error_type"] == "builtins.ValueError"
    assert listed[0]["error_message"] == "bad input"

    cut = fence_cli(worker_env, "ls", "--task", task_name, "--limit", "1", "--json")
    newest = json.loads(ok(cut))
    assert [j["key"] for j in newest] == [running]  # most recently updated first
    assert "1 shown (--limit); more may match" in cut.stderr  # a cut list says so
    assert "more may match" not in fence_cli(worker_env, "ls", "--task", task_name).stderr
    assert other not in ok(fence_cli(worker_env, "ls", "--task", task_name))
    assert ok(fence_cli(worker_env, "ls", "--task", "no.such.task")).strip() == "no jobs"


# -- show -----------------------------------------------------------------------------------------


def test_show_prints_state_lease_and_history(
    fence_store: Store, worker_env: dict[str, str], task_name: str, leases: LeaseStore
) -> None:
    key = f"job:{uuid.uuid4().hex[:10]}"
    token = uuid.uuid4().hex
    generation = leases.claim(key, token, 30_000)
    fence_store.register(key, generation=generation, attempt_id=token, task_name=task_name)
    fence_store.end(
        key,
        RetryScheduled(
            generation=generation,
            attempt_id=token,
            error=ConnectionError("db down"),
            retry_at=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=60),
            reason="transient error ConnectionError; retry in 60.000s",
        ),
    )

    text = ok(fence_cli(worker_env, "show", key))
    fields = dict(
        (name.strip(), value.strip())
        for name, _, value in (line.partition(":") for line in text.splitlines()[:13])
    )
    assert fields["status"] == "retrying"
    assert fields["generation"] == str(generation)
    assert fields["owner attempt"] == token
    assert fields["attempts"] == "1"
    assert fields["last error"] == "builtins.ConnectionError: db down"
    assert "s left, generation " + str(generation) in fields["lease"]
    assert fields["retry at"] != "-" and fields["finished"] == "-"
    assert "history:" in text and "claimed" in text and "retry_scheduled" in text

    doc = json.loads(ok(fence_cli(worker_env, "show", key, "--json")))
    assert 0 < doc["lease_remaining"] <= 30.0 and doc["lease_generation"] == generation
    assert [h["action"] for h in doc["history"]] == ["claimed", "retry_scheduled"]
    assert doc["history"][1]["reason"].endswith("retry in 60.000s")

    leases.release(leases.keys_for(key).lease, f"{token}:{generation}")
    doc = json.loads(ok(fence_cli(worker_env, "show", key, "--json")))
    assert doc["lease_remaining"] is None
    assert "none (not held)" in ok(fence_cli(worker_env, "show", key))


def test_show_prints_the_stored_result_of_a_completed_job(
    fence_store: Store, worker_env: dict[str, str], task_name: str, leases: LeaseStore
) -> None:
    key = f"job:{uuid.uuid4().hex[:10]}"
    token = uuid.uuid4().hex
    generation = leases.claim(key, token, 30_000)
    fence_store.register(key, generation=generation, attempt_id=token, task_name=task_name)
    assert ok(fence_cli(worker_env, "show", key)).count("result:") == 1  # "-" until completed
    fence_store.end(
        key, Completion(generation=generation, attempt_id=token, result={"rows": [1, 2]})
    )

    text = ok(fence_cli(worker_env, "show", key))
    assert 'result:        {"rows": [1, 2]}' in text.splitlines()
    doc = json.loads(ok(fence_cli(worker_env, "show", key, "--json")))
    assert doc["status"] == "completed" and doc["result"] == {"rows": [1, 2]}


# -- requeue --------------------------------------------------------------------------------------


@pytest.mark.acceptance
def test_requeue_runs_a_dead_job_to_completion_with_a_fresh_budget(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
    worker_env: dict[str, str],
) -> None:
    # Given a job that died after its 2 attempts (the cause was then fixed: 2 failures only) ...
    spawn_worker("w", FENCE_T_MAX_ATTEMPTS="2")
    key = f"requeue:{uuid.uuid4().hex[:8]}"
    redis_client.set(f"{prefix}:fail_times:{key}", 2)
    client_app.work.delay(key, fail="transient")
    wait_until(lambda: (fence_store.get(key) or _Nothing).status == "dead", 60, what="dead")
    dead = fence_store.get(key)
    assert dead is not None and dead.attempts == 2
    # ... when the operator requeues it,
    out = ok(fence_cli(worker_env, "requeue", key))
    assert out.startswith(f"requeued {key}:") and worker_env["FENCE_T_QUEUE"] in out
    # then it runs again under the same key and completes, counting attempts afresh.
    wait_until(lambda: (fence_store.get(key) or _Nothing).status == "completed", 60, what="done")
    record = fence_store.get(key)
    assert record is not None
    assert record.attempts == 1 and record.generation == dead.generation + 1
    assert record.result["generation"] == record.generation
    actions = [t.action for t in fence_store.transitions.history(key)]
    assert actions[-3:] == ["requeued", "claimed", "completed"]
    # A completed job is refused without --completed: its result is replayed, not re-run ...
    assert_one_line_error(fence_cli(worker_env, "requeue", key), 1, "completed", "--completed")
    # ... and with it the operator runs the key again on purpose: a new attempt, a new result.
    out = ok(fence_cli(worker_env, "requeue", "--completed", key))
    assert out.startswith(f"requeued {key}:")
    wait_until(
        lambda: (
            (fence_store.get(key) or _Nothing).generation == record.generation + 1
            and (fence_store.get(key) or _Nothing).status == "completed"
        ),
        60,
        what="the re-run completed",
    )
    rerun = fence_store.get(key)
    assert rerun is not None and rerun.attempts == 1
    assert rerun.result["generation"] == record.generation + 1  # the new attempt's own result
    history = fence_store.transitions.history(key)
    assert [t.action for t in history][-3:] == ["requeued", "claimed", "completed"]
    assert history[-3].reason == "completed job re-run by operator"


class _Nothing:
    status = None
    generation = None


def test_requeue_puts_the_job_back_to_dead_when_the_broker_is_unreachable(
    fence_store: Store, worker_env: dict[str, str], task_name: str
) -> None:
    key = f"job:{uuid.uuid4().hex[:10]}"
    attempt = uuid.uuid4().hex
    request = {"task": task_name, "args": [key], "kwargs": {}, "options": {"queue": "q"}}
    fence_store.register(
        key, generation=3, attempt_id=attempt, task_name=task_name, request=request
    )
    fence_store.end(key, Dead(generation=3, attempt_id=attempt, error=ValueError("x"), reason="t"))
    before = fence_store.get(key)
    assert before is not None

    env = {**worker_env, "FENCE_T_BROKER": UNREACHABLE_REDIS}
    assert_one_line_error(fence_cli(env, "requeue", key), 1, "could not send", "dead again")
    after = fence_store.get(key)
    assert after is not None
    assert (after.status, after.attempts, after.generation, after.attempt_id) == (
        "dead",
        before.attempts,
        3,
        attempt,
    )
    assert after.finished_at == before.finished_at
    actions = [t.action for t in fence_store.transitions.history(key)]
    assert actions[-2:] == ["requeued", "requeue_reverted"]


def test_requeue_refusals(fence_store: Store, worker_env: dict[str, str], task_name: str) -> None:
    running = _job(fence_store, task_name, "running")
    assert_one_line_error(fence_cli(worker_env, "requeue", running), 1, "running", "not dead")
    assert (fence_store.get(running) or _Nothing).status == "running"
    no_request = _job(fence_store, task_name, "dead")
    assert_one_line_error(fence_cli(worker_env, "requeue", no_request), 1, "no stored request")
    assert (fence_store.get(no_request) or _Nothing).status == "dead"
    assert_one_line_error(fence_cli(worker_env, "requeue", "job:nope"), 1, "no job", "job:nope")


# -- purge ----------------------------------------------------------------------------------------


def _job_with_effects(store: Store, task_name: str, *, deliver: int, of: int) -> str:
    """A completed job with ``of`` outbox rows, the first ``deliver`` of them delivered."""
    key = f"job:{uuid.uuid4().hex[:10]}"
    store.register(key, generation=1, attempt_id="A", task_name=task_name)
    effects = [Effect(f"mail.{i}", {"n": i}, f"{key}:mail.{i}") for i in range(of)]
    store.end(key, Completion(generation=1, attempt_id="A", result=None, effects=effects))
    for row in store.outbox_rows.claim(claimer="cli-test", claim_ttl=30, limit=deliver, key=key):
        assert store.outbox_rows.mark_delivered(row.id, claimer="cli-test")
    return key


def test_purge_deletes_finished_jobs_before_the_date(
    fence_store: Store, worker_env: dict[str, str], task_name: str
) -> None:
    old_done = _job(fence_store, task_name, "completed")
    old_dead = _job(fence_store, task_name, "dead")
    old_effects = _job_with_effects(fence_store, task_name, deliver=1, of=2)
    time.sleep(0.05)
    cutoff = dt.datetime.now(dt.timezone.utc)
    time.sleep(0.05)
    new_done = _job(fence_store, task_name, "completed")
    new_effects = _job_with_effects(fence_store, task_name, deliver=1, of=1)
    running = _job(fence_store, task_name, "running")

    out = ok(fence_cli(worker_env, "purge", "--completed-before", cutoff.isoformat(), "--force"))
    assert out.startswith("purged ") and "completed" in out
    assert re.search(r"and \d+ outbox row\(s\) delivered before", out), out
    assert fence_store.get(old_done) is None and fence_store.transitions.history(old_done) == []
    for kept in (old_dead, new_done, running):  # dead jobs stay for inspection by default
        assert fence_store.get(kept) is not None
    # the old job's delivered effect is gone, its undelivered one stays; newer rows stay
    assert [r.status for r in fence_store.outbox_rows.rows(key=old_effects)] == ["pending"]
    assert [r.status for r in fence_store.outbox_rows.rows(key=new_effects)] == ["delivered"]

    # naive dates are UTC; --include-dead purges dead jobs too
    naive = cutoff.replace(tzinfo=None).isoformat()
    ok(fence_cli(worker_env, "purge", "--completed-before", naive, "--include-dead", "--force"))
    assert fence_store.get(old_dead) is None
    assert fence_store.get(new_done) is not None and fence_store.get(running) is not None
    # an age: nothing finished more than a day ago is left of ours
    assert ok(fence_cli(worker_env, "purge", "--completed-before", "1d")).startswith("purged ")
    assert fence_store.get(new_done) is not None


def test_purge_below_the_retention_floor_needs_force(
    fence_store: Store, worker_env: dict[str, str], task_name: str
) -> None:
    done = _job(fence_store, task_name, "completed")
    # Given a date less than an hour ago (fence_retention's floor), the purge is refused,
    # naming --force, and nothing is deleted;
    for before in ("0d", "30m", dt.datetime.now(dt.timezone.utc).isoformat()):
        line = assert_one_line_error(
            fence_cli(worker_env, "purge", "--completed-before", before), 2, "--force", "1 hour"
        )
        assert before in line
    assert fence_store.get(done) is not None
    # an hour ago or more needs no --force (ours finished just now: kept),
    assert ok(fence_cli(worker_env, "purge", "--completed-before", "1h")).startswith("purged ")
    assert fence_store.get(done) is not None
    # and with --force the operator deletes it all.
    ok(fence_cli(worker_env, "purge", "--completed-before", "0d", "--force"))
    assert fence_store.get(done) is None and fence_store.transitions.history(done) == []


# -- error paths ----------------------------------------------------------------------------------


def test_usage_errors_are_one_line(worker_env: dict[str, str]) -> None:
    assert_one_line_error(fence_cli(worker_env, "ls", "--status", "bogus"), 2, "bogus", "dead")
    assert_one_line_error(fence_cli(worker_env, "ls", "--limit", "0"), 2, "--limit")
    assert_one_line_error(
        fence_cli(worker_env, "purge", "--completed-before", "last tuesday"), 2, "bad date"
    )
    assert_one_line_error(fence_cli(worker_env, "purge"), 2, "--completed-before")
    assert_one_line_error(fence_cli(worker_env, "show"), 2, "KEY")
    assert_one_line_error(fence_cli(worker_env, "show", "job:nope"), 1, "no job", "job:nope")


def test_an_unreachable_database_is_one_line(worker_env: dict[str, str]) -> None:
    env = {**worker_env, "FENCE_T_DB": UNREACHABLE_PG}
    for args in (("ls",), ("show", "job:x"), ("requeue", "job:x"), ("init-db",)):
        line = assert_one_line_error(fence_cli(env, *args), 1, "database error")
        assert "postgres@" not in line or "***" in line  # never a password
    assert_one_line_error(
        fence_cli(env, "purge", "--completed-before", "2020-01-01"), 1, "database error"
    )


def test_an_unreachable_redis_is_one_line(
    fence_store: Store, worker_env: dict[str, str], task_name: str
) -> None:
    key = _job(fence_store, task_name, "dead")
    env = {**worker_env, "FENCE_T_REDIS": UNREACHABLE_REDIS}
    assert_one_line_error(fence_cli(env, "show", key), 1, "Redis error")
    assert "dead" in ok(fence_cli(env, "ls", "--task", task_name))  # ls needs no Redis


def test_requeue_emits_job_retry_scheduled(
    fence_store: Store, worker_env: dict[str, str], redis_client: redis.Redis, prefix: str
) -> None:
    """The operator's requeue is announced like a retry (recorded by the CLI process to Redis)."""
    import redis

    from tests.support.env import BROKER_URL

    task_name = f"{APP}.work"
    key = f"job:{uuid.uuid4().hex[:10]}"
    attempt = uuid.uuid4().hex
    queue = worker_env["FENCE_T_QUEUE"]
    request = {"task": task_name, "args": [key], "kwargs": {}, "options": {"queue": queue}}
    fence_store.register(
        key, generation=5, attempt_id=attempt, task_name=task_name, request=request
    )
    fence_store.end(key, Dead(generation=5, attempt_id=attempt, error=ValueError("x"), reason="t"))

    ok(fence_cli({**worker_env, "FENCE_T_SIGNALS": "1"}, "requeue", key))
    events = [json.loads(e) for e in redis_client.lrange(f"{prefix}:signals", 0, -1)]
    assert [(e["signal"], e["key"], e["generation"], e["reason"], e["sender"]) for e in events] == [
        ("job_retry_scheduled", key, 5, "requeued by operator", task_name)
    ]
    assert (fence_store.get(key) or _Nothing).status == "pending"
    broker = redis.Redis.from_url(BROKER_URL)
    try:
        assert broker.llen(queue) == 1  # the re-sent message waits in the job's queue
    finally:
        broker.delete(queue)
        broker.close()
