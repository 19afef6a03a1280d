"""Flower tells the attempt that counted from the stale one, under one Celery task id.

A real Flower (with ``celery_fence.contrib.flower.install()`` in its ``--conf`` file) on the test
broker, two real workers sending events (``-E``), and a real takeover: the first worker is paused
(SIGSTOP) past its lease, recovery re-sends the job under the *same* task id, the second worker
completes it, the first resumes and the store rejects it as stale. Flower's task API then shows
the key, the generation that counted, and both attempts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_fence.leases.lease import LeaseStore
from celery_fence.store import Store
from celery_fence.testing.processes import free_port
from tests.support import ledger
from tests.support.env import BROKER_URL
from tests.support.worker import ROOT, SpawnWorker, wait_until

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]

FLOWER_CONF = "from celery_fence.contrib.flower import install\ninstall()\n"


def _http(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


@pytest.fixture
def fenced_flower(tmp_path: Path, worker_env: dict[str, str]) -> Iterator[int]:
    """A real Flower process on the test broker, its config file installing the fence view."""
    conf = tmp_path / "flowerconfig.py"
    conf.write_text(FLOWER_CONF)
    port = free_port()
    log = open(tmp_path / "flower.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.app",
            "--broker",
            BROKER_URL,
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
            f"--conf={conf}",
        ],
        env={
            **os.environ,
            **worker_env,
            "PYTHONPATH": str(ROOT),
            "FLOWER_UNAUTHENTICATED_API": "true",
        },
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(lambda: _http(port, "/healthcheck") == "OK", 60, 0.2, what="flower up")
        yield port
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def _info(port: int, task_id: str) -> dict[str, Any]:
    body = _http(port, f"/api/task/info/{task_id}")
    return json.loads(body) if body else {}


def _counted(port: int, task_id: str) -> Any:
    return _info(port, task_id).get("fence_counted")


def test_flower_shows_which_attempt_of_a_task_id_counted(
    fenced_flower: int,
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    leases: LeaseStore,
    fence_store: Store,
) -> None:
    from celery_fence.ops.recovery import recover

    key = f"report:{uuid.uuid4().hex[:8]}"
    # Given Flower listening (it may subscribe a moment after /healthcheck answers: wait until a
    # first job's events reach it),
    one = spawn_worker("one", extra_args=("-E",))
    for _ in range(6):  # (no worker heartbeats in tests: a job's events show it is listening)
        warm = client_app.work.delay(f"warm:{uuid.uuid4().hex[:8]}")
        warm.get(timeout=30)
        with contextlib.suppress(AssertionError):
            wait_until(functools.partial(_counted, fenced_flower, warm.id), 5, 0.2)
            break
    # and an attempt (generation 1, worker one) paused mid-body past its lease,
    first = client_app.work.delay(key, sleep=3.0, check=False)
    wait_until(lambda: ledger.run_count(redis_client, prefix, key) == 1, 30, what="body started")
    wait_until(lambda: _info(fenced_flower, first.id).get("fence_key"), 15, 0.2, what="claimed")
    one.pause()
    try:
        wait_until(lambda: leases.remaining(key)[0] is None, 10, what="lease expired")
        # when recovery re-sends it under the same task id and worker two completes it,
        two = spawn_worker("two", extra_args=("-E",))
        time.sleep(1.1)
        assert key in recover(client_app.app, older_than=1.0).sent
        wait_until(
            lambda: (r := fence_store.get(key)) is not None and r.status == "completed",
            40,
            what="generation 2 completed",
        )
    finally:
        one.resume()
    # and worker one resumes, finishes its body and is rejected as stale,
    wait_until(
        lambda: "stale" in [t.action for t in fence_store.transitions.history(key)],
        30,
        what="stale",
    )
    assert first.get(timeout=30) == fence_store.get(key).result  # type: ignore[union-attr]
    attempts = ledger.run_attempts(redis_client, prefix, key)
    (gen_a, attempt_a), (gen_b, attempt_b) = sorted(attempts)[:2]
    assert (gen_a, gen_b) == (1, 2)
    # then Flower's task API, for that one task id, shows the key and the generation that
    # counted, names the counted attempt (worker two) and the stale one (worker one),
    wait_until(lambda: _info(fenced_flower, first.id).get("fence_stale"), 20, 0.2, what="stale")
    info = _info(fenced_flower, first.id)
    assert info["state"] == "SUCCESS"
    assert info["fence_key"] == key
    assert info["fence_generation"] == 2
    assert (
        info["fence_counted"]
        == f"generation 2, attempt {attempt_b} on {two.name}@"
        + (info["fence_counted"].rsplit("@", 1)[1])
    )
    assert f"generation 1, attempt {attempt_a} on {one.name}@" in info["fence_stale"]
    assert "stored generation 2" in info["fence_stale"]
    assert attempt_b not in info["fence_stale"]
    assert f"attempt {attempt_a} on {one.name}@" in info["fence_attempts"]
    assert "completed (counted)" in info["fence_attempts"]
    # and its task page prints them.
    page = _http(fenced_flower, f"/task/{first.id}") or ""
    assert key in page and "Fence counted" in page and "Fence stale" in page
