"""The fault injections: one function per scenario, each run returning (faults injected, seconds to
converge). :mod:`celery_fence.chaos` describes each scenario and what it expects."""

from __future__ import annotations

import contextlib
import json
import random
import signal
import time
from collections.abc import Callable
from typing import Any

from celery import signature

from celery_fence.chaos import BESIDE_FORMS, BESIDE_ROWS, CHARGE, TASK_NAME
from celery_fence.chaos.checker import Job
from celery_fence.chaos.scenario import Scenario, superseded
from celery_fence.chaos.scenarios_beat import RUNS as BEAT_RUNS
from celery_fence.chaos.scenarios_crash import RUNS as CRASH_RUNS
from celery_fence.chaos.scenarios_enqueue import RUNS as ENQUEUE_RUNS
from celery_fence.chaos.scenarios_limits import RUNS as LIMITS_RUNS
from celery_fence.chaos.scenarios_steps import RUNS as STEPS_RUNS
from celery_fence.chaos.scenarios_unique import RUNS as UNIQUE_RUNS
from celery_fence.chaos.workload_sql import BESIDE_ROUTINES
from celery_fence.ops.outbox import idempotency_key
from celery_fence.ops.recovery import KEY_HEADER, RECOVER_TASK
from celery_fence.store import decode_request
from celery_fence.testing import faults
from celery_fence.testing.waiting import poll_until

#: Where the ``kill`` scenario SIGKILLs the pool process, one job per window.
KILL_WINDOWS = ("before_effect", "before_commit", "after_commit")
#: What the refused-arg scenario passes: valid JSON, which PostgreSQL's jsonb refuses.
NUL_ARGUMENT = "before\x00after"

Run = Callable[[Scenario, int, random.Random], tuple[int, float]]


def run_pause(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """SIGSTOP the worker running the job past its TTL, let a newer attempt take over, SIGCONT.

    Runs cycle through four bodies: with or without ``guard()`` before the side effect, with or
    without an outbox effect. Run 0 has neither, so only the store's generation fence stands
    between the stale attempt and a stale write. Even runs resume the first attempt while the
    newer one still runs (its body outlasts the first one's), so the stale completion meets a
    newer row that is still ``running``: only the generation and attempt in the completion's
    predicate refuse it. Odd runs resume it after the newer attempt completed."""
    ttl = s.opts.ttl
    job = Job(s.key(i), expect_attempts=2, expect_starts=2)
    check, notify = ((False, False), (True, True), (False, True), (True, False))[i % 4]
    while_running = i % 2 == 0
    s.send(job, sleep=ttl * 2.5, check=check, notify=notify)
    first = s.wait_event(job.key, "start")
    a = s.worker_of(first["pid"])
    time.sleep(rng.uniform(0.05, ttl * 0.5))
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(ttl * rng.uniform(1.2, 1.6))  # A's lease expires in Redis: nobody renews it
    s.send(job, sleep=ttl * 4.0 if while_running else 0.1, check=True)
    s.wait_event(job.key, "start", gen=lambda e: e["gen"] > first["gen"])
    if not while_running:
        poll_until(lambda: (r := s.store.get(job.key)) is not None and r.status == "completed", 30)
    a.signal(signal.SIGCONT)
    elapsed = s.converge([job], paused_at)
    return superseded(s, job.key, first["attempt"]), elapsed


def run_orm_binds(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """``app-write``'s windows, with the app's row written through ``fence.session()`` of an ORM
    session whose ``binds=`` route the app's table to an engine of its own (Flask-SQLAlchemy's
    kind): the session must run the write on the fenced block's connection, or the paused
    attempt's row lands on a connection whose commit nothing checks."""
    return run_app_write(s, i, rng, via="binds")


def run_django_write(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """``app-write``'s windows, with the app's row written by Django's ORM inside
    ``fence.atomic()``: the ownership check runs on Django's own connection before its commit."""
    return run_app_write(s, i, rng, via="django")


def run_app_write(
    s: Scenario, i: int, rng: random.Random, via: str = "transaction"
) -> tuple[int, float]:
    """Even runs: SIGSTOP the worker inside its ``fence.transaction()`` block (entered, not yet
    written) past its TTL, let a newer attempt take over and write its own row, SIGCONT.

    On PostgreSQL the server ends the paused block's session after one TTL idle; on SQLite the
    paused block holds the database's write lock, so the newer attempt cannot register until the
    first one resumes: the harness resumes it once the newer attempt started or two TTLs passed.

    Odd runs: the first attempt writes its row and waits inside the block, before its commit,
    while every lease and generation counter is lost and the job is sent again; the newer
    attempt registers (on PostgreSQL, while the block is still open) and starts, then the block
    commits: only the commit-time check refuses it. Odd runs also stage an outbox effect."""
    ttl = s.opts.ttl
    job = Job(s.key(i))
    notify = i % 2 == 1
    if i % 2 == 1:
        s.send(job, app_write=True, via=via, hold_in_block=ttl * 0.8, check=False, notify=notify)
        written = s.wait_event(job.key, "tx_written")
        s.flush_leases()
        lost_at = time.monotonic()
        s.send(job, app_write=True, via=via, sleep=0.1, check=False, notify=notify)
        with contextlib.suppress(TimeoutError):  # on SQLite it waits for the block's commit
            s.wait_event(
                job.key,
                "start",
                timeout=ttl * 0.7,
                other=lambda e: e["attempt"] != written["attempt"],
            )
        faults.arm(s.ledger, s.ledger_prefix, "go", job.key)
        elapsed = s.converge([job], lost_at)
        return superseded(s, job.key, written["attempt"]), elapsed
    s.send(job, app_write=True, via=via, block_sleep=ttl * 2.5, check=False, notify=notify)
    entered = s.wait_event(job.key, "tx")
    a = s.worker_of(entered["pid"])
    time.sleep(rng.uniform(0.05, ttl * 0.3))
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(ttl * rng.uniform(1.2, 1.6))  # A's lease expires in Redis: nobody renews it
    s.send(job, app_write=True, via=via, sleep=0.1, check=False, notify=notify)
    with contextlib.suppress(TimeoutError):
        s.wait_event(job.key, "start", timeout=ttl * 2, gen=lambda e: e["gen"] > entered["gen"])
        if rng.random() < 0.5:  # resume after the newer attempt completed, or while it works
            poll_until(
                lambda: (r := s.store.get(job.key)) is not None and r.status == "completed",
                ttl * 4,
            )
    a.signal(signal.SIGCONT)
    elapsed = s.converge([job], paused_at)
    return superseded(s, job.key, entered["attempt"]), elapsed


def run_beside_block(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """``app-write``'s pause inside the block, with a write beside the block: inside its
    ``fence.transaction()`` block, after the pause, each attempt writes on another connection of
    the store's database (and commits there) in one of the text forms of
    :data:`~celery_fence.chaos.BESIDE_FORMS`, run ``i`` the form ``i mod 6``. The fence must
    refuse each such COMMIT whatever the statement's text; the paused attempt's write landing
    after the newer attempt started is a stale app-table write."""
    ttl = s.opts.ttl
    job = Job(s.key(i))
    form = BESIDE_FORMS[i % len(BESIDE_FORMS)]
    with s.store.engine.begin() as conn:
        for routine in BESIDE_ROUTINES:
            conn.exec_driver_sql(routine)
        conn.execute(
            BESIDE_ROWS.insert().values(key=job.key, generation=0, attempt_id="", written_at=0.0)
        )
    kwargs: dict[str, Any] = {"app_write": True, "beside": form, "check": False, "notify": False}
    s.send(job, block_sleep=ttl * 2.5, **kwargs)
    entered = s.wait_event(job.key, "tx")
    a = s.worker_of(entered["pid"])
    time.sleep(rng.uniform(0.05, ttl * 0.3))
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(ttl * rng.uniform(1.2, 1.6))  # A's lease expires in Redis: nobody renews it
    s.send(job, sleep=0.1, **kwargs)
    with contextlib.suppress(TimeoutError):
        s.wait_event(job.key, "start", timeout=ttl * 2, gen=lambda e: e["gen"] > entered["gen"])
    a.signal(signal.SIGCONT)
    elapsed = s.converge([job], paused_at)
    return superseded(s, job.key, entered["attempt"]), elapsed


def run_atomic_threads(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Two threads of one attempt, each in a ``self.fence.atomic()`` block of its own (Django's
    ORM, a connection per thread): SIGSTOP the worker inside both blocks past its TTL, let a
    newer attempt take over, SIGCONT. Each thread's outermost block must be fenced: a block that
    commits after the newer attempt started is a stale app-table write."""
    ttl = s.opts.ttl
    job = Job(s.key(i))
    kwargs: dict[str, Any] = {
        "app_write": True,
        "via": "django-threads",
        "check": False,
        "notify": False,
    }
    s.send(job, block_sleep=ttl * 2.5, **kwargs)
    entered = s.wait_event(job.key, "tx")
    a = s.worker_of(entered["pid"])
    time.sleep(rng.uniform(0.05, ttl * 0.3))
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(ttl * rng.uniform(1.2, 1.6))
    s.send(job, block_sleep=0.05, **kwargs)
    with contextlib.suppress(TimeoutError):
        s.wait_event(job.key, "start", timeout=ttl * 2, gen=lambda e: e["gen"] > entered["gen"])
    a.signal(signal.SIGCONT)
    elapsed = s.converge([job], paused_at)
    return superseded(s, job.key, entered["attempt"]), elapsed


def run_kill(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """SIGKILL the pool process in each window: before the side effect, after it but before the
    completion commit, after the commit but before the ack (one job per window, at once)."""
    jobs = []
    windows = list(KILL_WINDOWS)
    rng.shuffle(windows)
    for window in windows:
        job = Job(s.key(i, window), expect_starts=1 if window == "after_commit" else None)
        faults.arm(s.ledger, s.ledger_prefix, "kill", window, job.key)
        s.send(job, sleep=rng.uniform(0.0, 0.3))
        jobs.append(job)
    started = time.monotonic()
    elapsed = s.converge(jobs, started)
    return sum(1 for j in jobs for e in s.events(j.key) if e["ev"] == "kill"), elapsed


def run_duplicate(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """The same logical operation delivered to several workers at once (4 copies)."""
    job = Job(s.key(i))
    copies = 4
    sleep = rng.uniform(0.1, 0.6)
    for _ in range(copies):
        s.send(job, sleep=sleep, check=rng.random() < 0.5)
    elapsed = s.converge([job], time.monotonic())
    # the copies that met another copy's lease or completion (busy, replayed, or refused stale)
    met = {
        e.get("task")
        for e in s.events(job.key)
        if e["ev"] == "busy" or (e["ev"] == "outcome" and e["outcome"] in ("replayed", "stale"))
    }
    return len(met & set(job.task_ids)), elapsed


def run_redis_loss(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Lose every lease and generation counter mid-job, then deliver the job again: the claim
    gets a generation the store already saw, and the store must stay the authority."""
    ttl = s.opts.ttl
    job = Job(s.key(i))
    s.send(job, sleep=ttl * 1.5, check=rng.random() < 0.5)
    s.wait_event(job.key, "start")
    time.sleep(rng.uniform(0.0, ttl * 0.5))
    s.flush_leases()
    lost_at = time.monotonic()
    s.send(job, sleep=0.1, check=rng.random() < 0.5)
    elapsed = s.converge([job], lost_at)
    return regressions(s.events(job.key)), elapsed


def regressions(events: list[dict[str, Any]]) -> int:
    """Claims that got a generation the store had already seen (Redis lost its counter): the
    fence's regression branch taken (ledger ``regressed``: the counter raised above the store's,
    the claim made again), or, where nothing took it, a body started with a generation no
    greater than an earlier attempt's."""
    count = sum(1 for e in events if e["ev"] == "regressed")
    seen: dict[str, int] = {}
    for e in events:
        if e["ev"] != "start" or e.get("gen") is None:
            continue
        if any(a != e.get("attempt") and g >= e["gen"] for a, g in seen.items()):
            count += 1
        seen[str(e.get("attempt"))] = int(e["gen"])
    return count


def run_db_outage(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """The database unreachable (the harness's TCP proxy in front of PostgreSQL cuts every open
    connection and resets every new one) while the bodies finish and try to complete; then back.
    Faults: the store connections the workers attempted inside the outage (what happened)."""
    assert s.proxy is not None
    jobs = [Job(s.key(i, str(n))) for n in range(2)]
    for job in jobs:
        s.send(job, sleep=rng.uniform(0.2, 0.5), check=rng.random() < 0.5)
    for job in jobs:
        s.wait_event(job.key, "start")
    before = s.proxy.refused
    s.proxy.refuse()
    down_at = time.monotonic()
    time.sleep(rng.uniform(0.5, 2.0))
    s.proxy.accept_again()
    return s.proxy.refused - before, s.converge(jobs, down_at)


def run_unknown_remote(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """The provider performs the charge, then answers too late: the call times out, the retry
    sends the same idempotency key and gets the stored response (performed once)."""
    job = Job(s.key(i), expect_remote=True)
    idem = idempotency_key(job.key, CHARGE)
    s.provider.delay_next(s.opts.remote_timeout * 3, 1, path=f"/charges/{idem}")
    s.send(job, sleep=rng.uniform(0.0, 0.2), remote=True)
    elapsed = s.converge([job], time.monotonic())
    timeouts = [e for e in s.events(job.key) if e["ev"] == "call" and e["outcome"] == "timeout"]
    return len(timeouts), elapsed


def run_poison(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Input that always fails permanently (dead after one attempt) and a job that always kills
    its worker (dead after ``fence_max_attempts`` body runs)."""
    permanent = Job(s.key(i, "permanent"), expect="dead", expect_attempts=1, expect_starts=1)
    killer = Job(s.key(i, "kills"), expect="dead", expect_starts=s.opts.max_attempts)
    s.send(permanent, mode="permanent")
    s.send(killer, mode="kill")
    elapsed = s.converge([permanent, killer], time.monotonic())
    failed = sum(1 for e in s.events(permanent.key) if e["ev"] == "permanent")
    kills = sum(1 for e in s.events(killer.key) if e["ev"] == "kill")
    return failed + kills, elapsed


def run_time_limit(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Hard time limits (the prefork pool kills the process running the body): a job whose first
    run overruns must complete on a later attempt; a job that overruns on every run must end
    ``dead``, reason "time limit", after ``fence_max_attempts`` executions."""
    limit = rng.uniform(1.0, 1.5)  # seconds: room for a normal run on a loaded machine
    once = Job(s.key(i, "once"), expect_attempts=2, expect_starts=2)
    always = Job(
        s.key(i, "always"),
        expect="dead",
        expect_attempts=s.opts.max_attempts,
        expect_starts=s.opts.max_attempts,
        expect_reason="time limit",
    )
    faults.arm(s.ledger, s.ledger_prefix, "overrun", once.key)
    s.send(once, sleep=rng.uniform(0.0, 0.2), options={"time_limit": limit})
    s.send(always, mode="overrun", options={"time_limit": limit})
    elapsed = s.converge([once, always], time.monotonic())
    overruns = sum(1 for j in (once, always) for e in s.events(j.key) if e["ev"] == "overrun")
    return overruns, elapsed


def run_expires(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Messages sent with ``expires``: one whose first run fails transiently after the expiry
    (its retry must arrive), one that meets a lease held elsewhere past the expiry (its busy
    reschedule must arrive). Both must complete."""
    expires = 1.5  # seconds: ample for an idle worker to take the first delivery
    retried = Job(s.key(i, "retry"), expect_attempts=2, expect_starts=2)
    busy = Job(s.key(i, "busy"), expect_attempts=1, expect_starts=1)
    hold = rng.uniform(1.8, 2.3)  # another holder (a slow or paused worker) keeps the lease
    s.lease_store.claim(busy.key, f"chaos-holder-{s.run_id}", int(hold * 1000))
    faults.arm(s.ledger, s.ledger_prefix, "fail", retried.key)
    sent_at = time.time()
    s.send(busy, sleep=0.1, options={"expires": expires})
    s.send(retried, sleep=rng.uniform(1.7, 2.1), options={"expires": expires})
    elapsed = s.converge([retried, busy], time.monotonic())
    late = [e for e in s.events(retried.key) if e["ev"] == "fail" and e["t"] > sent_at + expires]
    held = any(e["ev"] == "busy" for e in s.events(busy.key))  # a delivery met the held lease
    return int(held) + len(late), elapsed


def run_misconfig(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """Jobs queued, then a worker whose ``fence_renew_interval`` leaves no room before the local
    deadline (>= ttl x (1 - margin)) starts: it must refuse to start and take nothing. Then a
    correctly configured worker starts and must complete every job."""
    jobs = [Job(s.key(i, str(n)), expect_attempts=1, expect_starts=1) for n in range(3)]
    for job in jobs:
        s.send(job, sleep=rng.uniform(0.0, 0.2))
    interval = s.opts.ttl * rng.uniform(0.95, 1.2)
    bad = s.start_worker(f"bad-{i}", CHAOS_RENEW_INTERVAL=f"{interval:.3f}")
    started_at = time.monotonic()
    if not poll_until(lambda: bad.exited or " ready." in bad.log(), 90, 0.1):
        raise TimeoutError("the misconfigured worker neither exited nor started in 90s")
    if not bad.exited:  # it started: plain Celery fails each task (and acks it)
        for job in jobs:
            job.observed.append(f"a worker with fence_renew_interval={interval:.3f} started")
        # until it has taken and acked all of them (a message it has not acked yet would go
        # back to the queue when it stops)
        poll_until(lambda: all(s._finished(j) for j in jobs) and s.queued() == 0, 15)
    s.stop_worker(bad)
    taken = len(jobs) - s.queued()
    if taken:
        for job in jobs:
            job.observed.append(f"the misconfigured worker took {taken} of {len(jobs)} messages")
    met = "fence_renew_interval" in bad.log()  # refused at start, or (unsettled) at a task
    good = s.start_worker(f"good-{i}")
    good.wait_ready()
    elapsed = s.converge(jobs, started_at)
    s.stop_worker(good)
    return int(met), elapsed


def run_refused_arg(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """An argument PostgreSQL refuses (jsonb cannot store ``\\u0000``): one claim, then ``dead``
    at once, the body never run; no loop."""
    job = Job(
        s.key(i),
        expect="dead",
        expect_attempts=1,
        expect_starts=0,
        expect_claims=1,
        expect_reason="arguments refused by the database",
    )
    s.send(job, payload=NUL_ARGUMENT, sleep=rng.uniform(0.0, 0.1))
    elapsed = s.converge([job], time.monotonic())
    time.sleep(0.5)  # a message still looping would claim again meanwhile
    job.claims = s.claims(job.key)
    record = s.store.get(job.key)
    if record is not None and record.status == "dead":  # kept for `fence show` / `requeue`
        request = decode_request(record.request)
        if request is None or request.get("kwargs", {}).get("payload") != NUL_ARGUMENT:
            job.observed.append("the stored request does not decode to the arguments sent")
    return job.claims, elapsed  # the registrations the database was asked to take


def run_recovered_chain(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """A chain ``a | b`` whose first step's message is lost: the worker running ``a`` is
    SIGKILLed mid-body (main process and pool: nothing is acked or given back) and the message
    is dropped from the broker. Once ``a``'s lease is gone, ``celery_fence.recover`` runs (as
    beat would send it) on a fresh worker: ``a`` is re-sent with its stored workflow, completes
    once, and ``b`` runs after it. 1 fault.

    One worker runs at a time (the one that takes ``a`` is the one killed); the fresh one stays
    for the next run. Under ``--unsettled`` the harness re-sends ``a`` itself as a bare message
    (task, args, kwargs and key, what a re-send kept before the workflow was stored): ``a``
    completes, ``b`` never runs and is lost."""
    ttl = s.opts.ttl
    a = Job(s.key(i, "a"), expect_attempts=2, expect_starts=2)
    b = Job(s.key(i, "b"), expect_attempts=1, expect_starts=1)
    live = [w for w in s.workers if not w.exited]
    doomed = live[0] if live else s.start_worker(f"chain-{i}").wait_ready()
    faults.arm(s.ledger, s.ledger_prefix, "overrun", a.key)  # a's first run sleeps until killed
    first = signature(
        TASK_NAME, args=[a.key], kwargs={"sleep": rng.uniform(0.0, 0.2)}, app=s.client
    )
    then = signature(TASK_NAME, args=[b.key], kwargs={"sleep": 0.1}, app=s.client, immutable=True)
    result = (first.set(queue=s.queue) | then.set(queue=s.queue)).apply_async()
    a.task_ids.append(str(result.parent.id))
    b.task_ids.append(str(result.id))
    s.wait_event(a.key, "start")
    doomed.kill()
    lost_at = time.monotonic()
    s.stop_worker(doomed)
    dropped = _lose_messages(s)
    rescuer = s.start_worker(f"chain-{i}-rescuer")
    rescuer.wait_ready()
    deadline = time.monotonic() + s.opts.converge_timeout
    while time.monotonic() < deadline:  # as beat would: until a is taken for its re-send
        record = s.store.get(a.key)
        if record is None or record.status != "running":
            break
        if s.lease_store.remaining(a.key)[0] is None:
            if s.opts.unsettled:
                _resend_bare(s, record)
            else:
                s.client.send_task(RECOVER_TASK, kwargs={"older_than": ttl}, queue=s.queue)
        time.sleep(max(1.0, ttl))
    return dropped, s.converge([a, b], lost_at)


def run_interrupted(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """A body ends with an exit that is not an ``Exception`` (``asyncio.CancelledError``) on a
    threads-pool worker (even runs) or a gevent-pool worker (odd runs): the attempt must settle
    ``retrying`` and release its lease at once, so the re-sent message runs and completes on its
    second attempt. Under ``--unsettled`` the exit escapes with its lease held and renewed: every
    delivery finds the key busy and the job is lost. 1 fault."""
    pool = "threads" if i % 2 == 0 else "gevent"
    worker = s.start_worker(f"{pool}-{i}", pool=pool, concurrency=2).wait_ready()
    job = Job(s.key(i), expect_attempts=2, expect_starts=2)
    faults.arm(s.ledger, s.ledger_prefix, "interrupt", job.key)
    s.send(job, sleep=rng.uniform(0.0, 0.2), check=False, notify=False)
    s.wait_event(job.key, "interrupt")
    interrupted_at = time.monotonic()
    try:
        elapsed = s.converge([job], interrupted_at)
        return sum(1 for e in s.events(job.key) if e["ev"] == "interrupt"), elapsed
    finally:
        s.stop_worker(worker)


def _lose_messages(s: Scenario) -> int:
    """Drop what the broker still holds for this scenario's queue (lost messages); return how
    many were dropped."""
    with s.client.connection_for_write() as conn:
        channel: Any = conn.default_channel
        if conn.transport.driver_type != "redis":  # the killed consumer's message came back
            poll_until(lambda: s.queued() > 0, 10, interval=0.05)
            return int(channel.queue_purge(s.queue) or 0)
        dropped = 0
        for tag, raw in channel.client.hgetall(channel.unacked_key).items():
            if json.loads(raw)[2] == s.queue:
                dropped += int(channel.client.hdel(channel.unacked_key, tag))
                channel.client.zrem(channel.unacked_index_key, tag)
        return dropped


def _resend_bare(s: Scenario, record: Any) -> None:
    """The control arm's recovery: take the row, re-send task, args, kwargs and key only."""
    taken = s.store.admin.take_for_resend(record, reason="stranded (bare re-send)")
    request = decode_request(record.request) or {}
    if taken is not None:
        s.client.send_task(
            str(request["task"]),
            args=request.get("args"),
            kwargs=request.get("kwargs"),
            task_id=request.get("id"),
            headers={KEY_HEADER: record.key},
            queue=s.queue,
        )


RUNS: dict[str, Run] = {
    "pause": run_pause,
    "app-write": run_app_write,
    "orm-binds": run_orm_binds,
    "django-write": run_django_write,
    "beside-block": run_beside_block,
    "atomic-threads": run_atomic_threads,
    "interrupted": run_interrupted,
    "kill": run_kill,
    "duplicate": run_duplicate,
    "redis-loss": run_redis_loss,
    "db-outage": run_db_outage,
    "unknown-remote": run_unknown_remote,
    "poison": run_poison,
    "time-limit": run_time_limit,
    "expires": run_expires,
    "misconfig": run_misconfig,
    "refused-arg": run_refused_arg,
    "recovered-chain": run_recovered_chain,
    **ENQUEUE_RUNS,
    **CRASH_RUNS,
    **STEPS_RUNS,
    **UNIQUE_RUNS,
    **BEAT_RUNS,
    **LIMITS_RUNS,
}
