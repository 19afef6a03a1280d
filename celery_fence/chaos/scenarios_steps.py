"""The ``steps`` and ``export`` scenarios: fenced steps and checkpoints under real signals.

``steps``: an attempt paused inside a fenced step, a newer one taking over.

A job runs three fenced steps (``self.fence.run_step()``; the workload's ``_run_steps``): each
records its start, makes an unguarded external call (ledger ``effect``) and writes one
app-table row in the step's transaction. Attempt A takes a one-shot flag inside step ``k`` (1 on
odd runs, 2 on even ones) and is SIGSTOPped there past its TTL; the job is sent again, so a newer
attempt B takes it over (on SQLite, where the paused step holds the write lock, A is resumed once
B started or two TTLs passed); A gets SIGCONT (after B completed, or while B still runs).

Expected: attempts 2, body starts 2; B runs none of the steps A committed (a step body started
after another attempt committed it is an unexpected outcome); A starts no step after B's
registration (its external call would be a stale effect, its row a stale app write). Under
``--unfenced-steps`` (the steps are plain calls) B runs every step again and A runs its next
step after B's registration: both show. Faults: as ``pause``'s, for A.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time

import sqlalchemy as sa

from celery_fence.chaos import EXPORT_ROWS
from celery_fence.chaos.checker import Job
from celery_fence.chaos.scenario import Scenario, superseded
from celery_fence.testing import faults
from celery_fence.testing.waiting import poll_until

#: Steps each job runs.
STEPS = 3


def run_steps(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    ttl = s.opts.ttl
    k = 1 + i % 2
    job = Job(s.key(i), expect_attempts=2, expect_starts=2)
    faults.arm(s.ledger, s.ledger_prefix, "pause", "step", str(k), job.key)
    s.send(job, steps=STEPS, block_sleep=ttl * 2.5, check=False, notify=False)
    paused = s.wait_event(job.key, "step_paused")
    a = s.worker_of(paused["pid"])
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(ttl * rng.uniform(1.2, 1.6))  # A's lease expires in Redis: nobody renews it
    s.send(job, steps=STEPS, check=False, notify=False)
    with contextlib.suppress(TimeoutError):  # on SQLite B waits for A's write lock
        s.wait_event(job.key, "start", timeout=ttl * 2, gen=lambda e: e["gen"] > paused["gen"])
        if i % 4 < 2:  # resume after the newer attempt completed, or while it works
            poll_until(
                lambda: (r := s.store.get(job.key)) is not None and r.status == "completed",
                ttl * 4,
            )
    a.signal(signal.SIGCONT)
    elapsed = s.converge([job], paused_at)
    job.observed.extend(rerun_steps(s, job.key))
    return superseded(s, job.key, paused["attempt"]), elapsed


def rerun_steps(s: Scenario, key: str) -> list[str]:
    """A step body started after another attempt had committed that step (ledger
    ``step_committed`` before the ``step`` start): the step was run again."""
    events = s.events(key)
    problems = []
    for start in (e for e in events if e["ev"] == "step"):
        earlier = [
            e
            for e in events
            if e["ev"] == "step_committed"
            and e["step"] == start["step"]
            and e["attempt"] != start["attempt"]
            and e["t"] < start["t"]
        ]
        if earlier:
            problems.append(
                f"step {start['step']} of {key} ran again in generation {start['gen']} after "
                f"generation {earlier[0]['gen']} had committed it"
            )
    return problems


#: Batches (checkpoint intervals) one export is made of.
EXPORT_BATCHES = 20


def run_export(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """``export``: a checkpointed export of ``--rows`` rows, its pool process SIGKILLed at random
    batches; every row must be exported once, with at most one batch of work repeated per
    kill."""
    rows = s.opts.rows
    batch = max(1, rows // EXPORT_BATCHES)
    kills_wanted = max(0, min(2, s.opts.max_attempts - 1))
    job = Job(s.key(i))
    started = time.monotonic()
    s.send(job, export_rows=rows, export_batch=batch, check=False, notify=False)
    kills = 0
    seen = 0
    for _ in range(kills_wanted):
        at = seen + rng.randint(2, max(2, EXPORT_BATCHES // (kills_wanted + 1)))
        with contextlib.suppress(TimeoutError):
            s.wait_event(
                job.key, "batch", timeout=30, start=lambda e, at=at: e["start"] >= at * batch
            )
        done = (r := s.store.get(job.key)) is not None and r.status == "completed"
        batches = [e for e in s.events(job.key) if e["ev"] == "batch"]
        if done or not batches:
            break
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(batches[-1]["pid"]), signal.SIGKILL)
            kills += 1
        seen = batches[-1]["start"] // batch
    elapsed = s.converge([job], started)
    job.observed.extend(export_problems(s, job.key, rows=rows, batch=batch, kills=kills))
    return kills, elapsed


def export_problems(s: Scenario, key: str, *, rows: int, batch: int, kills: int) -> list[str]:
    """Rows not exported exactly once, and more than one batch of work repeated per kill (the
    ledger's ``batch`` entries: every batch an attempt started)."""
    with s.store.engine.connect() as conn:
        distinct, total = conn.execute(
            sa.select(sa.func.count(sa.distinct(EXPORT_ROWS.c.row_id)), sa.func.count()).where(
                EXPORT_ROWS.c.key == key
            )
        ).one()
    work = sum(e["end"] - e["start"] for e in s.events(key) if e["ev"] == "batch")
    repeated = work - rows
    if not s.opts.quiet:
        print(
            f"  export: {key}: {kills} kill(s), {repeated} rows of work repeated "
            f"(batch {batch}), {total - distinct} rows exported twice",
            flush=True,
        )
    problems = []
    if distinct != rows or total != rows:
        problems.append(
            f"export {key}: {distinct} distinct rows of {rows}, {total - distinct} exported "
            "more than once"
        )
    if repeated > kills * batch:
        problems.append(
            f"export {key}: {repeated} rows of work repeated after {kills} kill(s), more than "
            f"one batch ({batch}) per kill"
        )
    return problems


RUNS = {"steps": run_steps, "export": run_export}
