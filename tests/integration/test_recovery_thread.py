"""The workers' own recovery check (celery_fence.ops.recovery_thread) against real Redis (throttle,
leases, broker) and SQLite: one check per interval across workers, a takeover header on the
re-send of a ``running`` job, and a thread that starts and stops with the process's runtime."""

from __future__ import annotations

import dataclasses
import importlib
import sys
import time
from collections.abc import Iterator
from types import ModuleType

import pytest
import redis

from celery_fence.config import FenceConfig
from celery_fence.ops.recovery_thread import RecoveryThread
from celery_fence.store import Store
from celery_fence.store.records import TAKEOVER_HEADER
from tests.integration.test_recover import _messages, _stranded

TTL = 0.5  # stranded after 3 TTLs: 1.5 s


@pytest.fixture
def app_module(
    worker_env: dict[str, str], sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ModuleType]:
    env = {**worker_env, "FENCE_T_DB": sqlite_url, "FENCE_T_TTL": str(TTL), "FENCE_T_RENEW": "0.1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("tests.support.app", None)
    module = importlib.import_module("tests.support.app")
    yield module
    module.app.close()
    sys.modules.pop("tests.support.app", None)


def _thread(module: ModuleType, name: str) -> RecoveryThread:
    config = dataclasses.replace(FenceConfig.from_app(module.app), recover_interval=5.0)
    return RecoveryThread(module.app, config, owner=name)


def test_workers_checks_resend_a_stranded_job_once_with_its_takeover(
    app_module: ModuleType,
    worker_env: dict[str, str],
    sqlite_url: str,
    redis_client: redis.Redis,
    prefix: str,
) -> None:
    broker = redis.Redis.from_url(worker_env["FENCE_T_BROKER"])
    store = Store(sqlite_url)
    queue = worker_env["FENCE_T_QUEUE"]
    try:
        # Given a job left running by an attempt whose lease is gone, quiet for 3 TTLs ...
        stuck = _stranded(store, queue, "running")
        time.sleep(3 * TTL + 0.2)
        # ... when two workers' checks run within one interval,
        one, two = _thread(app_module, "one"), _thread(app_module, "two")
        one.check()
        two.check()
        # then one of them scanned (the other was throttled) and sent the job once,
        assert (one.checks, two.checks) == (1, 0)
        assert redis_client.pttl(f"{prefix}:recover:check") > 0
        messages = [m for m in _messages(broker, queue) if m["body"][0][0] == stuck.key]
        assert len(messages) == 1
        # with the generation it took over and when the job last moved,
        takeover = messages[0]["headers"][TAKEOVER_HEADER]
        assert takeover["generation"] == 1
        assert takeover["moved"] == pytest.approx(stuck.updated_at.timestamp(), abs=0.01)
        record = store.get(stuck.key)
        assert record is not None and record.status == "pending"
        # a header never stored with the job's request (a later re-send is no takeover).
        assert TAKEOVER_HEADER not in str(record.request)
        one.shutdown(1.0)
        two.shutdown(1.0)
    finally:
        broker.delete(queue)
        broker.close()
        store.dispose()


def test_the_thread_runs_checks_until_shut_down(app_module: ModuleType) -> None:
    config = dataclasses.replace(FenceConfig.from_app(app_module.app), recover_interval=0.2)
    thread = RecoveryThread(app_module.app, config, owner="w")
    assert thread.start()
    deadline = time.monotonic() + 5
    while thread.checks < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert thread.checks >= 2  # the throttle (0.18 s) lets one check per interval through
    thread.shutdown(2.0)
    assert not thread.running
