"""The ``unique`` scenario: the holder of a unique job dies, and the uniqueness key's later
sends must still run, within one TTL of the holder's lease's end — never wait for a lock's
timeout.

Each run has one uniqueness key and three waves of :data:`WAVE` sends of
:data:`~celery_fence.chaos.workload_unique.UNIQUE_TASK`, each wave one child process (the app's
side: ``python -m`` this module, its ``apply_async`` calls):

1. the first wave creates the job (its other sends return it); its body hangs (the one-shot
   ``overrun`` flag), and its holder dies: even runs SIGKILL its whole worker (a spare worker is
   started), odd runs send it with a hard time limit that kills its pool process;
2. right after the death, the second wave: every send must return the same, unfinished job,
   which then runs again — after a SIGKILL the workers' own recovery check re-sends it (this
   scenario's workers run it at the fence's defaults: a ``running`` job whose lease is gone is
   stranded at once, checked every half TTL), after a time limit the fence's own re-send does —
   within :data:`SLACK` of one TTL after the lease's end (what was left of it at the SIGKILL,
   read in Redis), and within :func:`takeover_bound` of the death;
3. once it completed, the third wave: a new job (the key was released by the job's end), which
   runs and completes once.

Checked per wave: every send answered by one job, that job completed exactly once (the store's
history, the ledger's witness). A send that got no job (discarded) counts as a lost job; a
wave answered by two jobs, or a takeover later than either bound, as an unexpected outcome.
Expected: the holder starts twice, the third wave's job once. Faults: the deaths (1 a run).

``--ttl-lock`` (the control arm): the task is not unique in the store; a celery-once-style Redis
lock with a 60 s timeout guards its sends (:class:`~celery_fence.chaos.arms.TTLLockTask`), and
no recovery runs (celery-once keeps no job to re-send). The SIGKILLed holder strands its lock,
and the second wave is discarded: lost.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time

from celery_fence.chaos import UNIQUE_TASK
from celery_fence.chaos.checker import Job
from celery_fence.chaos.scenario import Scenario
from celery_fence.testing import faults

#: Sends of the uniqueness key in each wave (all at once, from one process).
WAVE = 3
#: The hard time limit of the odd runs' first wave (seconds).
TIME_LIMIT = 3.0
#: Seconds a run of the job takes (not the hanging one, and inside the time limit): the second
#: wave meets it unfinished.
RERUN_S = 2.5


#: Seconds a re-run may take beyond one TTL after the lease's end: the send, a worker's pickup
#: and claim, the ledger's record, on a loaded machine.
SLACK = 1.5


def takeover_bound(ttl: float) -> float:
    """Seconds from the holder's death to its job's next start, at most: the lease runs out
    (at most one TTL: its last renewal was before the death), then one TTL (a workers' check
    comes every half TTL) and :data:`SLACK` — far inside any lock timeout (celery-once's
    default is an hour)."""
    return 2 * ttl + SLACK


def run_unique(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """One uniqueness key, its holder killed (SIGKILL or hard time limit), three waves."""
    ukey = s.key(i)
    kill = i % 2 == 0
    bound = takeover_bound(s.opts.ttl)
    faults.arm(s.ledger, s.ledger_prefix, "overrun", ukey)
    # the holder's next run takes RERUN_S: the second wave meets it unfinished
    waves = [_wave(s, ukey, time_limit=None if kill else TIME_LIMIT)]
    holder = next((k for k in waves[0][0] if k), None)
    if holder is None:
        raise RuntimeError(f"unique: the first wave of {ukey} created no job ({waves[0][0]})")
    overrun = s.wait_event(holder, "overrun")
    spare = None
    if kill:
        victim = s.worker_of(overrun["pid"])
        victim.kill()
        s.workers.remove(victim)
        spare = s.start_worker(f"spare-{i}")  # ready by the next run
    else:
        time.sleep(max(0.0, overrun["t"] + TIME_LIMIT - time.time()))
    died, died_wall = time.monotonic(), time.time()
    # a whole worker killed renews nothing more: its lease ends when what is left of it runs out
    lease_end = (s.lease_store.remaining(holder)[0] or 0.0) if kill else None
    waves.append(_wave(s, ukey))
    rerun = _takeover(s, holder, died_wall)
    problems = []
    ttl = s.opts.ttl
    if rerun is None:
        problems.append(f"never ran again after its holder died ({bound:.1f}s)")
    elif rerun > bound:
        problems.append(f"ran again {rerun:.1f}s after its holder died (bound {bound:.1f}s)")
    elif lease_end is not None and rerun - lease_end > ttl + SLACK:
        problems.append(
            f"ran again {rerun - lease_end:.1f}s after its lease's end (bound {ttl + SLACK:.1f}s)"
        )
    if not s.opts.quiet:
        took = "never" if rerun is None else f"{rerun:.2f}s ({rerun / ttl:.1f} TTL)"
        if rerun is not None and lease_end is not None:
            took += f", {rerun - lease_end:.2f}s after the lease's end"
        print(f"  unique run {i + 1}: {'SIGKILL' if kill else 'time limit'}, ran again: {took}")
    jobs = {holder: Job(holder, expect_starts=2)}
    if rerun is not None:
        elapsed = s.converge([jobs[holder]], died)
    else:  # checked as it is (unfinished: lost), without waiting out the converge timeout
        elapsed = bound
        s.sent.append(jobs[holder])
        s.jobs.append(jobs[holder])
    waves.append(_wave(s, ukey))
    for answers, _ in waves:
        for key in answers:
            if key is not None and key not in jobs:
                jobs[key] = Job(key, expect_starts=1)
    later = [job for key, job in jobs.items() if key != holder]
    if later:
        elapsed = max(elapsed, s.converge(later, died))
    for n, (answers, sent_at) in enumerate(waves, start=1):
        _check_wave(s, ukey, n, answers, sent_at, jobs[holder])
    jobs[holder].observed.extend(problems + _overlaps(s, list(jobs)))
    if spare is not None:
        spare.wait_ready()
    return 1, elapsed


def _check_wave(
    s: Scenario, ukey: str, n: int, answers: list[str | None], sent_at: float, holder: Job
) -> None:
    """One wave: a body of the key started after its first send, or a job the wave was answered
    with (running when it was sent) completed after it (else its sends were lost: a
    :class:`Job` of its own that never existed); fenced, no send discarded. (A wave may be
    answered by two jobs, one after the other: the holder ended between two sends. Two jobs of
    the key unfinished at once are :func:`_overlaps`.)"""
    discarded = sum(1 for k in answers if k is None)
    if discarded and not s.opts.ttl_lock:
        holder.observed.append(f"{discarded} sends of wave {n} of {ukey} were discarded")
    answered = {k for k in answers if k is not None}
    if any(
        e["t"] > sent_at
        and (
            (e["ev"] == "start" and e.get("ukey") == ukey)
            # or a job the wave was answered with, unfinished then (already running), ended
            or (e["key"] in answered and e["ev"] == "outcome" and e["outcome"] == "completed")
        )
        for e in s.events()
    ):
        return
    lost = Job(f"{ukey}:wave{n}")
    lock = s.ledger.ttl(f"{s.ledger_prefix}:qo:{UNIQUE_TASK}:{ukey}")
    lost.observed.append(
        f"no run after wave {n} ({discarded} of {len(answers)} sends discarded"
        + (f"; the lock still held for {lock}s" if lock and lock > 0 else "")
        + ")"
    )
    s.sent.append(lost)
    s.jobs.append(lost)  # no job exists: lost


def _overlaps(s: Scenario, keys: list[str]) -> list[str]:
    """Two jobs of one uniqueness key unfinished at once (the ledger: a job's first start
    before the previous job's end, completed or dead, was told)."""
    spans = []
    for key in keys:
        events = s.events(key)
        starts = [e["t"] for e in events if e["ev"] == "start"]
        done = [
            e["t"] for e in events if e["ev"] == "outcome" and e["outcome"] in ("completed", "dead")
        ]
        if starts:
            spans.append((min(starts), max(done) if done else float("inf"), key))
    spans.sort()
    return [
        f"jobs {a[2][:8]} and {b[2][:8]} of one uniqueness key ran at once"
        for a, b in itertools.pairwise(spans)
        if b[0] < a[1]
    ]


def _takeover(s: Scenario, key: str, died: float) -> float | None:
    """Seconds from ``died`` (wall clock) to the job's next body start (None: no start within
    :func:`takeover_bound`, and a little more to see how late)."""
    deadline = time.monotonic() + takeover_bound(s.opts.ttl) + SLACK
    while time.monotonic() < deadline:
        starts = [e["t"] for e in s.events(key) if e["ev"] == "start" and e["t"] > died]
        if starts:
            return min(starts) - died
        time.sleep(0.05)
    return None


def _wave(
    s: Scenario, ukey: str, *, time_limit: float | None = None
) -> tuple[list[str | None], float]:
    """:data:`WAVE` sends of the uniqueness key from the app's side (a child process): the fence
    key of the job each send was answered with (its task id; None: discarded), and the wall
    clock time just before the first send."""
    command = [sys.executable, "-m", __name__, ukey, str(WAVE), str(time_limit or 0)]
    proc = subprocess.run(
        command, env={**os.environ, **s.env()}, capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"unique: the sending process exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
        )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["answers"], float(out["at"])


# -- the app's side (the child process) -----------------------------------------------------------


def main(ukey: str, sends: int, time_limit: float) -> None:
    """``sends`` sends of ``ukey``; print the task id each was answered with (null: discarded)."""
    from celery_fence.chaos import workload, workload_unique

    options = {"time_limit": time_limit} if time_limit else {}
    task = workload_unique.unique_op
    at = time.time()
    answered = []
    for _ in range(sends):
        result = task.apply_async((ukey,), {"sleep": RERUN_S}, **options)
        answered.append(None if result is None else str(result.id))
    print(json.dumps({"answers": answered, "at": at}), flush=True)
    workload.app.close()


RUNS = {"unique": run_unique}

if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
