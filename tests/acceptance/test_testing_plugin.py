"""The pytest plugin, as a user meets it: a throwaway project in a temporary directory, run by a
pytest subprocess that loads the plugin through its entry point.

A fenced task passes every window; a plain Celery task doing the same write (an upsert of the
result row and its transition) fails ``assert_converged`` naming the window; nothing is left
behind — no worker process, no Redis key, no broker queue, no PostgreSQL schema — after a pass, a
failure, or Ctrl-C. The plugin also runs beside pytest-celery (and ``celery.contrib.pytest``'s
``celery_app``) without Docker, and warns when a fenced task runs eagerly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_fence import FencedTask
from celery_fence.errors import FenceEagerWarning
from celery_fence.ops.outbox import idempotency_key
from celery_fence.testing.processes import group_alive
from tests.support.env import BROKER_URL, PG_ADMIN_URL, REDIS_URL
from tests.support.leftovers import ctrl_c_default
from tests.support.worker import wait_until

pytestmark = pytest.mark.acceptance

PROJECT = f'''
import datetime as dt
import os

import sqlalchemy as sa
from celery import Celery

from celery_fence import FencedTask, Outbox
from celery_fence.chaos.arms import TTLLockTask
from celery_fence.schema import jobs, transitions

app = Celery("proj", broker="{BROKER_URL}")
outbox = Outbox(app)


@outbox.handler("notify")
def notify(payload, *, idempotency_key):
    """The app's real handler (it would email someone): writes to PROJ_SENT, for one test."""
    if os.environ.get("PROJ_SENT"):
        with open(os.environ["PROJ_SENT"], "a") as f:
            f.write(idempotency_key + "\\n")


app.conf.update(
    fence_redis_url="{REDIS_URL}",
    fence_lease_ttl=30.0,
)
# a control arm, for one test: the store without the fence
if os.environ.get("PROJ_UNFENCED") == "1":
    from celery_fence.chaos.arms import UnfencedTask as FencedTask  # noqa: F811
block_rows = sa.Table(
    "proj_block_rows",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("generation", sa.Integer, nullable=False),
)


latest = sa.Table(
    "proj_latest",
    block_rows.metadata,
    sa.Column("key", sa.String(64), nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
)


def _put_latest(conn, key, generation):
    conn.execute(latest.delete().where(latest.c.key == key))
    conn.execute(latest.insert().values(key=key, generation=generation))


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"write:{{n}}")
def check_then_write(self, n):
    """The mistake: check the lease, then write with a plain transaction."""
    self.fence.check()
    engine = sa.create_engine(app.conf.fence_database_url)
    with engine.begin() as conn:
        _put_latest(conn, f"write:{{n}}", self.fence.generation)
    engine.dispose()
    return {{"n": n}}


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"write:{{n}}")
def check_then_write_fenced(self, n):
    self.fence.check()
    with self.fence.transaction() as conn:
        _put_latest(conn, f"write:{{n}}", self.fence.generation)
    return {{"n": n}}


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"rows:{{n}}")
def upsert_in_block(self, n):
    with self.fence.transaction() as conn:
        _put_latest(conn, f"rows:{{n}}", self.fence.generation)
    return {{"n": n}}


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"rows:{{n}}")
def append_in_block(self, n):
    """The mistake: append a row in the block, as if the body ran once."""
    with self.fence.transaction() as conn:
        conn.execute(latest.insert().values(key=f"rows:{{n}}", generation=self.fence.generation))
    return {{"n": n}}


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"block:{{n}}")
def with_block(self, n):
    with self.fence.transaction() as conn:
        conn.execute(block_rows.insert().values(generation=self.fence.generation))
    return {{"n": n}}


step_rows = sa.Table(
    "proj_step_rows",
    block_rows.metadata,
    sa.Column("key", sa.String(64), nullable=False),
    sa.Column("step", sa.Integer, nullable=False),
    sa.Column("generation", sa.Integer, nullable=False),
)


def _steps(fence, key):
    def step(k):
        with fence.transaction() as conn:
            conn.execute(step_rows.insert().values(key=key, step=k, generation=fence.generation))
        return k

    return [fence.run_step(f"step{{k}}", step, k) for k in (1, 2, 3)]


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"steps:{{n}}")
def with_steps(self, n):
    return _steps(self.fence, f"steps:{{n}}")


from celery_fence.chaos.arms import UnfencedStepsTask  # control arm: steps are plain calls


@app.task(base=UnfencedStepsTask, bind=True, fence_key=lambda n: f"plain-steps:{{n}}")
def with_plain_steps(self, n):
    return _steps(self.fence, f"plain-steps:{{n}}")


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"job:{{n}}")
def fenced(self, n):
    self.fence.effects.add("notify", {{"n": n}})
    return {{"n": n, "pid": os.getpid()}}


from celery_fence.chaos.arms import UnfencedStore, UnfencedTask, loosened  # control arms
from celery_fence.pipeline.backends import backends


class RerunStore(UnfencedStore):
    """Broken: a registration takes a completed job's row (its body runs again)."""

    statements = loosened(
        UnfencedStore.statements,
        ("register",),
        "WHERE fence_jobs.status NOT IN ('completed', 'dead')",
        "WHERE 1 = 1",
    )


class RerunTask(FencedTask, fence_base=True):
    def _make_backends(self, config):
        return backends(config, store_class=RerunStore)


@app.task(base=RerunTask, bind=True, fence_key=lambda n: f"rerun:{{n}}")
def rerun(self, n):
    return {{"n": n, "pid": os.getpid()}}


@app.task(base=UnfencedTask, bind=True, fence_key=lambda n: f"arm:{{n}}")
def arm(self, n):
    """The fence's own task on a store without the generation fence."""
    self.fence.effects.add("notify", {{"n": n}})
    return {{"n": n, "pid": os.getpid()}}


def _store_rows(key, task_name, attempt, *, first_writer_wins, result, outbox_effect=False):
    """What a broken store would do: record a completion (its own generation: one more than the
    last), and write the job row (over the old one, or only if absent)."""
    from celery_fence.ops.outbox import idempotency_key
    from celery_fence.schema import outbox

    now = dt.datetime.now(dt.timezone.utc)
    engine = sa.create_engine(app.conf.fence_database_url)
    with engine.begin() as conn:
        done = conn.execute(sa.select(sa.func.count()).select_from(transitions).where(
            transitions.c.key == key, transitions.c.action == "completed")).scalar()
        gen = done + 1
        row = conn.execute(sa.select(jobs.c.generation).where(jobs.c.key == key)).first()
        values = dict(task_name=task_name, status="completed", generation=gen, attempts=gen,
                      attempt_id=attempt, result=result, updated_at=now, finished_at=now)
        if row is None:
            conn.execute(jobs.insert().values(key=key, created_at=now, **values))
        elif not first_writer_wins:
            conn.execute(jobs.update().where(jobs.c.key == key).values(**values))
        conn.execute(transitions.insert().values(
            key=key, generation=gen, attempt_id=attempt, action="completed", at=now))
        if outbox_effect:
            conn.execute(outbox.insert().values(
                key=key, name="notify", idempotency_key=idempotency_key(key, f"notify:{{gen}}"),
                payload={{}}, status="pending", attempts=0, available_at=now, created_at=now))
    engine.dispose()
    return gen


@app.task(bind=True)
def result_not_stored(self, n):
    """Broken: the job row keeps the first result; each caller gets its own (another pid)."""
    key, now = f"job:{{n}}", dt.datetime.now(dt.timezone.utc)
    engine = sa.create_engine(app.conf.fence_database_url)
    with engine.begin() as conn:
        if conn.execute(sa.select(jobs.c.key).where(jobs.c.key == key)).first() is None:
            conn.execute(jobs.insert().values(
                key=key, task_name=self.name, status="completed", generation=1, attempts=1,
                attempt_id=self.request.id, result={{"n": n}}, created_at=now, updated_at=now,
                finished_at=now))
            conn.execute(transitions.insert().values(
                key=key, generation=1, attempt_id=self.request.id, action="completed", at=now))
    engine.dispose()
    return {{"n": n, "pid": os.getpid()}}


@app.task(base=FencedTask, bind=True, fence_unique=lambda n: f"feed:{{n}}")
def refresh_feed(self, n):
    """A unique job: one unfinished job per feed."""
    return {{"n": n, "generation": self.fence.generation}}


class _OnceLock(TTLLockTask, fence_base=True):
    """The control arm, for one test: celery-once's Redis lock (60 s) on the send path."""

    lock_prefix = os.environ.get("PROJ_LOCK_PREFIX", "proj-once")
    lock_timeout = 60

    @property
    def lock_redis(self):
        import redis

        return redis.Redis.from_url("{REDIS_URL}")


@app.task(base=_OnceLock, bind=True, fence_unique=lambda n: f"feed-once:{{n}}")
def refresh_feed_once(self, n):
    """The same unique job behind celery-once's lock, which every send meets first."""
    return {{"n": n, "generation": self.fence.generation}}


@app.task(bind=True)
def effect_per_run(self, n):
    """Broken: every run stages its effect again (the job row is the last run's)."""
    _store_rows(f"job:{{n}}", self.name, self.request.id, first_writer_wins=False,
                result={{"n": n}}, outbox_effect=True)
    return {{"n": n}}


@app.task(bind=True)
def first_writer_wins(self, n):
    """Broken: each run records a completion; the job row keeps the first one."""
    _store_rows(f"job:{{n}}", self.name, self.request.id, first_writer_wins=True,
                result={{"n": n}})
    return {{"n": n}}


@app.task(bind=True)
def unfenced(self, n):
    """The same write without the fence: upsert the result row and its transition."""
    key, now = f"job:{{n}}", dt.datetime.now(dt.timezone.utc)
    result = {{"n": n, "pid": os.getpid()}}
    engine = sa.create_engine(app.conf.fence_database_url)
    with engine.begin() as conn:
        row = conn.execute(sa.select(jobs.c.generation).where(jobs.c.key == key)).first()
        gen = (row.generation if row else 0) + 1
        values = dict(task_name=self.name, status="completed", generation=gen, attempts=gen,
                      attempt_id=self.request.id, result=result, updated_at=now, finished_at=now)
        if row:
            conn.execute(jobs.update().where(jobs.c.key == key).values(**values))
        else:
            conn.execute(jobs.insert().values(key=key, created_at=now, **values))
        conn.execute(transitions.insert().values(
            key=key, generation=gen, attempt_id=self.request.id, action="completed", at=now))
    engine.dispose()
    return result
'''

CONFTEST = """
import json
import os

import pytest

from proj import app


@pytest.fixture
def fence_app():
    return app


def pytest_runtest_makereport(item, call):
    env = item.funcargs.get("fence_env")
    if call.when == "teardown" and env is not None:
        with open(os.environ["FENCE_RECORD"], "a") as f:
            record = {"prefix": env.prefix, "queue": env.queue,
                      "pids": [w.pid for w in env.workers if w.proc is not None]}
            f.write(json.dumps(record) + "\\n")
"""

TEST_WINDOWS = """
import pytest

from proj import fenced, unfenced


@pytest.mark.parametrize("window", ["pause", "kill", "duplicate", "redis-loss"])
def test_fenced(fence_chaos, window):
    fence_chaos.inject(window, fenced.s(1))
    fence_chaos.assert_converged("job:1")


def test_unfenced(fence_chaos):
    fence_chaos.pause(unfenced.s(1))
    fence_chaos.assert_converged("job:1")
"""

TEST_BESIDE = """
def test_beside_celery_contrib(celery_app, fence_store, fence_redis):
    assert celery_app.conf.broker_url.startswith("memory")  # celery.contrib.pytest's fixture
    assert fence_store.get("job:1") is None
    fence_redis.client.set(f"{fence_redis.prefix}:mine", 1)  # deleted after the test
"""

TEST_HANG = """
import json
import os
import time


def test_hang(fence_env, fenced_worker):
    fenced_worker.start()
    with open(os.environ["FENCE_PIDFILE"], "w") as f:
        json.dump({"pid": fenced_worker.pid, "prefix": fence_env.prefix}, f)
    time.sleep(120)
"""


def _project(root: Path, **tests: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "proj.py").write_text(textwrap.dedent(PROJECT))
    (root / "conftest.py").write_text(CONFTEST)
    for name, text in tests.items():
        (root / f"{name}.py").write_text(text)
    return root


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return {**env, "FENCE_RECORD": str(root / "record.jsonl")}


def _run(root: Path, *args: str, timeout: float = 240) -> dict[str, tuple[str, str]]:
    """Run pytest in ``root``; {test name: (outcome, failure text)} from its JUnit XML."""
    junit = root / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    proc = subprocess.run(
        [*cmd, *args], cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout
    )
    assert junit.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failure = case.find("failure")
        error = case.find("error")
        if failure is not None:
            outcomes[case.get("name", "")] = ("failed", failure.text or "")
        elif error is not None:
            outcomes[case.get("name", "")] = ("error", error.text or "")
        elif case.find("skipped") is not None:
            outcomes[case.get("name", "")] = ("skipped", "")
        else:
            outcomes[case.get("name", "")] = ("passed", "")
    return outcomes


def _records(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "record.jsonl").read_text().splitlines()]


def _assert_nothing_left(records: list[dict[str, Any]]) -> None:
    assert records
    fence = redis.Redis.from_url(REDIS_URL)
    broker = redis.Redis.from_url(BROKER_URL)
    for record in records:
        for pid in record["pids"]:
            assert not group_alive(pid), f"worker group {pid} still runs"
        for client in (fence, broker):
            left = list(client.scan_iter(f"*{record['prefix']}*", count=1000))
            assert left == [], f"keys left behind: {left[:5]}"


def _passes_windows_and_fails_unfenced(outcomes: dict[str, tuple[str, str]]) -> None:
    for window in ("pause", "kill", "duplicate", "redis-loss"):
        name = f"test_fenced[{window}]"
        if name in outcomes:
            assert outcomes[name] == ("passed", ""), outcomes[name][1][-3000:]
    outcome, text = outcomes["test_unfenced"]
    assert outcome == "failed", text
    assert "ConvergenceError: fence_chaos: window 'pause' broke for key 'job:1'" in text
    assert "2 completions recorded (generation 1, generation 2); expected exactly 1" in text
    assert "transition history of 'job:1':" in text


@pytest.mark.slow(30)
def test_fenced_task_passes_every_window_and_a_plain_task_fails_on_sqlite(tmp_path: Path) -> None:
    # Given a user project with a fenced task and a plain task doing the same write, run with
    # pytest-celery loaded (no -p no:celery) and no Docker engine,
    root = _project(tmp_path / "user", test_windows=TEST_WINDOWS, test_beside=TEST_BESIDE)
    # when its tests run the windows with the plugin's SQLite store,
    outcomes = _run(root)
    # then the fenced task passes every window, the plain one fails naming the window,
    _passes_windows_and_fails_unfenced(outcomes)
    assert len([n for n in outcomes if n.startswith("test_fenced[")]) == 4
    # celery.contrib.pytest's celery_app works beside the plugin's fixtures,
    assert outcomes["test_beside_celery_contrib"] == ("passed", "")
    # and no worker, key or queue outlived its test.
    _assert_nothing_left(_records(root))


def test_windows_on_postgresql_leave_no_schema(tmp_path: Path, pg_url: str) -> None:
    # Given the same project run against PostgreSQL (a fresh schema for the session),
    root = _project(tmp_path / "user", test_windows=TEST_WINDOWS)
    outcomes = _run(
        root,
        "-p",
        "no:celery",
        "--fence-database-url",
        pg_url,
        "-k",
        "pause or kill or unfenced",
    )
    # then the fenced task converges under pause and kill, the plain task fails,
    assert sorted(outcomes) == ["test_fenced[kill]", "test_fenced[pause]", "test_unfenced"]
    _passes_windows_and_fails_unfenced(outcomes)
    # and the session's schema is gone with every key and worker.
    engine = sa.create_engine(pg_url)
    with engine.connect() as conn:
        schemas = conn.execute(
            sa.text("SELECT nspname FROM pg_namespace WHERE nspname LIKE :p"), {"p": "fence_test_%"}
        ).all()
    engine.dispose()
    assert schemas == []
    _assert_nothing_left(_records(root))


def test_ctrl_c_stops_the_worker_and_clears_its_keys(tmp_path: Path) -> None:
    # Given a user's test that started a fenced worker and is still running,
    root = _project(tmp_path / "user", test_hang=TEST_HANG)
    pidfile = root / "worker.json"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:celery"]
    proc = subprocess.Popen(
        cmd,
        cwd=root,
        env={**_env(root), "FENCE_PIDFILE": str(pidfile)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=ctrl_c_default,
    )
    try:
        wait_until(pidfile.exists, 90, interval=0.1, what="the worker to start")
        started = json.loads(pidfile.read_text())
        assert group_alive(started["pid"])
        # when the user presses Ctrl-C,
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    # then the worker's process group is gone and so are the test's keys.
    assert proc.returncode != 0
    _assert_nothing_left([{"prefix": started["prefix"], "pids": [started["pid"]]}])


def test_a_fenced_task_run_eagerly_warns(tmp_path: Path, prefix: str) -> None:
    app = Celery("eager", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        fence_database_url=f"sqlite:///{tmp_path / 'fence.sqlite3'}",
        fence_redis_url=REDIS_URL,
        fence_key_prefix=prefix,
    )

    @app.task(base=FencedTask, bind=True, fence_key=lambda n: f"eager:{n}")
    def job(self: Any, n: int) -> int:
        return n

    with pytest.warns(FenceEagerWarning, match="fencing is not exercised here"):
        assert job.delay(1).get() == 1
    app.close()


TEST_CHECK = """
import pytest

from celery_fence.testing.chaos import ConvergenceError
from proj import fenced


def test_checks(fence_chaos):
    fence_chaos.duplicate(fenced.s(3))
    with pytest.raises(ConvergenceError) as failed:
        fence_chaos.assert_converged("job:3", check=lambda record: record.generation > 99)
    with open("false.txt", "w") as f:
        f.write(str(failed.value))

    def my_row_is_there(record):
        assert record.result["n"] == 5, "my row says n=4"

    fence_chaos.duplicate(fenced.s(4))
    with pytest.raises(ConvergenceError) as failed:
        fence_chaos.assert_converged("job:4", check=my_row_is_there)
    with open("raises.txt", "w") as f:
        f.write(str(failed.value))

    seen = []
    fence_chaos.duplicate(fenced.s(5))
    fence_chaos.assert_converged("job:5", check=lambda record: seen.append(record) or True)
    assert [r.result["n"] for r in seen] == [5]
"""


def test_assert_converged_runs_the_users_check_and_fails_naming_the_key(tmp_path: Path) -> None:
    # Given converged windows and the user's own checks: one returns False, one raises
    # AssertionError, one passes (each called after convergence, with the stored job),
    root = _project(tmp_path / "proj", test_check=TEST_CHECK)
    assert _run(root) == {"test_checks": ("passed", "")}
    # then the failing ones failed assert_converged with a message naming the key and the check.
    false = (root / "false.txt").read_text()
    assert "broke for key 'job:3'" in false and "your check <lambda> returned False" in false
    raises = (root / "raises.txt").read_text()
    assert "broke for key 'job:4'" in raises
    assert "your check my_row_is_there failed on the converged job: my row says n=4" in raises


TEST_BLOCK = """
from proj import block_rows, with_block


def test_block(fence_chaos, fence_store):
    block_rows.metadata.create_all(fence_store.engine)
    fence_chaos.inject("pause-inside-block", with_block.s(7))
    fence_chaos.assert_converged("block:7")
"""


TEST_WRITE_WINDOWS = """
import pytest
import sqlalchemy as sa

from proj import (
    append_in_block, block_rows, check_then_write, check_then_write_fenced, latest,
    upsert_in_block,
)


@pytest.fixture
def my_rows(fence_store):
    block_rows.metadata.create_all(fence_store.engine)

    def one_row_of_the_completing_generation(record):
        with fence_store.engine.connect() as conn:
            gens = conn.execute(
                sa.select(latest.c.generation).where(latest.c.key == record.key)
            ).scalars().all()
        assert gens == [record.generation], (
            f"my rows say generations {gens}, the job completed at {record.generation}"
        )
        return True

    return one_row_of_the_completing_generation


@pytest.mark.parametrize(
    "task", [check_then_write, check_then_write_fenced], ids=["plain", "right"]
)
def test_pause_at_write(fence_chaos, my_rows, task):
    fence_chaos.inject("pause-at-write", task.s(1))
    fence_chaos.assert_converged("write:1", check=my_rows)


def test_unfenced_write_without_check(fence_chaos, my_rows):
    fence_chaos.inject("duplicate", check_then_write.s(5))
    fence_chaos.assert_converged("write:5")


@pytest.mark.parametrize("task", [append_in_block, upsert_in_block], ids=["plain", "right"])
def test_kill_after_block(fence_chaos, my_rows, task):
    fence_chaos.inject("kill-after-block", task.s(2))
    fence_chaos.assert_converged("rows:2", check=my_rows)
"""


@pytest.mark.slow(30)
def test_windows_reach_a_write_after_the_check_and_a_block_that_ran_twice(tmp_path: Path) -> None:
    # Given tasks that check the lease then write with a plain transaction, or append a row in
    # their fenced block, and their right versions (a fenced block, an upsert by key), each
    # checked by the user's check= (one row, of the completing generation),
    root = _project(tmp_path / "user", test_write_windows=TEST_WRITE_WINDOWS)
    outcomes = _run(root, "-p", "no:celery")
    # then pause-at-write (A paused right after its check, before its write) fails the plain
    # write: A's stale write lands after B completed,
    assert len(outcomes) == 5, outcomes
    outcome, text = outcomes["test_pause_at_write[plain]"]
    assert outcome == "failed", text
    assert "window 'pause-at-write' broke for key 'write:1'" in text, text[-3000:]
    assert "your check one_row_of_the_completing_generation failed" in text, text[-3000:]
    assert "my rows say generations [1], the job completed at 2" in text, text[-3000:]
    # kill-after-block (A killed after its block committed, before its completion) fails the
    # appending task: the body ran again and its row is there twice,
    outcome, text = outcomes["test_kill_after_block[plain]"]
    assert outcome == "failed", text
    assert "window 'kill-after-block' broke for key 'rows:2'" in text, text[-3000:]
    assert "my rows say generations [1, 2], the job completed at 2" in text, text[-3000:]
    # a write outside any fenced block fails the test even without check=, naming the write,
    outcome, text = outcomes["test_unfenced_write_without_check"]
    assert outcome == "failed", text
    assert "window 'duplicate' broke for key 'write:5'" in text, text[-3000:]
    assert "wrote outside a fenced block (committed on SQLAlchemy" in text, text[-3000:]
    assert "proj_latest" in text, text[-3000:]
    # and the right versions pass both windows.
    assert outcomes["test_pause_at_write[right]"] == ("passed", ""), outcomes
    assert outcomes["test_kill_after_block[right]"] == ("passed", ""), outcomes


TEST_OUTBOX = """
import json
import time

from proj import fenced


def test_outbox(fence_env, fenced_worker, fence_store):
    fenced_worker.start()
    fenced.delay(9).get(timeout=60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = fence_store.outbox_rows.rows(key="job:9")
        if rows and rows[0].status == "delivered":
            break
        time.sleep(0.1)
    (row,) = fence_store.outbox_rows.rows(key="job:9")
    with open("delivered.json", "w") as f:
        json.dump({"status": row.status, "idem": row.idempotency_key,
                   "recorded": fence_env.outbox_deliveries()}, f)
"""


TEST_UNIQUE = """
import pytest

from proj import refresh_feed, refresh_feed_once


@pytest.mark.parametrize("task", [refresh_feed, refresh_feed_once], ids=["fenced", "ttl-lock"])
def test_next_send_runs(fence_unique_holder, fenced_worker, fence_store, task):
    held = fence_unique_holder.kill(task.s(7))
    again = task.delay(7)
    assert again is not None, "the send was discarded"
    assert again.id == held.task_id
    fenced_worker.start()
    assert again.get(timeout=60)["generation"] == 2
    record = fence_store.get(held.key)
    assert record.status == "completed" and record.generation == 2
    later = task.delay(7)
    assert later.id != held.task_id and later.get(timeout=60)["generation"] == 1


def test_a_task_that_is_not_unique_is_refused(fence_unique_holder):
    from proj import fenced

    with pytest.raises(Exception, match="is not unique; declare it with fence_unique"):
        fence_unique_holder.kill(fenced.s(1))
"""


def test_a_killed_unique_holder_is_taken_over_in_a_users_test_and_a_ttl_lock_fails_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a user project with a unique task (fence_unique) and the same task guarded by a
    # celery-once-style TTL lock instead (the control arm),
    lock_prefix = f"proj-once-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PROJ_LOCK_PREFIX", lock_prefix)
    root = _project(tmp_path / "user", test_unique=TEST_UNIQUE)
    try:
        # when its test kills the holder of the key with fence_unique_holder, sends the key
        # again and starts a worker,
        outcomes = _run(root)
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(f"{lock_prefix}:*"):
            client.delete(key)
    # then the fenced task's later send returns the dead holder's job, which runs again and
    # completes, and the key is free once it ended ...
    assert outcomes["test_next_send_runs[fenced]"] == ("passed", ""), outcomes
    assert outcomes["test_a_task_that_is_not_unique_is_refused"] == ("passed", ""), outcomes
    # ... while under the TTL lock the stranded lock discards the later send: the test fails.
    outcome, text = outcomes["test_next_send_runs[ttl-lock]"]
    assert outcome == "failed" and "the send was discarded" in text, text[-3000:]
    _assert_nothing_left(_records(root))


@pytest.mark.parametrize("real", [False, True], ids=["recorded", "real"])
def test_plugin_workers_record_outbox_deliveries_unless_the_real_handlers_are_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, real: bool
) -> None:
    # Given an app whose outbox handler would reach the outside world (here: a file),
    root = _project(tmp_path / "user", test_outbox=TEST_OUTBOX)
    sent = root / "sent.txt"
    monkeypatch.setenv("PROJ_SENT", str(sent))
    # when a fenced task stages an effect on a plugin worker (with --fence-real-outbox or not),
    outcomes = _run(root, "-p", "no:celery", *(["--fence-real-outbox"] if real else []))
    assert outcomes == {"test_outbox": ("passed", "")}, outcomes
    seen = json.loads((root / "delivered.json").read_text())
    assert seen["status"] == "delivered"
    if not real:
        # then by default the recording handler took it, with the job's key, and the app's
        # handler never ran,
        assert seen["idem"] == idempotency_key("job:9", "notify")
        assert seen["recorded"] == [["notify", seen["idem"]]]
        assert not sent.exists()
        return
    # and asked for, the app's own handler ran, with a key production's never equals.
    assert seen["idem"] == idempotency_key("job:9", "notify", namespace="fence-test")
    assert seen["idem"] != idempotency_key("job:9", "notify")
    assert seen["recorded"] == []
    assert sent.read_text().split() == [seen["idem"]]


FLASK_PROJECT = f'''
import os

from celery import Celery
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from celery_fence import FencedTask

DB = os.environ["PROJ_DB"]
flask_app = Flask(__name__)
flask_app.config["SQLALCHEMY_DATABASE_URI"] = DB
db = SQLAlchemy(flask_app)


class Order(db.Model):
    __tablename__ = "flaskproj_orders"
    id = db.Column(db.Integer, primary_key=True)
    status = db.Column(db.String(20), nullable=False)
    generation = db.Column(db.Integer, nullable=False)


app = Celery("flaskproj", broker="{BROKER_URL}")
# the app's own database is the fence store's: a fenced session commits both together
app.conf.update(fence_redis_url="{REDIS_URL}", fence_database_url=DB)


@app.task(base=FencedTask, bind=True, fence_key=lambda order_id: f"order:{{order_id}}")
def ship(self, order_id):
    with flask_app.app_context():
        with self.fence.session(db.session) as session:
            order = session.get(Order, order_id)
            order.status, order.generation = "shipped", self.fence.generation
    return {{"order": order_id}}
'''

FLASK_CONFTEST = """
import pytest

from flaskproj import Order, app, db, flask_app


@pytest.fixture
def fence_app():
    with flask_app.app_context():
        db.create_all()
        db.session.merge(Order(id=1, status="new", generation=0))
        db.session.commit()
    yield app
    with flask_app.app_context():
        db.drop_all()
        db.engine.dispose()
"""

FLASK_TEST = """
from flaskproj import Order, db, flask_app, ship


def test_ship(fence_chaos):
    fence_chaos.inject("pause", ship.s(1))

    def shipped_by_the_completing_attempt(record):
        with flask_app.app_context():
            order = db.session.get(Order, 1)
            assert (order.status, order.generation) == ("shipped", record.generation)
        return True

    fence_chaos.assert_converged("order:1", check=shipped_by_the_completing_attempt)
"""


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_the_recipe_works_for_a_flask_sqlalchemy_app_on_its_own_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, database: str
) -> None:
    # Given a Flask-SQLAlchemy app whose fenced task writes its own table through
    # self.fence.session(db.session), with fence_database_url its own database, and a conftest
    # that only says which app (the README's recipe, nothing about the store),
    root = tmp_path / "flask"
    root.mkdir()
    (root / "flaskproj.py").write_text(FLASK_PROJECT)
    (root / "conftest.py").write_text(FLASK_CONFTEST)
    (root / "test_flask.py").write_text(FLASK_TEST)
    with contextlib.ExitStack() as stack:
        if database == "sqlite":
            url = f"sqlite:///{root / 'app.sqlite3'}"
        else:
            url = stack.enter_context(_pg_database())
        monkeypatch.setenv("PROJ_DB", url)
        # when the window runs,
        outcomes = _run(root, "-p", "no:celery", "-p", "no:django")
    # then the job completes and the user's check sees its row written by the completing attempt
    # (the store was put on the app's database: before, a SQLite store of the plugin's own
    # made the job dead, and a PostgreSQL schema of its own hid the app's table).
    assert outcomes == {"test_ship": ("passed", "")}, outcomes


@contextlib.contextmanager
def _pg_database() -> Iterator[str]:
    name = f"celery_fence_plugin_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield (
            sa.engine.make_url(PG_ADMIN_URL)
            .set(database=name)
            .render_as_string(hide_password=False)
        )
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


TEST_BROKEN = """
import pytest

from proj import arm, effect_per_run, first_writer_wins, rerun, result_not_stored

CASES = {
    "stale-write": ("pause", arm, "arm:1"),
    "callers": ("duplicate", result_not_stored, "job:2"),
    "outbox": ("pause", effect_per_run, "job:3"),
    "stored-job": ("pause", first_writer_wins, "job:4"),
    "redis-loss": ("redis-loss", arm, "arm:5"),
    "kill": ("kill", rerun, "rerun:6"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken(fence_chaos, case):
    window, task, key = CASES[case]
    fence_chaos.inject(window, task.s(int(key.split(":")[1])))
    fence_chaos.assert_converged(key)
"""


@pytest.mark.slow(40)
def test_each_check_of_assert_converged_fails_the_broken_task_of_its_kind(tmp_path: Path) -> None:
    # Given broken tasks, each of the kind a window and a check exist for: the fence's task on a
    # store without the generation fence (pause, redis-loss), a result the store never kept
    # (duplicate), an effect staged again by each run (pause), a job row that keeps the first of
    # two completions (pause), a store whose registration takes a completed job (kill),
    root = _project(tmp_path / "user", test_broken=TEST_BROKEN)
    outcomes = _run(root, "-p", "no:celery")
    failures = {name[len("test_broken[") : -1]: text for name, (_, text) in outcomes.items()}
    assert all(outcome == "failed" for outcome, _ in outcomes.values()), outcomes
    assert len(failures) == 6, outcomes
    # then each fails on its own check, named:
    expected = {
        "stale-write": "a stale write was accepted: generation 1 completed after generation 2 "
        "had claimed the key",
        "callers": "got a result that is not the stored one",
        "outbox": "outbox effect 'notify' recorded 2 times",
        "stored-job": "the stored job (generation 1) is not the one the last completion wrote "
        "(generation 2)",
        "redis-loss": "2 completions recorded (generation 1, generation 1)",
        "kill": "2 completions recorded",
    }
    for case, message in expected.items():
        assert message in failures[case], (case, failures[case][-3000:])


DJANGO_PROJECT = f'''
import os

import django
import sqlalchemy as sa
from celery import Celery
from django.conf import settings

from celery_fence import FencedTask

if os.environ.get("PROJ_UNFENCED") == "1":  # a control arm: the store without the fence
    from celery_fence.chaos.arms import UnfencedTask as FencedTask  # noqa: F811

url = sa.engine.make_url(os.environ["PROJ_DB"])
settings.configure(
    DATABASES={{"default": {{
        "ENGINE": "django.db.backends.postgresql", "NAME": url.database,
        "USER": url.username, "HOST": url.host, "PORT": url.port or 5432,
    }}}},
    INSTALLED_APPS=[],
    USE_TZ=True,
)
django.setup()
from django.db import connection  # noqa: E402

app = Celery("djproj", broker="{BROKER_URL}")
app.conf.update(fence_redis_url="{REDIS_URL}", fence_database="default")


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"dj:{{n}}")
def dj_block(self, n):
    with self.fence.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO dj_rows (generation) VALUES (%s)", [self.fence.generation])
    return {{"n": n}}


@app.task(base=FencedTask, bind=True, fence_key=lambda n: f"djw:{{n}}")
def dj_plain_write(self, n):
    """The mistake: Django's ORM connection, outside any fenced block (no check either)."""
    with connection.cursor() as cursor:
        cursor.execute("UPDATE dj_latest SET generation = %s", [self.fence.generation])
    return {{"n": n}}
'''

DJANGO_CONFTEST = """
import os

import pytest
import sqlalchemy as sa

from djproj import app


@pytest.fixture
def fence_app():
    engine = sa.create_engine(os.environ["PROJ_DB"])
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS dj_rows (id serial, generation int)")
        conn.exec_driver_sql("CREATE TABLE IF NOT EXISTS dj_latest (generation int)")
        conn.exec_driver_sql("DELETE FROM dj_latest")
        conn.exec_driver_sql("INSERT INTO dj_latest VALUES (0)")
    engine.dispose()
    return app
"""

DJANGO_TEST = """
from django.db import connection

from djproj import dj_block, dj_plain_write


def test_atomic_block(fence_chaos):
    fence_chaos.inject("pause-inside-block", dj_block.s(3))
    fence_chaos.assert_converged("dj:3")


def test_plain_write(fence_chaos):
    fence_chaos.inject("pause-at-write", dj_plain_write.s(4))

    def latest_is_the_jobs(record):
        with connection.cursor() as cursor:
            cursor.execute("SELECT generation FROM dj_latest")
            (generation,) = cursor.fetchone()
        assert generation == record.generation, (
            f"dj_latest says generation {generation}, the job completed at {record.generation}"
        )
        return True

    fence_chaos.assert_converged("djw:4", check=latest_is_the_jobs)
"""


@pytest.mark.parametrize("unfenced", [False, True], ids=["fenced", "unfenced"])
def test_pause_inside_block_records_the_commits_of_django_atomic_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unfenced: bool
) -> None:
    # Given a Django task whose self.fence.atomic() block inserts a row, paused inside the
    # block past its lease while worker B takes over; the store fenced or not (the control arm),
    root = tmp_path / "dj"
    root.mkdir()
    (root / "djproj.py").write_text(DJANGO_PROJECT)
    (root / "conftest.py").write_text(DJANGO_CONFTEST)
    (root / "test_dj.py").write_text(DJANGO_TEST)
    monkeypatch.setenv("PROJ_UNFENCED", "1" if unfenced else "0")
    with _pg_database() as url:
        monkeypatch.setenv("PROJ_DB", url)
        outcomes = _run(root, "-p", "no:celery", "-p", "no:django")
    # (pause-at-write: A paused before its first Django statement outside a block; B's write
    # lands, then A's stale one over it, which the user's check sees)
    plain, plain_text = outcomes["test_plain_write"]
    assert plain == "failed", plain_text
    assert "window 'pause-at-write' broke for key 'djw:4'" in plain_text, plain_text[-3000:]
    if not unfenced:  # (without the fence the stale completion is the stored one, and so on)
        assert "dj_latest says generation 1, the job completed at 2" in plain_text, plain_text
    outcome, text = outcomes["test_atomic_block"]
    if not unfenced:
        # then with the fence the stopped block never commits and the job converges,
        assert (outcome, text) == ("passed", ""), text[-3000:]
        return
    # and without it the plugin's block check sees the atomic() block's commit (the watcher
    # records fence.atomic() commits, not only transaction()/session()).
    assert outcome == "failed", text
    assert (
        "a fenced block of generation 1 committed its rows although generation 2 had registered "
        "and started before that commit" in text
    ), text[-3000:]


TEST_STEPS = """
import sqlalchemy as sa

from proj import step_rows, with_plain_steps, with_steps


def _each_step_once(fence_store, key):
    def check(record):
        with fence_store.engine.connect() as conn:
            rows = conn.execute(
                sa.select(step_rows.c.step, step_rows.c.generation)
                .where(step_rows.c.key == key)
                .order_by(step_rows.c.step, step_rows.c.generation)
            ).all()
        assert [tuple(r) for r in rows] == [(1, 1), (2, 2), (3, 2)], f"step rows {rows}"
        return True

    return check


def test_steps(fence_chaos, fence_store):
    step_rows.metadata.create_all(fence_store.engine)
    fence_chaos.pause_inside_step(with_steps.s(5), step=2)
    fence_chaos.assert_converged("steps:5", check=_each_step_once(fence_store, "steps:5"))


def test_plain_steps(fence_chaos, fence_store):
    step_rows.metadata.create_all(fence_store.engine)
    fence_chaos.pause_inside_step(with_plain_steps.s(5), step=2)
    fence_chaos.assert_converged(
        "plain-steps:5", check=_each_step_once(fence_store, "plain-steps:5")
    )
"""


def test_pause_inside_step_2_of_3_skips_committed_steps_and_stops_the_stale_attempt(
    tmp_path: Path,
) -> None:
    # Given a task of three fenced steps, each inserting a row in its step's transaction, and the
    # same task with steps as plain calls (the chaos harness's --unfenced-steps arm), each
    # stopped inside step 2 (its row written, not committed) past its lease while B takes over,
    root = _project(tmp_path / "user", test_steps=TEST_STEPS)
    outcomes = _run(root, "-p", "no:celery")
    # then with fenced steps B skips step 1, A's step 2 never commits and A runs no step 3,
    assert outcomes["test_steps"] == ("passed", ""), outcomes["test_steps"][1][-3000:]
    # and with plain steps B runs step 1 again (the user's check sees it), naming the window.
    outcome, text = outcomes["test_plain_steps"]
    assert outcome == "failed", text
    assert "window 'pause-inside-step' broke for key 'plain-steps:5'" in text, text[-3000:]
    assert "step rows [(1, 1), (1, 2)," in text, text[-3000:]
    _assert_nothing_left(_records(root))


@pytest.mark.parametrize("unfenced", [False, True], ids=["fenced", "unfenced"])
def test_pause_inside_block_checks_the_blocks_own_commit_on_postgresql(
    tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch, unfenced: bool
) -> None:
    # Given a task whose fence.transaction() block inserts a row, stopped inside that block
    # (after its write, before its commit) past its lease while worker B takes the job over,
    # with the store's fence on, or off (the chaos UnfencedTask: the block is then a plain
    # transaction),
    monkeypatch.setenv("PROJ_UNFENCED", "1" if unfenced else "0")
    root = _project(tmp_path / "user", test_block=TEST_BLOCK)
    outcomes = _run(root, "-p", "no:celery", "--fence-database-url", pg_url)
    outcome, text = outcomes["test_block"]
    if not unfenced:
        # then with the fence the stopped block never commits and the job converges,
        assert (outcome, text) == ("passed", "")
        return
    # and without it assert_converged's own check of the block fails, naming the key.
    assert outcome == "failed", text
    assert "window 'pause-inside-block' broke for key 'block:7'" in text
    assert (
        "a fenced block of generation 1 committed its rows although generation 2 had registered "
        "and started before that commit" in text
    ), text[-3000:]
