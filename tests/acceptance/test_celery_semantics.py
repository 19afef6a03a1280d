"""Celery's own semantics on fenced tasks, with real workers (issue 32, items 1, 2, 3, 5, 6):
Flask's base-task pattern runs fenced, ``max_retries`` counts the body's retries only, an
immediate retry runs at once, the worker's exits read the ``fence_key`` header, and every caller
sees the stored (JSON) value.

Workers run :mod:`tests.support.semantics_app` (the acceptance app plus these tasks); assertions
are on the job rows, their transitions and the ledger of body runs.
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery.exceptions import MaxRetriesExceededError

from celery_fence.store import Store
from celery_fence.store.records import RetryScheduled
from tests.support import ledger
from tests.support.worker import Worker, app_worker, wait_until

pytestmark = pytest.mark.acceptance

APP = "tests.support.semantics_app"


@pytest.fixture
def spawn(tmp_path: Path, worker_env: dict[str, str]) -> Iterator[Callable[..., Worker]]:
    """``spawn(name, concurrency=1, **env)``: a started worker of the semantics app."""
    started: list[Worker] = []

    def start(name: str, *, concurrency: int = 1, **env: str) -> Worker:
        worker = app_worker(
            APP,
            env={**worker_env, **env},
            queue=worker_env["FENCE_T_QUEUE"],
            name=f"{name}-{uuid.uuid4().hex[:6]}",
            log_dir=tmp_path,
            concurrency=concurrency,
        )
        started.append(worker)
        worker.start()
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def client(worker_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The semantics app, imported in the test process with this test's settings."""
    for name, value in worker_env.items():
        monkeypatch.setenv(name, value)
    for module in (APP, "tests.support.app"):
        sys.modules.pop(module, None)
    semantics = importlib.import_module(APP)
    yield semantics
    semantics.app.close()
    for module in (APP, "tests.support.app"):
        sys.modules.pop(module, None)


def _ended(store: Store, key: str, timeout: float = 30.0) -> Any:
    def ended() -> Any:
        record = store.get(key)
        return record if record is not None and record.status in ("completed", "dead") else None

    return wait_until(ended, timeout, interval=0.1, what=f"job {key} to end")


def _actions(store: Store, key: str) -> list[tuple[str, int | None]]:
    return [(t.action, t.generation) for t in store.transitions.history(key)]


def _signals(redis_client: redis.Redis, prefix: str, name: str, key: str) -> list[dict[str, Any]]:
    entries = [json.loads(e) for e in ledger.entries(redis_client, f"{prefix}:signals")]
    return [e for e in entries if e.get("signal") == name and e.get("key") == key]


# -- 1. Flask's base task ------------------------------------------------------------------------


def test_a_flask_style_call_runs_fenced_and_a_stale_attempt_is_refused(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given Flask's documented base task (its __call__ runs self.run inside app_context()) ...
    a = spawn("a")
    key = f"flask:{uuid.uuid4().hex[:8]}"
    first = client.flask_work.delay(key, sleep=4.0)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 20, what="A's body")
    # ... the body runs fenced: it claimed generation 1 and its job row exists, running.
    record = fence_store.get(key)
    assert record is not None and (record.status, record.generation) == ("running", 1)
    # When A pauses past its TTL (2 s) and B runs a duplicate ...
    a.pause()
    time.sleep(2.6)
    spawn("b")
    second = client.flask_work.delay(key)
    value = second.get(timeout=20)
    assert value["generation"] == 2 and value["app"] == "fence_semantics"  # in the app context
    # ... then A resumes: its guard() refuses the stale attempt, and both callers converge.
    a.resume()
    assert first.get(timeout=30) == value
    record = fence_store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 2)
    runs = ledger.runs(redis_client, prefix, key)
    assert [r.split(":")[0] for r in runs] == ["1", "2"]
    assert ledger.effects(redis_client, prefix, key) == [runs[1]]  # no effect of the stale one
    actions = _actions(fence_store, key)
    assert ("lost", 1) in actions or ("stale", 1) in actions
    assert ("completed", 2) in actions and ("completed", 1) not in actions


def test_a_call_through_super_is_fenced_once(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn("w")
    key = f"flask-super:{uuid.uuid4().hex[:8]}"
    value = client.flask_super_work.delay(key).get(timeout=20)
    assert value["generation"] == 1 and value["app"] == "fence_semantics"
    record = _ended(fence_store, key)
    assert (record.status, record.attempts) == ("completed", 1)
    # one claim, one run: the pipeline did not run a second time inside the first
    assert [a for a, _ in _actions(fence_store, key)] == ["claimed", "completed"]
    assert ledger.run_count(redis_client, prefix, key) == 1


# -- 2. max_retries ------------------------------------------------------------------------------


def test_busy_lease_re_sends_do_not_spend_max_retries(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a task with max_retries=1, and a first message holding its key for 5 s ...
    spawn("w", concurrency=2, FENCE_T_SIGNALS="1")
    key = f"limited:{uuid.uuid4().hex[:8]}"
    first = client.limited.delay(key, sleep=5.0)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 20, what="the holder")
    # ... when a duplicate meets the busy lease at least twice (TTL 2 s),
    second = client.limited.delay(key)
    # then the duplicate still completes: the caller gets SUCCESS and the one result.
    assert second.get(timeout=30) == first.get(timeout=30)
    assert second.state == "SUCCESS"
    assert len(_signals(redis_client, prefix, "lease_busy", key)) >= 2
    record = _ended(fence_store, key)
    assert (record.status, record.attempts) == ("completed", 1)
    assert ledger.run_count(redis_client, prefix, key) == 1


def _failure(result: Any) -> BaseException:
    with pytest.raises(Exception) as failed:
        result.get(timeout=30)
    return failed.value


def test_the_bodys_own_retries_count_as_in_plain_celery(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given tasks with max_retries=2 that always retry (self.retry(), with and without exc=, and
    # autoretry_for), fenced and plain ...
    spawn("w", concurrency=2)
    u = uuid.uuid4().hex[:8]
    cases = {
        f"retry:{u}": (client.retry_always, client.plain_retry_always, {}),
        f"retry-exc:{u}": (client.retry_always, client.plain_retry_always, {"with_exc": True}),
        f"autoretry:{u}": (client.autoretry_always, client.plain_autoretry_always, {}),
    }
    for key, (fenced, plain, kwargs) in cases.items():
        fenced_result = fenced.delay(key, **kwargs)
        plain_result = plain.delay(f"plain-{key}", **kwargs)
        # then each body runs 3 times, and the caller gets the same final exception as plain
        # Celery's caller: MaxRetriesExceededError, or the body's own error.
        got, expected = _failure(fenced_result), _failure(plain_result)
        assert type(got) is type(expected), (key, got, expected)
        assert str(got) == str(expected) or isinstance(got, MaxRetriesExceededError)
        assert ledger.run_count(redis_client, prefix, f"plain-{key}") == 3
        assert ledger.run_count(redis_client, prefix, key) == 3, key
        # and the job is dead after those 3 executions (the fence did not retry it again).
        record = _ended(fence_store, key)
        assert (record.status, record.attempts) == ("dead", 3), key
        assert record.error_type is not None and record.error_type.endswith(type(got).__name__)


# -- 3. an immediate retry -----------------------------------------------------------------------


def test_an_immediate_retry_does_not_wait_for_its_own_lease(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    # Given a 30 s lease, a release of a finished attempt's lease that lingers (3 s), and a
    # second process free to take the retry at once ...
    spawn("w", concurrency=2, FENCE_T_RELEASE_DELAY="3")
    key = f"retry-now:{uuid.uuid4().hex[:8]}"
    result = client.retry_now_once.delay(key)
    # when the first run calls self.retry(countdown=0), the second run happens well within the
    # TTL: the attempt gave its lease back before its retry was sent.
    record = _ended(fence_store, key, timeout=10)
    assert (record.status, record.attempts) == ("completed", 2)
    assert [a for a, _ in _actions(fence_store, key)] == [
        "claimed",
        "retry_scheduled",
        "claimed",
        "completed",
    ]
    assert result.get(timeout=10) == {"key": key, "runs": 2}


# -- 5. the worker's exits read the fence_key header ---------------------------------------------


def test_a_hard_time_limit_settles_the_job_the_header_names(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn("w", concurrency=2)
    u = uuid.uuid4().hex[:8]
    # Given a requeued message whose fence_key header names job hdr:..., while its arguments
    # would give another key, killed by its hard time limit on its first run ...
    header_key, args_key = f"hdr-tl:{u}", f"args-tl:{u}"
    client.app.send_task(
        "tests.support.app.overrun",
        (args_key,),
        {"sleep": 6.0},
        time_limit=1.5,
        headers={"fence_key": header_key},
    )
    # then the time limit is recorded on the header's job, which a later attempt completes.
    record = _ended(fence_store, header_key, timeout=40)
    assert record.status == "completed"
    assert "time_limit" in [action for action, _ in _actions(fence_store, header_key)]
    assert fence_store.get(args_key) is None and fence_store.transitions.history(args_key) == []


def test_an_expired_re_send_settles_the_job_the_header_names(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn("w")
    u = uuid.uuid4().hex[:8]
    # Given job hdr-exp:... waiting (retrying) for message M, and M re-sent with the header but
    # arguments that give another key, expired before it runs ...
    header_key, args_key, message_id = f"hdr-exp:{u}", f"args-exp:{u}", uuid.uuid4().hex
    request = {"task": client.limited.name, "id": message_id, "args": [header_key], "kwargs": {}}
    fence_store.register(
        header_key, generation=1, attempt_id="a1", task_name=client.limited.name, request=request
    )
    retry_at = dt.datetime.now(dt.timezone.utc)
    fence_store.end(header_key, RetryScheduled(1, "a1", None, retry_at, "test"))
    client.limited.apply_async(
        (args_key,),
        task_id=message_id,
        headers={"fence_key": header_key},
        expires=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=5),
    )
    # then the job the header names is recorded dead (expired), nothing under the args' key.
    record = _ended(fence_store, header_key, timeout=20)
    assert record.status == "dead"
    assert record.error_message is not None and "expired" in record.error_message
    assert fence_store.get(args_key) is None
    assert ledger.run_count(redis_client, prefix, args_key) == 0


# -- 6. every caller sees the stored value -------------------------------------------------------


def test_the_first_caller_and_a_duplicate_get_the_same_stored_value(
    spawn: Callable[..., Worker],
    client: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    fence_store: Store,
) -> None:
    spawn("w")
    key = f"shape:{uuid.uuid4().hex[:8]}"
    first = client.non_json_shaped.delay(key).get(timeout=20)
    duplicate = client.non_json_shaped.delay(key).get(timeout=20)
    record = _ended(fence_store, key)
    assert first == duplicate == record.result == {"1": "a", "t": [1, 2]}
    assert ledger.run_count(redis_client, prefix, key) == 1
