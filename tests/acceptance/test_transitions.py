"""Transition records with real workers: signals, logs, the transitions table, Flower.

Signals are recorded by receivers inside the workers (tests/support/signal_recorder.py) into the
Redis ledger; logs are read from the worker's own log file and from a handler that captures every
record whole; Flower is a real process on the test broker.
"""

from __future__ import annotations

import contextlib
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

from celery_fence.store import Store
from celery_fence.store.records import Completion
from celery_fence.testing.processes import free_port
from tests.support import ledger
from tests.support.env import BROKER_URL
from tests.support.worker import ROOT, SpawnWorker, Worker, app_worker, wait_until

acceptance = pytest.mark.acceptance
sqlite_only = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

RECORD_SIGNALS = {"FENCE_T_SIGNALS": "1", "FENCE_T_SIGNALS_RAISE": "1"}
APP = "tests.support.app.work"


def _signals(
    redis_client: redis.Redis, prefix: str, key: str, name: str | None = None
) -> list[dict]:
    entries = [json.loads(v) for v in redis_client.lrange(f"{prefix}:signals", 0, -1)]
    return [e for e in entries if e["key"] == key and (name is None or e["signal"] == name)]


def _worker_of(pid: int, *workers: Worker) -> Worker:
    """The worker whose process group holds ``pid`` (a prefork child of its main process)."""
    group = os.getpgid(pid)
    return next(w for w in workers if w.pid == group)


# -- the pause scenario: signals and the transitions table ------------------------------------


@acceptance
def test_pause_scenario_signals_and_ordered_history(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    key = f"report:{uuid.uuid4().hex[:8]}"
    store = Store(db_url)
    # Given two workers whose receivers record every signal (and a receiver that always raises),
    one, two = spawn_worker("one", **RECORD_SIGNALS), spawn_worker("two", **RECORD_SIGNALS)
    # ... one of them (A) running the job at generation 1 and renewing its lease,
    first = client_app.work.delay(key, sleep=7.0)
    wait_until(lambda: _signals(redis_client, prefix, key, "lease_renewed"), 20, what="renewal")
    claimed_a = _signals(redis_client, prefix, key, "lease_claimed")[0]
    a = _worker_of(claimed_a["pid"], one, two)
    # when A pauses past its TTL (2 s) and the other worker (B) runs a second message,
    a.pause()
    time.sleep(2.6)
    second = client_app.work.delay(key)
    assert second.get(timeout=30)["generation"] == 2
    # and A resumes: it learns it lost the lease, and the store rejects it as stale.
    a.resume()
    assert first.get(timeout=40) == second.get(timeout=1)

    (gen_a, attempt_a), (gen_b, attempt_b) = ledger.run_attempts(redis_client, prefix, key)[:2]
    assert (gen_a, gen_b) == (1, 2)

    def seen(name: str) -> list[tuple[Any, ...]]:
        return [
            (e["sender"], e["attempt_id"], e["generation"])
            for e in _signals(redis_client, prefix, key, name)
        ]

    # Then every signal fired with key, attempt id and generation of the attempt it describes,
    claims = sorted(seen("lease_claimed"), key=lambda seen: seen[2])
    assert claims == [(APP, attempt_a, 1), (APP, attempt_b, 2)]
    assert (APP, attempt_a, 1) in seen("lease_renewed")
    renewals = _signals(redis_client, prefix, key, "lease_renewed")
    assert {e["thread"] for e in renewals} == {"celery-fence-renewer"}
    assert seen("lease_lost") == [(APP, attempt_a, 1)]
    assert _signals(redis_client, prefix, key, "lease_lost")[0]["reason"]
    assert seen("job_completed") == [(APP, attempt_b, 2)]
    assert seen("stale_rejected") == [(APP, attempt_a, 1)]
    assert _signals(redis_client, prefix, key, "stale_rejected")[0]["reason"] == (
        "stored generation 2"
    )
    assert seen("job_retry_scheduled") == [] and seen("job_dead") == []
    # (the raising receivers changed nothing: one result, generation 2's)
    record = store.get(key)
    assert record is not None and (record.status, record.generation) == ("completed", 2)
    # and the transitions table holds the whole history, in order.
    history = [(t.action, t.generation, t.attempt_id) for t in store.transitions.history(key)]
    assert history == [
        ("claimed", 1, attempt_a),
        ("claimed", 2, attempt_b),
        ("completed", 2, attempt_b),
        ("lost", 1, attempt_a),
        ("stale", 1, attempt_a),
    ]
    assert all(t.at is not None for t in store.transitions.history(key))


@acceptance
@sqlite_only
def test_busy_replay_retry_and_dead_signals(
    spawn_worker: SpawnWorker,
    client_app: ModuleType,
    redis_client: redis.Redis,
    prefix: str,
    db_url: str,
) -> None:
    busy_key, retry_key, dead_key = (f"{p}:{uuid.uuid4().hex[:8]}" for p in ("b", "r", "d"))
    spawn_worker("w", concurrency=2, **RECORD_SIGNALS)
    redis_client.set(f"{prefix}:fail_times:{retry_key}", 1)
    # Given a job running, when a second message for its key arrives, it finds the lease busy
    first = client_app.work.delay(busy_key, sleep=1.5)
    wait_until(lambda: ledger.run_attempts(redis_client, prefix, busy_key), 20, what="first run")
    second = client_app.work.delay(busy_key)
    retried = client_app.work.delay(retry_key, fail="transient")
    dead = client_app.work.delay(dead_key, fail="permanent")
    # ... and, once the first completed, replays its stored result.
    assert second.get(timeout=40) == first.get(timeout=5)
    assert retried.get(timeout=40)["generation"] == 2
    dead.get(timeout=40, propagate=False)
    assert dead.state == "FAILURE"

    (busy,) = _signals(redis_client, prefix, busy_key, "lease_busy")
    assert busy["generation"] is None and busy["remaining"] > 0
    assert busy["reason"].startswith("held for")
    (replayed,) = _signals(redis_client, prefix, busy_key, "job_replayed")
    assert (replayed["generation"], replayed["reason"]) == (2, "already completed")
    assert replayed["attempt_id"] not in {busy["attempt_id"], first.get()["attempt_id"]}

    (run1, _), (run2, attempt2) = ledger.run_attempts(redis_client, prefix, retry_key)
    assert (run1, run2) == (1, 2)
    (retry,) = _signals(redis_client, prefix, retry_key, "job_retry_scheduled")
    assert (retry["generation"], retry["attempts"]) == (1, 1)
    assert retry["reason"].startswith("transient error ConnectionError")
    assert retry["countdown"] >= 0
    (done,) = _signals(redis_client, prefix, retry_key, "job_completed")
    assert (done["attempt_id"], done["generation"]) == (attempt2, 2)

    (died,) = _signals(redis_client, prefix, dead_key, "job_dead")
    assert (died["generation"], died["attempts"]) == (1, 1)
    assert died["reason"].startswith("permanent error PermanentError")
    record = Store(db_url).get(dead_key)
    assert record is not None and record.status == "dead"


# -- no payloads in logs ------------------------------------------------------------------------


def _captured(base: Path) -> list[dict]:
    records = []
    for path in base.parent.glob(f"{base.name}.*.jsonl"):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records


@acceptance
@sqlite_only
@pytest.mark.parametrize("redact", [False, True], ids=["celery-as-is", "redacted"])
def test_no_payload_in_logs_at_debug(
    spawn_worker: SpawnWorker, client_app: ModuleType, tmp_path: Path, db_url: str, redact: bool
) -> None:
    marker = f"PAYLOAD-{uuid.uuid4().hex}"
    key, failing = f"leak:{uuid.uuid4().hex[:8]}", f"leak-fail:{uuid.uuid4().hex[:8]}"
    capture = tmp_path / "records"
    # Given a worker at DEBUG with every record captured whole,
    worker = spawn_worker(
        "leak",
        loglevel="DEBUG",
        FENCE_T_SIGNALS="1",
        FENCE_T_LOG_CAPTURE=str(capture),
        FENCE_T_REDACT="1" if redact else "0",
    )
    # when jobs run whose args, kwargs and result carry the marker (one of them failing),
    result = client_app.echo.delay(key, f"arg-{marker}", secret=f"kw-{marker}").get(timeout=30)
    assert result == {"args": [f"arg-{marker}"], "kwargs": {"secret": f"kw-{marker}"}}
    failed = client_app.work.delay(failing, fail="permanent", marker=marker)
    failed.get(timeout=30, propagate=False)
    wait_until(lambda: "succeeded in" in worker.log(), 10, what="Celery's success line")
    wait_until(lambda: f"[{failed.id}] raised" in worker.log(), 10, what="its failure line")
    worker.stop()
    log, records = worker.log(), _captured(capture)
    assert records, "the capture handler saw nothing"

    # Then celery-fence's own records never carry it, whole (message, args, extras) ...
    own = [r for r in records if r["name"].startswith("celery_fence")]
    assert own and not [r for r in own if marker in json.dumps(r)]
    # ... while naming the key and the generation, as fields and in the text;
    fields = {(r["record"].get("action"), r["record"].get("fence_key")) for r in own}
    assert ("'claimed'", repr(key)) in fields and ("'completed'", repr(key)) in fields
    assert f"fence claimed key={key} generation=1 attempt=" in log
    assert f"fence completed key={key} generation=1 attempt=" in log
    # the task's own log line names its attempt,
    (line,) = [ln for ln in log.splitlines() if "echo body ran" in ln]
    assert f"key={key} generation=1 attempt=" in line
    if redact:
        # and with fence_redact_celery_logs the marker is nowhere: not in the text, not in any
        # record's args or extras (Celery's success, pool, received and failure lines).
        assert marker not in log
        assert not [r["name"] for r in records if marker in json.dumps(r)]
        assert "<redacted>" in log
    else:
        # and without it Celery itself prints payloads (which is why the setting exists).
        assert marker in log


# -- Flower -----------------------------------------------------------------------------------


def _http(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return None


@pytest.fixture
def flower(tmp_path: Path, worker_env: dict[str, str]) -> Iterator[int]:
    """A real Flower process on the test broker; yields its port."""
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


def _fence_event_count(port: int, event_type: str) -> float:
    metrics = _http(port, "/metrics") or ""
    total = 0.0
    for line in metrics.splitlines():
        labels = (f'type="{event_type}"', f'task="{APP}"')
        if line.startswith("flower_events_total{") and all(label in line for label in labels):
            total += float(line.rsplit(" ", 1)[1])
    return total


@acceptance
@sqlite_only
def test_flower_counts_fence_events(
    flower: int, client_app: ModuleType, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # Given a worker that sends task events (-E) and a Flower process listening on the broker,
    worker = app_worker(
        "tests.support.app",
        env=worker_env,
        queue=worker_env["FENCE_T_QUEUE"],
        name=f"events-{uuid.uuid4().hex[:6]}",
        log_dir=tmp_path,
        extra_args=("-E",),
    )
    try:
        worker.start()
        # when fenced jobs run (Flower may subscribe a moment after /healthcheck answers: repeat),
        for _ in range(6):
            client_app.work.delay(f"flower:{uuid.uuid4().hex[:8]}").get(timeout=30)
            with contextlib.suppress(AssertionError):
                wait_until(
                    lambda: _fence_event_count(flower, "task-fencecompleted") >= 1,
                    5,
                    0.2,
                    what="a fence event in /metrics",
                )
                break
        # then /metrics counts them by type,
        assert _fence_event_count(flower, "task-fenceclaimed") >= 1
        assert _fence_event_count(flower, "task-fencecompleted") >= 1
        # and while a job runs Flower shows its fence state.
        running = client_app.work.delay(f"flower:{uuid.uuid4().hex[:8]}", sleep=3.0)

        def state() -> str | None:
            info = _http(flower, f"/api/task/info/{running.id}")
            return json.loads(info).get("state") if info else None

        wait_until(lambda: state() in {"FENCECLAIMED", "FENCERENEWED"}, 15, 0.1, what="fence state")
        running.get(timeout=30)
        wait_until(lambda: state() == "SUCCESS", 15, 0.1, what="Celery's final state wins")
    finally:
        worker.stop()


# -- the transitions table can be turned off ---------------------------------------------------


def test_record_transitions_off_writes_no_history(db_url: str) -> None:
    key = f"quiet:{uuid.uuid4().hex[:8]}"
    store = Store(db_url, record_transitions=False)
    # Given fence_record_transitions=False, when a job is claimed, loses a lease and completes,
    store.register(key, generation=1, attempt_id="a1", task_name="t")
    store.record(key, action="lost", generation=1, attempt_id="a1", reason="test")
    store.end(key, Completion(generation=1, attempt_id="a1", result={"ok": True}))
    # then the job is stored and no history is written.
    record = store.get(key)
    assert record is not None and record.status == "completed"
    assert store.transitions.history(key) == []
    # (the default records the same steps)
    loud = Store(db_url)
    other = f"loud:{uuid.uuid4().hex[:8]}"
    loud.register(other, generation=1, attempt_id="a1", task_name="t")
    loud.end(other, Completion(generation=1, attempt_id="a1", result=None))
    assert [t.action for t in loud.transitions.history(other)] == ["claimed", "completed"]
    store.dispose()
    loud.dispose()
