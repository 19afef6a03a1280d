"""The outbox's failure windows with real workers, real signals and a real HTTP provider.

The provider stub performs each idempotency key once and counts what it really did; every test
asserts on the stored outbox rows and on those counts.
"""

from __future__ import annotations

import importlib
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis

from celery_fence.ops.outbox import SWEEP_TASK, idempotency_key
from celery_fence.store import Store
from celery_fence.testing import ProviderStub, faults
from tests.support import ledger
from tests.support.worker import Worker, app_worker, wait_until

pytestmark = pytest.mark.acceptance


@pytest.fixture
def provider() -> Iterator[ProviderStub]:
    stub = ProviderStub()
    stub.start()
    yield stub
    stub.stop()


@pytest.fixture
def outbox_env(worker_env: dict[str, str], provider: ProviderStub) -> dict[str, str]:
    return {**worker_env, "FENCE_T_PROVIDER": provider.url, "FENCE_T_CLAIM_TTL": "1.5"}


@pytest.fixture
def spawn(tmp_path: Path, outbox_env: dict[str, str]) -> Iterator[Callable[[str], Worker]]:
    started: list[Worker] = []

    def start(name: str) -> Worker:
        w = app_worker(
            "tests.support.outbox_app",
            env=outbox_env,
            queue=outbox_env["FENCE_T_QUEUE"],
            name=f"{name}-{uuid.uuid4().hex[:6]}",
            log_dir=tmp_path,
        )
        started.append(w)
        w.start()
        return w

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def client(outbox_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """tests.support.outbox_app imported in the test process (to send tasks and read)."""
    for k, v in outbox_env.items():
        monkeypatch.setenv(k, v)
    sys.modules.pop("tests.support.outbox_app", None)
    module = importlib.import_module("tests.support.outbox_app")
    yield module
    module.app.close()
    sys.modules.pop("tests.support.outbox_app", None)


def _at(provider: ProviderStub, idem: str) -> tuple[int, int]:
    """(requests, performed) at the provider under one idempotency key: the sweep delivers every
    due row of the session's shared database, other tests' rows too."""
    state = provider.stats()["by_key"].get(idem, {})
    return state.get("requests", 0), state.get("performed", 0)


def test_a_stale_attempts_staged_effect_is_never_written_or_sent(
    spawn: Callable[[str], Worker],
    client: ModuleType,
    provider: ProviderStub,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    idem = idempotency_key(key, "notify")
    store = Store(db_url)
    # Given worker A (generation 1) that has staged its "notify" effect and works on,
    a = spawn("a")
    first = client.publish.delay(key, sleep=4.0)
    wait_until(
        lambda: len(ledger.runs(redis_client, prefix, key)) == 1, 20, what="A starts the body"
    )
    # when A pauses past its lease (2 s) and B takes the job (generation 2) and completes it,
    a.pause()
    time.sleep(2.6)
    spawn("b")
    second = client.publish.delay(key)
    assert second.get(timeout=30)["generation"] == 2
    wait_until(
        lambda: _at(provider, idem) == (1, 1), 20, what="B's effect performed at the provider"
    )
    # and A resumes and tries to complete with its staged effect,
    a.resume()
    assert first.get(timeout=30)["generation"] == 2  # A converged on B's result
    # then A's effect was never written: one row, B's, delivered once ...
    (row,) = store.outbox_rows.rows(key=key)
    assert (row.status, row.attempts, row.idempotency_key) == ("delivered", 1, idem)
    assert row.payload["generation"] == 2
    # ... and never sent: nothing is left to deliver, and the provider saw B's request only.
    assert client.outbox.deliver(key=key).delivered == 0
    assert _at(provider, idem) == (1, 1)
    assert provider.stats()["by_key"][idem]["response"]["request"]["generation"] == 2
    actions = [(t.action, t.generation) for t in store.transitions.history(key)]
    assert ("completed", 2) in actions and ("completed", 1) not in actions
    assert ("stale", 1) in actions


def test_sigkill_after_the_provider_accepted_redelivers_with_the_same_key(
    spawn: Callable[[str], Worker],
    client: ModuleType,
    provider: ProviderStub,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = f"export:{uuid.uuid4().hex[:8]}"
    idem = idempotency_key(key, "notify")
    store = Store(db_url)
    # Given a sender that will be SIGKILLed after the provider accepts, before marking delivered,
    faults.arm(redis_client, prefix, "kill", "after_send", idem)
    spawn("w")
    result = client.publish.delay(key)
    assert result.get(timeout=30)["idempotency_key"] == idem
    # when the job completes, its effect is sent once and the sender dies,
    wait_until(lambda: _at(provider, idem)[0] == 1, 20, what="the first delivery")
    wait_until(
        lambda: not faults.armed(redis_client, prefix, "kill", "after_send", idem),
        10,
        what="the kill",
    )
    (row,) = store.outbox_rows.rows(key=key)
    assert (row.status, row.attempts, row.delivered_at) == ("pending", 1, None)

    # then, once its claim expired, the sweep delivers it again with the same key,
    def redelivered() -> bool:
        client.app.send_task(SWEEP_TASK)
        return store.outbox_rows.rows(key=key)[0].status == "delivered"

    wait_until(redelivered, 30, interval=0.5, what="the sweep's redelivery")
    (row,) = store.outbox_rows.rows(key=key)
    assert (row.status, row.attempts) == ("delivered", 2)
    # and the provider, deduping on that key, performed it once although it received it twice.
    assert _at(provider, idem) == (2, 1)


def test_a_completed_key_requeued_by_the_operator_delivers_the_re_runs_effect_once(
    spawn: Callable[[str], Worker],
    client: ModuleType,
    provider: ProviderStub,
    db_url: str,
) -> None:
    """``fence requeue --completed KEY`` through a real worker: the re-run's effect is recorded
    and performed once, under an idempotency key of its own; the first run's stays as it was."""
    from celery_fence.ops.requeue import requeue_finished

    key = f"invoice:{uuid.uuid4().hex[:8]}"
    first, rerun = idempotency_key(key, "notify"), idempotency_key(key, "notify", 1)
    store = Store(db_url)
    spawn("w")
    # Given a key that completed and whose effect the provider performed,
    assert client.publish.delay(key).get(timeout=30)["idempotency_key"] == first
    wait_until(lambda: _at(provider, first) == (1, 1), 20, what="the first run's effect")
    # when the operator requeues it as completed (the CLI's and the admin's path),
    requeue_finished(client.app, store, key, completed=True, reason="test re-run")

    def rerun_delivered() -> bool:
        rows = store.outbox_rows.rows(key=key)
        return len(rows) == 2 and all(r.status == "delivered" for r in rows)

    wait_until(rerun_delivered, 30, what="the re-run's effect delivered")
    # then the re-run staged, recorded and delivered its effect under its own key, once,
    job = store.get(key)
    assert job is not None and job.status == "completed"
    assert job.result["idempotency_key"] == rerun != first
    rows = sorted(store.outbox_rows.rows(key=key), key=lambda r: r.id)
    assert [(r.idempotency_key, r.attempts) for r in rows] == [(first, 1), (rerun, 1)]
    assert rows[1].payload["generation"] == job.generation
    assert _at(provider, rerun) == (1, 1) and _at(provider, first) == (1, 1)
    store.dispose()
