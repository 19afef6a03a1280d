"""A fenced task run in the caller's thread — a direct call ``task(...)``, ``.apply()``,
``task_always_eager`` — whose body raises: the caller gets the exception (plain Celery never
retries such a call), the job is left ``failed`` (never ``retrying`` with no message, which
recovery would later re-send and run after its caller saw it fail), and a later call or message
for the same key runs it.

Real Redis and SQLite/PostgreSQL; one test runs the later ``.delay()`` on a real worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery.exceptions import Reject

from celery_fence.errors import FenceEagerWarning, Rescheduled, StoreError
from celery_fence.leases.lease import LeaseStore
from celery_fence.ops import recovery
from celery_fence.store import Store
from celery_fence.testing import faults
from celery_fence.testing.waiting import poll_until
from tests.support.env import BROKER_URL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def broker(worker_env: dict[str, str]) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(BROKER_URL)
    yield client
    client.delete(worker_env["FENCE_T_QUEUE"])
    client.close()


def _queued_keys(broker: redis.Redis, queue: str) -> list[str]:
    """The ``fence_key`` headers of the messages waiting in a Redis-broker queue."""
    return [json.loads(raw)["headers"].get("fence_key") for raw in broker.lrange(queue, 0, -1)]


def _fail_once(app: ModuleType, key: str) -> None:
    """``work(key, fail="transient")`` raises ConnectionError on its first run only."""
    app.ledger.set(f"{app.PREFIX}:fail_times:{key}", 1)


def _runs(app: ModuleType, key: str) -> int:
    return int(app.ledger.llen(f"{app.PREFIX}:runs:{key}"))


def _assert_failed_and_not_recovered(
    store: Store, app: ModuleType, broker: redis.Redis, queue: str, key: str, error: str, how: str
) -> None:
    record = store.get(key)
    assert record is not None
    assert (record.status, record.error_type) == ("failed", error)
    assert record.retry_at is None and record.finished_at is not None
    assert [t.reason for t in store.transitions.history(key) if t.action == "failed"] == [
        f"raised in the caller's thread ({how})"
    ]
    report = recovery.recover(app.app, older_than=0)
    assert key not in report.sent and key not in report.stranded
    assert key not in _queued_keys(broker, queue)
    assert (store.get(key) or pytest.fail()).status == "failed"
    with pytest.raises(StoreError, match=r"failed, not dead: not requeued.*next call or message"):
        store.admin.requeue(key)


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_failed_direct_call_is_not_recovered_and_a_later_delay_runs_it(
    fence_store: Store,
    client_app: ModuleType,
    spawn_worker: Any,
    worker_env: dict[str, str],
    broker: redis.Redis,
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    key = f"direct:{uuid.uuid4().hex[:10]}"
    _fail_once(client_app, key)

    # A direct call whose body raises: the caller gets the exception, the body ran once
    with pytest.raises(ConnectionError, match="simulated transient failure"):
        client_app.work(key, fail="transient")
    assert _runs(client_app, key) == 1
    # The job is failed, not retrying: recovery does not re-send it
    _assert_failed_and_not_recovered(
        fence_store, client_app, broker, queue, key, "builtins.ConnectionError", "direct call"
    )

    # A later message for the same key runs the body and completes
    spawn_worker()
    result = client_app.work.delay(key, fail="transient").get(timeout=60)
    assert result["key"] == key and result["generation"] > 1
    record = fence_store.get(key)
    assert record is not None
    assert (record.status, record.attempts, record.result) == ("completed", 1, result)
    assert _runs(client_app, key) == 2


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_failed_eager_run_runs_once_is_not_recovered_and_a_later_call_runs_it(
    fence_store: Store,
    client_app: ModuleType,
    worker_env: dict[str, str],
    broker: redis.Redis,
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    applied, eager = (f"{how}:{uuid.uuid4().hex[:10]}" for how in ("apply", "eager"))
    for key in (applied, eager):
        _fail_once(client_app, key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FenceEagerWarning)
        # .apply(): FAILURE with the body's exception after one run (no retries of its own)
        outcome = client_app.work.apply((applied,), {"fail": "transient"})
        assert outcome.state == "FAILURE" and isinstance(outcome.result, ConnectionError)
        # task_always_eager with eager propagation: .delay() raises to the caller
        client_app.app.conf.task_always_eager = True
        client_app.app.conf.task_eager_propagates = True
        try:
            with pytest.raises(ConnectionError):
                client_app.work.delay(eager, fail="transient")
        finally:
            client_app.app.conf.task_always_eager = False
        for key in (applied, eager):
            assert _runs(client_app, key) == 1
            _assert_failed_and_not_recovered(
                fence_store, client_app, broker, queue, key, "builtins.ConnectionError", "eager run"
            )
        # A later call for the same key runs the body and completes, its attempts counted anew
        again = client_app.work.apply((applied,), {"fail": "transient"})
        assert again.state == "SUCCESS" and again.result["generation"] > 1
        assert client_app.work(eager, fail="transient")["key"] == eager
    for key in (applied, eager):
        record = fence_store.get(key)
        assert record is not None and (record.status, record.attempts) == ("completed", 1)
        assert _runs(client_app, key) == 2


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_celery_control_flow_in_the_caller_s_thread(
    fence_store: Store,
    client_app: ModuleType,
    worker_env: dict[str, str],
    broker: redis.Redis,
) -> None:
    queue = worker_env["FENCE_T_QUEUE"]
    # An eager self.retry(): Celery's apply() runs the retry inline, as in plain Celery
    retried = f"retry:{uuid.uuid4().hex[:10]}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FenceEagerWarning)
        outcome = client_app.control.apply((retried,), {"kind": "retry"})
    assert outcome.state == "SUCCESS" and outcome.result["runs"] == 2
    assert (fence_store.get(retried) or pytest.fail()).status == "completed"
    # A direct call whose body rejects its message with requeue: no message to requeue, the
    # caller gets the Reject, and nothing is left for recovery
    requeued = f"requeue:{uuid.uuid4().hex[:10]}"
    with pytest.raises(Reject):
        client_app.control(requeued, kind="requeue")
    record = fence_store.get(requeued)
    assert record is not None
    assert (record.status, record.error_type) == ("failed", "celery.exceptions.Reject")
    report = recovery.recover(client_app.app, older_than=0)
    assert requeued not in report.sent and requeued not in _queued_keys(broker, queue)
    assert client_app.control(requeued, kind="requeue")["runs"] == 2
    assert (fence_store.get(requeued) or pytest.fail()).status == "completed"


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_direct_call_whose_process_dies_mid_body_is_recovered_and_run_once_more(
    fence_store: Store,
    client_app: ModuleType,
    spawn_worker: Any,
    worker_env: dict[str, str],
) -> None:
    # Given a direct call whose process is SIGKILLed in the body: no caller saw it end
    key = f"killed:{uuid.uuid4().hex[:10]}"
    faults.arm(client_app.ledger, client_app.PREFIX, "kill", "before_effect", key)
    caller = subprocess.run(
        [sys.executable, "-c", f"from tests.support import app; app.work({key!r})"],
        env={**os.environ, **worker_env},
        cwd=ROOT,
        timeout=60,
        capture_output=True,
    )
    assert caller.returncode == -signal.SIGKILL
    assert _runs(client_app, key) == 1
    record = fence_store.get(key)
    assert record is not None and record.status == "running"
    # Then, once its lease has run out, recovery re-sends it from its stored request, and a
    # worker runs it to completion (the caller's failure was never seen: not ``failed``)
    sent = poll_until(
        lambda: key in recovery.recover(client_app.app, older_than=0).sent, timeout=30
    )
    assert sent
    spawn_worker()
    done = poll_until(
        lambda: (r := fence_store.get(key)) is not None and r.status == "completed", timeout=60
    )
    assert done
    assert _runs(client_app, key) == 2


@pytest.mark.parametrize("db_url", ["sqlite", "postgresql"], indirect=True)
def test_a_call_in_the_caller_s_thread_that_meets_a_busy_lease_raises_at_once(
    fence_store: Store, client_app: ModuleType, leases: LeaseStore
) -> None:
    # Given another attempt holding the key's lease (a worker running it)
    key = f"busy:{uuid.uuid4().hex[:10]}"
    token = uuid.uuid4().hex
    generation = leases.claim(key, token, 30_000)
    try:
        # A direct call and an eager run each get Rescheduled naming the key, at once (before,
        # .apply() re-ran itself inline, nested, until RecursionError); nothing ran or was written
        with pytest.raises(
            Rescheduled, match=r"lease busy: job 'busy:.*direct call is not re-sent"
        ):
            client_app.work(key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FenceEagerWarning)
            outcome = client_app.work.apply((key,))
        assert outcome.state == "FAILURE" and isinstance(outcome.result, Rescheduled)
        assert "eager run is not re-sent" in str(outcome.result)
        assert _runs(client_app, key) == 0 and fence_store.get(key) is None
    finally:
        leases.release(leases.keys_for(key).lease, f"{token}:{generation}")
