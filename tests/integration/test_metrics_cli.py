"""``celery -A proj fence metrics``: the store's gauges, read by one process from the store."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import time
import urllib.request
import uuid

import pytest
import sqlalchemy as sa

from celery_fence.schema import jobs
from celery_fence.store import Effect, Store
from celery_fence.store.records import Completion, Dead
from tests.integration.test_cli import CELERY, ROOT, fence_cli, ok
from tests.support.prom import free_port, sample

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def _gauge(text: str, line_start: str) -> float:
    found = [line for line in text.splitlines() if line.startswith(line_start)]
    assert len(found) == 1, (line_start, text)
    return float(found[0].rsplit(" ", 1)[1])


def test_fence_metrics_prints_jobs_stuck_and_outbox_gauges(
    worker_env: dict[str, str], store: Store, prefix: str
) -> None:
    task = f"{prefix}.report"
    # Given a completed job with a pending outbox effect, a dead job and a stranded one ...
    done, dead, stranded = (f"{prefix}:{n}:{uuid.uuid4().hex[:6]}" for n in ("a", "b", "c"))
    for key in (done, dead, stranded):
        store.register(key, generation=1, attempt_id=f"{key}-1", task_name=task, request=None)
    effect = Effect("mail", {"to": "x"}, f"{prefix}-idem")
    store.end(done, Completion(1, f"{done}-1", {"ok": True}, (effect,)))
    store.end(dead, Dead(1, f"{dead}-1", ValueError("bad"), "test"))
    an_hour_ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
    with store.db.engine.begin() as conn:  # left running an hour ago, no lease: stranded
        conn.execute(sa.update(jobs).where(jobs.c.key == stranded).values(updated_at=an_hour_ago))
    # When the operator prints the store's gauges once,
    text = ok(fence_cli(worker_env, "metrics"))
    # then they say what the store holds (by task and status), never a key.
    labels = f'{{status="%s",task="{task}"}}'
    assert _gauge(text, "celery_fence_jobs" + labels % "completed") == 1
    assert _gauge(text, "celery_fence_jobs" + labels % "dead") == 1
    assert _gauge(text, "celery_fence_jobs" + labels % "running") == 1
    assert _gauge(text, f'celery_fence_stuck_jobs{{task="{task}"}}') == 1
    assert _gauge(text, 'celery_fence_outbox_effects{status="pending"}') == 1
    assert _gauge(text, "celery_fence_outbox_oldest_pending_age_seconds") >= 0
    assert _gauge(text, "celery_fence_store_up") == 1
    assert done not in text and stranded not in text


def test_fence_metrics_serve_answers_scrapes_until_terminated(
    worker_env: dict[str, str], store: Store
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [CELERY, "-A", "tests.support.app", "fence", "metrics", "--serve", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, **worker_env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "fence metrics --serve never answered"
                time.sleep(0.2)
        assert sample(text, "celery_fence_store_up") == 1
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, (out, err)
