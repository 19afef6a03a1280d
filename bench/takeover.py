"""``--takeover``: time-to-takeover, fault x broker, with real workers and real signals.

For each fault and broker, two fresh workers of the acceptance tests' app
(``tests.support.app``, ``--concurrency 1``) share a queue; a job whose body hangs is sent, and
once one worker's pool process runs its body the fault is injected:

- ``pause``: SIGSTOP the pool process running the body (it keeps its message and its key; its
  lease runs out);
- ``kill-child``: SIGKILL that pool process (its worker's main process lives on);
- ``kill-worker``: SIGKILL the whole worker (main process and pool);
- ``lost``: SIGKILL the whole worker and delete its message from the broker (the Redis broker's
  unacked entry; RabbitMQ's queue, once the message came back to it), then start the second
  worker: only recovery finishes it.

The time-to-takeover is from the fault to the moment another attempt claims a newer generation
of the key (its ``lease_claimed`` signal, recorded by the worker). The table prints it in
seconds and in lease TTLs; a cell that did not take over within ``timeout`` prints ``>``.

``before=True`` measures the settings this release replaced: a stranded threshold of 10 TTLs, no
recovery check in the workers, and ``celery_fence.recover`` run by a beat every 2 TTLs (60 s at
the default TTL of 30 s), emulated here by this process.

It uses the services the tests use (``FENCE_TEST_REDIS_URL``, ``FENCE_TEST_BROKER_URL``,
``FENCE_TEST_AMQP_URL``) and a SQLite store in a temporary directory; it starts no servers.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import kombu
import psutil
import redis

from bench.report import table
from celery_fence.testing import faults
from celery_fence.testing.processes import Worker
from celery_fence.testing.waiting import poll_until

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("pause", "kill-child", "kill-worker", "lost")
BROKERS = ("redis", "amqp")
#: ``before``: the old default threshold (TTLs) and beat period (TTLs: 60 s / 30 s).
BEFORE_RECOVER_AFTER_TTLS = 10
BEFORE_BEAT_TTLS = 2.0


def _urls() -> dict[str, str]:
    return {
        "redis": os.environ.get("FENCE_TEST_REDIS_URL", "redis://127.0.0.1:6379/1"),
        "broker": os.environ.get("FENCE_TEST_BROKER_URL", "redis://127.0.0.1:6379/2"),
        "amqp": os.environ.get("FENCE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//"),
    }


def _claims(ledger: redis.Redis, prefix: str, key: str) -> list[dict[str, Any]]:
    entries = [json.loads(raw) for raw in ledger.lrange(f"{prefix}:signals", 0, -1)]
    return [e for e in entries if e["signal"] == "lease_claimed" and e.get("key") == key]


def _lose_redis_message(broker: redis.Redis, key: str) -> int:
    """Delete ``key``'s message from the Redis broker's unacked set (what a lost message
    leaves)."""
    lost = 0
    for tag, raw in broker.hgetall("unacked").items():
        entry = json.loads(raw)
        args = json.loads(base64.b64decode(entry[0]["body"]))[0]
        if args and args[0] == key:
            broker.hdel("unacked", tag)
            broker.zrem("unacked_index", tag)
            lost += 1
    return lost


def measure(
    fault: str,
    broker: str,
    *,
    ttl: float,
    before: bool,
    timeout: float,
    workdir: Path,
) -> float | None:
    """Seconds from ``fault`` to a newer generation's claim, on ``broker``; None: no takeover
    within ``timeout``."""
    urls = _urls()
    prefix = f"tk{uuid.uuid4().hex[:8]}"
    queue = f"{prefix}-q"
    env = {
        "FENCE_T_PREFIX": prefix,
        "FENCE_T_QUEUE": queue,
        "FENCE_T_BROKER": urls["amqp"] if broker == "amqp" else urls["broker"],
        "FENCE_T_BACKEND": urls["broker"],
        "FENCE_T_REDIS": urls["redis"],
        "FENCE_T_DB": f"sqlite:///{workdir / (prefix + '.sqlite3')}",
        "FENCE_T_TTL": str(ttl),
        "FENCE_T_RENEW": str(ttl / 4),
        "FENCE_T_SIGNALS": "1",
        "FENCE_T_RECOVER_INTERVAL": "0" if before else "default",
    }
    if before:
        env["FENCE_T_RECOVER_AFTER"] = str(BEFORE_RECOVER_AFTER_TTLS * ttl)
    os.environ.update(env)
    sys.modules.pop("tests.support.app", None)
    sys.path.insert(0, str(ROOT))
    client = importlib.import_module("tests.support.app")
    from celery_fence import Store, recover

    Store(env["FENCE_T_DB"]).create_schema()
    ledger = redis.Redis.from_url(urls["redis"])

    def worker(name: str) -> Worker:
        return Worker(
            "tests.support.app",
            env=env,
            queue=queue,
            name=f"{name}-{prefix}",
            log_dir=workdir,
            cwd=ROOT,
            pythonpath=[str(ROOT)],
        ).launch()

    # ``lost``: the rescuer starts once the message is gone (RabbitMQ would hand the message
    # of the killed worker to a consumer already there before it could be purged)
    workers = [worker("one")] if fault == "lost" else [worker("one"), worker("two")]
    try:
        for started in workers:
            started.wait_ready()
        key = f"takeover:{uuid.uuid4().hex[:8]}"
        faults.arm(ledger, prefix, "hang", key)
        client.work.apply_async((key,), kwargs={"check": False}, queue=queue)
        # the body started: the claim is registered in the store (a worker killed between its
        # Redis claim and its registration leaves no row to recover: only the broker's own
        # redelivery, e.g. the Redis broker's visibility timeout, brings that message back)
        if not poll_until(lambda: ledger.llen(f"{prefix}:runs:{key}"), 30, 0.05):
            raise RuntimeError(f"{fault}/{broker}: the body never started")
        pid = _claims(ledger, prefix, key)[0]["pid"]
        holder = next(
            w for w in workers if pid in {c.pid for c in psutil.Process(w.pid).children()}
        )
        child = psutil.Process(pid)
        at = time.time()
        if fault == "pause":
            child.send_signal(signal.SIGSTOP)
        elif fault == "kill-child":
            child.send_signal(signal.SIGKILL)
        else:
            holder.kill()
        if fault == "lost":
            _lose(broker, urls, key, queue)
            workers.append(worker("two"))
            workers[-1].wait_ready()
        beat = BEFORE_BEAT_TTLS * ttl
        next_beat = time.monotonic() + beat
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            newer = [c for c in _claims(ledger, prefix, key) if c["generation"] > 1]
            if newer:
                return float(newer[0]["at"]) - at
            if before and time.monotonic() >= next_beat:
                recover(client.app)
                next_beat += beat
            time.sleep(0.05)
        _keep_logs(workers, workdir, prefix)
        return None
    finally:
        for started in workers:
            started.stop(timeout=5)
        client.app.close()
        sys.modules.pop("tests.support.app", None)
        for k in ledger.scan_iter(f"{prefix}:*", count=1000):
            ledger.delete(k)
        ledger.close()
        if broker == "amqp":
            with kombu.Connection(urls["amqp"]) as conn:
                conn.default_channel.queue_delete(queue)
            kombu.pools.reset()


def _keep_logs(workers: Sequence[Worker], workdir: Path, prefix: str) -> None:
    """A cell that did not take over: the live workers dump their threads' stacks (Celery's
    SIGUSR1) into their logs, which are copied out of the temporary directory."""
    for worker in workers:
        if worker.running:
            os.kill(worker.pid, signal.SIGUSR1)
    time.sleep(1.0)
    kept = Path(tempfile.gettempdir()) / f"fence-takeover-{prefix}"
    kept.mkdir(exist_ok=True)
    for worker in workers:
        shutil.copy(worker.log_path, kept / worker.log_path.name)
    print(f"no takeover: worker logs in {kept}", file=sys.stderr)


def _lose(broker: str, urls: dict[str, str], key: str, queue: str) -> None:
    if broker == "redis":
        client = redis.Redis.from_url(urls["broker"])
        try:
            poll_until(lambda: _lose_redis_message(client, key), 10, 0.05)
        finally:
            client.close()
        return
    with kombu.Connection(urls["amqp"]) as conn:  # RabbitMQ gives it back when the worker died
        poll_until(lambda: conn.default_channel.queue_purge(queue) or 0, 15, 0.05)


def run(
    *,
    ttl: float = 2.0,
    faults_: Sequence[str] = FAULTS,
    brokers: Sequence[str] = BROKERS,
    before: bool = False,
    timeout: float | None = None,
    out: Any = sys.stdout,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every fault x broker; print the table; return the figures."""
    limit = timeout if timeout is not None else (30 if before else 10) * ttl
    figures: dict[str, dict[str, float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="fence-takeover-") as tmp:
        for fault in faults_:
            for broker in brokers:
                seconds = measure(
                    fault, broker, ttl=ttl, before=before, timeout=limit, workdir=Path(tmp)
                )
                figures.setdefault(fault, {})[broker] = seconds
                if progress is not None:
                    progress(f"{fault} / {broker}: {seconds}")

    def cell(seconds: float | None) -> str:
        return (
            f"> {limit:g} s" if seconds is None else f"{seconds:.1f} s ({seconds / ttl:.1f} TTLs)"
        )

    rows = [[fault, *(cell(figures[fault][b]) for b in brokers)] for fault in faults_]
    label = "before (10 TTLs, beat every 2 TTLs)" if before else "defaults"
    print(f"\ntime to takeover, TTL {ttl:g} s, {label}", file=out)
    print(table(["fault", *brokers], rows), file=out)
    return {"ttl": ttl, "before": before, "seconds": figures}


__all__ = ["BROKERS", "FAULTS", "measure", "run"]
