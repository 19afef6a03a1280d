"""The ``store-crash`` scenario: the harness's own PostgreSQL cluster (``initdb`` in the work
directory, a free port, its WAL writer asleep for 10 s) crashed with ``pg_ctl stop -m
immediate`` at the points of a job's life that matter, then started again (crash recovery).

Each run crashes the store twice:

1. **The worker's windows**, one crash for four jobs that a worker (``-c 4``) holds, each at one
   point, started in this order (so what a later job committed without a flush is still in the
   WAL buffers when the crash comes):

   - ``after_block``: the body's ``fence.transaction()`` block committed (its app row and the
     ownership check), the body held after it;
   - ``after_commit``: the completion committed, held before the ack (a ``job_completed``
     receiver);
   - ``after_registration``: registered, the body sleeping;
   - ``in_block``: inside its block, its app row written, not committed.

   The holds are released after the restart. Expected: each completes once (``after_commit``:
   attempts 1, one body start: its completion was durable before its ack).
2. **Recovery**: a child process enqueues 3 jobs with :func:`celery_fence.enqueue` and is
   killed before its publish (as ``enqueue-crash``); ``celery_fence.recover`` is sent, and the
   store crashes as soon as recovery has taken one of them for a re-send. After the restart
   recovery is sent again (as beat would) while a job is still never claimed. Expected: each
   completes once.

Faults: the crashes (2 a run). What each crash did to each job (the store's row right after the
restart) is printed, for the report. The control arm ``--async-endings`` commits the completion
without its WAL flush too: the ``after_commit`` job's completion is lost after its ack (the arm
starts that job last: :data:`ARM_WINDOWS`).
"""

from __future__ import annotations

import random
import time

import sqlalchemy as sa

from celery_fence.chaos import APP_ROWS
from celery_fence.chaos.checker import Job
from celery_fence.chaos.scenario import Scenario
from celery_fence.chaos.scenarios_enqueue import CRASH_JOBS, _create
from celery_fence.ops.recovery import RECOVER_TASK
from celery_fence.testing import faults
from celery_fence.testing.waiting import poll_until

#: The windows of the worker's crash, in the order their jobs are started.
WORKER_WINDOWS = ("after_block", "after_commit", "after_registration", "in_block")
#: The ``--async-endings`` arm's order: its completion last, so nothing written after it fills
#: the WAL page that holds its commit record (the WAL writer writes out every page that fills,
#: without waiting for its delay: a later job's records would make the arm's completion durable
#: and hide the loss it shows).
ARM_WINDOWS = ("after_block", "after_registration", "in_block", "after_commit")
#: Seconds the after-registration body sleeps: it is still asleep when the crash comes.
REGISTERED_SLEEP = 4.0


def run_store_crash(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    if s.cluster is None:
        raise RuntimeError("store-crash runs against the harness's own PostgreSQL cluster")
    worker = s.start_worker(f"crash-{i}", concurrency=4).wait_ready()
    try:
        first = _crash_in_worker_windows(s, i, rng)
        second = _crash_during_recovery(s, i, rng)
    finally:
        s.stop_worker(worker)
    return 2, max(first, second)


def _arm(s: Scenario, *flag: str) -> None:
    faults.arm(s.ledger, s.ledger_prefix, *flag)


def _crash(s: Scenario, rng: random.Random) -> float:
    """Crash the cluster, wait a moment, start it again; the checker's pool starts afresh."""
    assert s.cluster is not None
    s.store.dispose()
    crashed_at = time.monotonic()
    s.cluster.crash()
    time.sleep(rng.uniform(0.2, 1.0))
    s.cluster.start()
    s.store.dispose()
    return crashed_at


def _row(s: Scenario, key: str) -> str:
    record = s.store.get(key)
    if record is None:
        return "no row"
    return f"{record.status} g{record.generation} attempts {record.attempts}"


def _history(s: Scenario, key: str) -> str:
    """The key's transition actions, oldest first (``recovered``, ``claimed``, ...)."""
    actions = [t.action for t in s.store.transitions.history(key)]
    return ", ".join(actions) or "no transitions"


def _app_rows(s: Scenario, key: str) -> int:
    with s.store.engine.connect() as conn:
        query = sa.select(sa.func.count()).select_from(APP_ROWS).where(APP_ROWS.c.key == key)
        return int(conn.execute(query).scalar() or 0)


def _say(s: Scenario, text: str) -> None:
    if not s.opts.quiet:
        print(f"  store-crash: {text}", flush=True)


def _crash_in_worker_windows(s: Scenario, i: int, rng: random.Random) -> float:
    jobs = {w: Job(s.key(i, w)) for w in WORKER_WINDOWS}
    held = jobs["after_commit"]
    held.expect_attempts, held.expect_starts = 1, 1
    for window in ARM_WINDOWS if s.opts.async_endings else WORKER_WINDOWS:
        job = jobs[window]
        if window == "after_registration":
            s.send(job, sleep=REGISTERED_SLEEP)
            s.wait_event(job.key, "start")
            continue
        _arm(s, "hold", window, job.key)
        s.send(job, app_write=window != "after_commit")
        s.wait_event(job.key, "held")
    before = {w: _row(s, j.key) for w, j in jobs.items()}
    crashed_at = _crash(s, rng)
    for w, j in jobs.items():
        after = _row(s, j.key)
        rows = f", {_app_rows(s, j.key)} app row(s)" if "block" in w else ""
        _say(s, f"run {i + 1} crash in {w}: {before[w]} before, {after}{rows} after the restart")
    for w in ("after_block", "after_commit", "in_block"):
        _arm(s, "go", jobs[w].key)
    elapsed = s.converge(list(jobs.values()), crashed_at)
    for w, j in jobs.items():
        rows = f", {_app_rows(s, j.key)} app row(s)" if "block" in w else ""
        starts = sum(1 for e in s.events(j.key) if e["ev"] == "start")
        _say(s, f"run {i + 1} {w} converged: {_row(s, j.key)}, {starts} body start(s){rows}")
    return elapsed


def _crash_during_recovery(s: Scenario, i: int, rng: random.Random) -> float:
    ttl = s.opts.ttl
    jobs = [Job(s.key(i, f"recover-{n}")) for n in range(CRASH_JOBS)]
    _create(s, jobs, crash=True)  # pending rows, their messages never sent
    time.sleep(max(ttl * 1.2, 1.0))  # quiet for one TTL: recovery takes them

    def taken() -> bool:
        return any(
            t.action == "recovered" for j in jobs for t in s.store.transitions.history(j.key)
        )

    s.client.send_task(RECOVER_TASK, kwargs={"older_than": ttl}, queue=s.queue)
    if not poll_until(taken, 30, interval=0.01):
        raise TimeoutError("store-crash: recovery took no job for a re-send in 30s")
    before = {j.key: f"{_row(s, j.key)} ({_history(s, j.key)})" for j in jobs}
    crashed_at = _crash(s, rng)
    for n, j in enumerate(jobs):
        after = f"{_row(s, j.key)} ({_history(s, j.key)})"
        _say(
            s, f"run {i + 1} crash during recovery, job {n}: {before[j.key]} before, {after} after"
        )
    deadline = time.monotonic() + s.opts.converge_timeout
    while time.monotonic() < deadline:
        unclaimed = [j for j in jobs if (r := s.store.get(j.key)) is not None and r.generation == 0]
        if not unclaimed:
            break
        s.client.send_task(RECOVER_TASK, kwargs={"older_than": ttl}, queue=s.queue)
        time.sleep(max(ttl * 1.2, 1.0))
    elapsed = s.converge(jobs, crashed_at)
    for n, j in enumerate(jobs):
        starts = sum(1 for e in s.events(j.key) if e["ev"] == "start")
        _say(s, f"run {i + 1} recovery job {n} converged: {_row(s, j.key)}, {starts} start(s)")
    return elapsed


RUNS = {"store-crash": run_store_crash}
