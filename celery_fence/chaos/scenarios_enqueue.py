"""The scenarios of a job's life before its first claim: ``enqueue-crash`` and ``broker-loss``.

Each run's jobs are created by a child process, the app's side (``python -m`` this module), in
one transaction that also writes the app's own rows (``chaos_orders``): with
:func:`celery_fence.enqueue`, or under ``--unsettled`` (the control arm) with plain Celery's
pattern, ``.delay()`` after the commit. No worker runs while they are created; then one starts,
and ``celery_fence.recover`` is sent as beat would send it.

- ``enqueue-crash``: the child is SIGKILLed between its commit and its publish. With
  ``enqueue`` the rows are ``pending`` and recovery sends them; with ``.delay()`` the orders are
  committed and the jobs exist nowhere: lost. 1 fault.
- ``broker-loss``: the jobs are committed and sent, then the broker's queue is deleted. With
  ``enqueue`` recovery sends them again from their rows; with ``.delay()`` nothing records them:
  lost. Faults: the messages deleted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import sqlalchemy as sa

from celery_fence.chaos.checker import Job
from celery_fence.chaos.scenario import Scenario
from celery_fence.ops.recovery import RECOVER_TASK
from celery_fence.testing.broker import delete_queues
from celery_fence.testing.waiting import poll_until

#: Jobs one ``enqueue-crash`` run creates in its one transaction.
CRASH_JOBS = 3
#: Jobs one ``broker-loss`` run creates (and whose messages the broker then loses).
BROKER_LOSS_JOBS = 100

#: The app's own rows, written in the same transaction as the jobs.
orders_metadata = sa.MetaData()
ORDERS = sa.Table(
    "chaos_orders", orders_metadata, sa.Column("key", sa.String(200), primary_key=True)
)


def run_enqueue_crash(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """The enqueuing process SIGKILLed between its commit and its publish, then recovery."""
    jobs = [Job(s.key(i, str(n)), expect_attempts=1, expect_starts=1) for n in range(CRASH_JOBS)]
    _create(s, jobs, crash=True)
    crashed_at = time.monotonic()
    return 1, _recover_and_converge(s, i, jobs, crashed_at)


def run_broker_loss(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Jobs committed and sent, the broker's queue deleted, then recovery."""
    jobs = [
        Job(s.key(i, str(n)), expect_attempts=1, expect_starts=1) for n in range(BROKER_LOSS_JOBS)
    ]
    _create(s, jobs, crash=False)
    if not poll_until(lambda: s.queued() >= len(jobs), 10, interval=0.05):
        raise RuntimeError(f"broker-loss: {s.queued()} of {len(jobs)} messages reached the queue")
    lost = s.queued()
    delete_queues(s.client, [s.queue])
    lost_at = time.monotonic()
    return lost, _recover_and_converge(s, i, jobs, lost_at)


def _create(s: Scenario, jobs: list[Job], *, crash: bool) -> None:
    """Run the app's side: one transaction with the orders and their jobs (see ``main``)."""
    mode = "delay" if s.opts.unsettled else "enqueue"
    command = [sys.executable, "-m", __name__, mode, "crash" if crash else "send"]
    proc = subprocess.run(
        [*command, *(j.key for j in jobs)],
        env={**os.environ, **s.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = -signal.SIGKILL if crash else 0
    if proc.returncode != expected:
        raise RuntimeError(
            f"the enqueuing process exited {proc.returncode}, not {expected}: "
            f"{proc.stderr.strip()[-500:]}"
        )
    task_ids = json.loads(proc.stdout.splitlines()[0]) if proc.stdout.strip() else {}
    for job in jobs:
        if task_ids.get(job.key):
            job.task_ids.append(task_ids[job.key])
        s.sent.append(job)


def _recover_and_converge(s: Scenario, i: int, jobs: list[Job], since: float) -> float:
    """A worker starts; ``celery_fence.recover`` is sent once the jobs are quiet for a TTL (as
    beat would, with ``older_than`` one TTL), and again while a job is still never claimed."""
    ttl = s.opts.ttl
    worker = s.start_worker(f"after-{i}", concurrency=2).wait_ready()
    try:
        deadline = time.monotonic() + s.opts.converge_timeout
        before = len(jobs) + 1
        while time.monotonic() < deadline:
            time.sleep(max(ttl * 1.2, 1.0))
            unclaimed = sum(
                1 for j in jobs if (r := s.store.get(j.key)) is not None and r.generation == 0
            )
            if unclaimed == 0:
                break
            if unclaimed >= before:  # no progress since the last pass: as the next beat would
                s.client.send_task(RECOVER_TASK, kwargs={"older_than": ttl}, queue=s.queue)
            before = unclaimed
        return s.converge(jobs, since)
    finally:
        s.stop_worker(worker)


# -- the app's side (the child process) -----------------------------------------------------------


def main(mode: str, when: str, keys: list[str]) -> None:
    """One transaction: an order row per key and its job (``enqueue``: in the transaction;
    ``delay``: ``.delay()`` after the commit). ``crash``: SIGKILL between commit and publish.
    Prints ``{key: task id}`` (of the jobs that will exist) before the commit."""
    import celery_fence.durable.sends
    from celery_fence import enqueue
    from celery_fence.chaos import workload

    def die(*_: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    engine = sa.create_engine(workload.S["CHAOS_DATABASE_URL"])
    orders_metadata.create_all(engine)
    task_ids: dict[str, str] = {}
    if when == "crash" and mode == "enqueue":
        celery_fence.durable.sends._publish = die  # type: ignore[assignment]  # after the commit
    with engine.begin() as conn:
        for key in keys:
            conn.execute(ORDERS.insert().values(key=key))
            if mode == "enqueue":
                task_ids[key] = enqueue(conn, workload.op, args=(key,)).task_id
        print(json.dumps(task_ids), flush=True)
    if mode == "delay":
        if when == "crash":
            die()  # committed; the .delay() calls never happen
        for key in keys:
            workload.op.delay(key)  # plain Celery: the task ids are not recorded anywhere
    workload.app.close()


RUNS = {"enqueue-crash": run_enqueue_crash, "broker-loss": run_broker_loss}

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
