"""The store's waits under gevent stay bounded and cooperative, in a process gevent patched as
``celery worker -P gevent`` does: a PostgreSQL that stops answering (a TCP proxy that stops
forwarding) ends the call within ``fence_database_timeout`` while the other greenlets run on,
and a SQLite lock held elsewhere fails a write quickly instead of freezing the process."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_fence.store import Store
from celery_fence.store.green import GREEN_SQLITE_BUSY_TIMEOUT
from celery_fence.testing.proxy import TcpProxy

TIMEOUT = 1.0
#: What a bounded call may take past the timeout: the watchdog's tick, a busy box.
SLACK = 1.5

#: Runs in a gevent-patched child: one store call, timed, while a greenlet ticks every 50 ms.
CHILD = """
from gevent import monkey

monkey.patch_all()
import json, sys, time

import gevent

from celery_fence.store.records import Completion
from celery_fence.store import Store

url, key, wait_for_go = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
store = Store(url, database_timeout=float(sys.argv[4]))
if wait_for_go:
    store.register(key, generation=1, attempt_id="a", task_name="t")
    print("ready", flush=True)
    sys.stdin.readline()
ticks = [0]


def tick():
    while True:
        gevent.sleep(0.05)
        ticks[0] += 1


gevent.spawn(tick)
gevent.sleep(0)
started = time.monotonic()
try:
    if wait_for_go:
        store.end(key, Completion(generation=1, attempt_id="a", result=1))
    else:
        store.register(key, generation=1, attempt_id="a", task_name="t")
    error = None
except Exception as exc:
    error = type(exc).__name__
print(json.dumps({"elapsed": time.monotonic() - started, "ticks": ticks[0], "error": error}))
"""


def _child(url: str, *, wait_for_go: bool) -> subprocess.Popen[str]:
    key = f"green:{uuid.uuid4().hex[:8]}"
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, url, key, "1" if wait_for_go else "0", str(TIMEOUT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


def _result(child: subprocess.Popen[str], bound: float) -> dict[str, object]:
    try:
        out, _ = child.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"the store call under gevent was still blocked after {bound}s")
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_silent_postgresql_under_gevent_is_cut_in_time_and_other_greenlets_run(
    pg_url: str, proxy: TcpProxy, driver: str
) -> None:
    url = sa.engine.make_url(pg_url).set(
        drivername=f"postgresql+{driver}", host="127.0.0.1", port=proxy.port
    )
    # Given a gevent-patched process whose store works through a proxy ...
    child = _child(url.render_as_string(hide_password=False), wait_for_go=True)
    assert child.stdout is not None and child.stdin is not None
    assert child.stdout.readline().strip() == "ready"
    # ... when the path to PostgreSQL goes silent (nothing closed, nothing answered)
    proxy.stall()
    child.stdin.write("go\n")
    child.stdin.flush()
    # Then the completion fails as a database error within the timeout, and the hub kept
    # running meanwhile: the ticking greenlet (as the renewer's would) ran during the wait
    result = _result(child, TIMEOUT + SLACK + 8)
    assert result["error"] == "OperationalError", result
    assert float(result["elapsed"]) < TIMEOUT + SLACK, result  # type: ignore[arg-type]
    assert int(result["ticks"]) >= 0.5 * TIMEOUT / 0.05, result  # type: ignore[call-overload]


def test_a_sqlite_lock_held_elsewhere_fails_a_write_quickly_under_gevent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fence.sqlite3'}"
    Store(url).create_schema()
    # Given another connection holding SQLite's write lock
    holder = sqlite3.connect(tmp_path / "fence.sqlite3", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        # When a gevent-patched process's store writes
        result = _result(_child(url, wait_for_go=False), 15)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    # Then the write fails after the short busy timeout, not SQLite's default 30 s
    assert result["error"] == "OperationalError", result
    assert float(result["elapsed"]) < GREEN_SQLITE_BUSY_TIMEOUT + SLACK, result  # type: ignore[arg-type]
