"""The example project's demo runs end to end, and what it reports is what the store holds.

The demo uses a SQLite file in this test's directory, a key prefix and queue of its own (Redis
db 3), so it never meets the other tests' state.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_fence.ops.outbox import idempotency_key, storage_key
from celery_fence.store import Store
from tests.support.leftovers import ctrl_c_default, kill_groups, processes_mentioning
from tests.support.worker import ROOT, wait_until

pytestmark = pytest.mark.acceptance


def _gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # the worker's whole process group: main process and pool children
    except ProcessLookupError:
        return True
    return False


def _demo(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "example_project.demo", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ctrl_c_default,
    )


def test_the_demo_tells_the_story_and_its_summary_matches_the_store(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    proc = _demo("--workdir", str(tmp_path / "demo"), "--summary", str(summary_path))
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "What happened" in out
    summary = json.loads(summary_path.read_text())
    store = Store(summary["database_url"])
    jobs = summary["jobs"]

    # The pause: generation 2 completed each job, generation 1 was rejected as stale.
    for name in ("report", "export"):
        job = jobs[name]
        record = store.get(job["key"])
        assert record is not None
        assert (record.status, record.generation, record.attempt_id, record.result) == (
            "completed",
            job["generation"],
            job["attempt_id"],
            job["result"],
        )
        assert job["generation"] == 2
        stale = [
            {"generation": t.generation, "attempt_id": t.attempt_id}
            for t in store.transitions.history(job["key"])
            if t.action == "stale"
        ]
        assert stale == job["stale"] and [s["generation"] for s in stale] == [1]
        assert ("completed", 1) not in [
            (t.action, t.generation) for t in store.transitions.history(job["key"])
        ]

    # The report's row in the app's own table (written inside self.fence.transaction()) is the
    # completing attempt's; the paused attempt never committed one.
    report = jobs["report"]
    engine = sa.create_engine(summary["database_url"])
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT id, generation, attempt_id FROM example_reports WHERE id = ?",
            (report["result"]["report_id"],),
        ).all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [(report["result"]["report_id"], 2, report["attempt_id"])]
    assert summary["report_row"]["generation"] == 2
    assert summary["report_row"]["attempt_id"] == report["attempt_id"]
    # What the demo printed about the paused attempt is the store's own record of it: refused
    # (never completed), by the attempt that claimed generation 1.
    refused = [
        {"action": str(t.action), "reason": t.reason, "attempt_id": t.attempt_id}
        for t in store.transitions.history(report["key"])
        if t.generation == 1 and t.action != "claimed"
    ]
    assert report["refused"] == refused
    assert "stale" in [t["action"] for t in refused]
    assert "completed" not in [t["action"] for t in refused]
    assert {t["attempt_id"] for t in refused} == {report["stale"][0]["attempt_id"]}
    printed = ", ".join(f"{t['action']} ({t['reason']})" for t in refused)
    assert f"the store recorded for generation 1 after its claim: {printed}" in out

    # The export: both attempts wrote the same deterministic object; a new version, a new one.
    export, export2 = jobs["export"], jobs["export_v2"]
    key_v1 = storage_key(export["key"], export["input_version"], suffix=".csv")
    stored = store.get(export["key"])
    assert stored is not None
    assert export["object_key"] == key_v1 == stored.result["object_key"]
    assert [w["generation"] for w in export["object_writes"]] == [1, 2]
    assert export["object_writes"][0]["attempt_id"] == export["stale"][0]["attempt_id"]
    assert export["object_writes"][1]["attempt_id"] == export["attempt_id"]
    assert export2["input_version"] == export["input_version"] + 1
    key_v2 = storage_key(export2["key"], export2["input_version"], suffix=".csv")
    assert export2["object_key"] == key_v2
    assert export2["object_key"] != key_v1
    objects = Path(summary["objects_dir"])
    on_disk = sorted(str(p.relative_to(objects)) for p in objects.rglob("*.csv") if p.is_file())
    assert on_disk == summary["objects"] == sorted([key_v1, export2["object_key"]])

    # The outbox: each row as stored; the email delivered twice and performed once.
    by_idem = {d["idempotency_key"]: d for d in summary["deliveries"]}
    outbox_rows = [r for j in jobs.values() for r in store.outbox_rows.rows(key=j["key"])]
    assert len(outbox_rows) == len(by_idem) == 3
    for row in outbox_rows:
        d = by_idem[row.idempotency_key]
        assert (d["key"], d["effect"], d["status"], d["deliveries"]) == (
            row.key,
            row.name,
            row.status,
            row.attempts,
        )
        assert row.idempotency_key == idempotency_key(row.key, row.name)
        assert row.status == "delivered" and d["provider_performed"] == 1
    email = by_idem[idempotency_key(export["key"], "email")]
    assert (email["deliveries"], email["provider_requests"], email["provider_performed"]) == (
        2,
        2,
        1,
    )
    for d in by_idem.values():  # the provider's own per-key count, as printed
        assert f"performed {d['provider_performed']}x at the provider" in out
    provider = summary["provider"]
    assert provider["performed"] == 3
    assert provider["requests"] == sum(d["provider_requests"] for d in by_idem.values()) == 4

    # It stopped every worker it started, and it was quick.
    assert len(summary["worker_pids"]) == 2
    assert all(_gone(pid) for pid in summary["worker_pids"])
    assert summary["elapsed_seconds"] < 60
    store.dispose()


def test_ctrl_c_stops_every_process_the_demo_started(tmp_path: Path) -> None:
    # Given the demo running on a redis-server of its own, with a worker up,
    workdir = tmp_path / "demo"
    proc = _demo("--workdir", str(workdir), "--own-redis")
    lines: list[str] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            lines.append(line)
            if "worker A ready" in line:
                break
        text = "".join(lines)
        redis_started = re.search(r"started redis-server on port \d+ \(pid (\d+)\)", text)
        worker_ready = re.search(r"worker A ready \(pid (\d+)\)", text)
        assert redis_started and worker_ready, text
        redis_pid, worker_pid = int(redis_started[1]), int(worker_ready[1])
        # when it is interrupted (Ctrl-C),
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        lines.append(out)
        # then it says so and nothing it started is left running.
        assert proc.returncode == 130, "".join(lines)
        assert "interrupted" in out
        wait_until(lambda: _gone(worker_pid), 10, what="the worker's process group to be gone")
        wait_until(lambda: _gone(redis_pid), 10, what="the demo's redis-server to be gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()
        # On a failure above, the demo never stopped its children (each in a process group of
        # its own). Each names the demo's directory (the worker in its environment, redis-server
        # as its working directory), so they are found whether or not the demo reported them,
        # and a reported pid that ended meanwhile, perhaps reused by another process, is never
        # hit.
        kill_groups(processes_mentioning(str(workdir)))
