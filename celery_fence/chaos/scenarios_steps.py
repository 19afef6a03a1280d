"""The ``steps`` scenario: an attempt paused inside a fenced step, a newer one taking over.

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
import random
import signal
import time

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


RUNS = {"steps": run_steps}
