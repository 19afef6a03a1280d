"""The harness: one :class:`Scenario` context per scenario, the fault injections, the CLI.

See the package docstring (:mod:`celery_fence.chaos`) for the command line and the columns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import sqlalchemy as sa
from celery import Celery

from celery_fence.lease import LeaseStore
from celery_fence.outbox import SWEEP_TASK, idempotency_key
from celery_fence.store import Store, decode_request
from celery_fence.testing.provider import ProviderStub

from . import CHARGE, TASK_NAME, app_metadata, checker
from .checker import Job, ScenarioResult
from .processes import (
    RedisServer,
    TcpProxy,
    Worker,
    cleanup,
    install_handlers,
    register_closer,
    wait_until,
)

SCENARIOS = (
    "pause",
    "app-write",
    "kill",
    "duplicate",
    "redis-loss",
    "db-outage",
    "unknown-remote",
    "poison",
    "time-limit",
    "expires",
    "misconfig",
    "refused-arg",
)
KILL_WINDOWS = ("before_effect", "before_commit", "after_commit")
#: Scenarios that run against PostgreSQL whatever the store (a throwaway database if need be).
POSTGRESQL_ONLY = ("db-outage", "refused-arg")
#: Scenarios that start their own workers in each run (none are running in between).
OWN_WORKERS = ("misconfig",)
#: What the refused-arg scenario passes: valid JSON, which PostgreSQL's jsonb refuses.
NUL_ARGUMENT = "before\x00after"


@dataclass
class Options:
    scenarios: Sequence[str] = SCENARIOS
    runs: int = 3
    seed: int = 0
    redis_url: str = "redis://127.0.0.1:6379/1"
    broker_url: str = "redis://127.0.0.1:6379/2"
    database_url: str | None = None  # None: a fresh SQLite file per scenario
    pg_admin_url: str = "postgresql+psycopg2://postgres@127.0.0.1:5432/postgres"
    ttl: float = 1.5
    max_attempts: int = 3
    workers: int = 2
    unfenced: bool = False
    unsettled: bool = False
    own_redis: bool = False
    converge_timeout: float = 60.0
    remote_timeout: float = 0.5
    json_path: str | None = None
    workdir: str | None = None
    quiet: bool = False


@dataclass
class Scenario:
    """Everything one scenario runs against: its workers, queue, database, ledger, provider."""

    name: str
    opts: Options
    workdir: Path
    lease_redis_url: str
    own_redis: RedisServer | None
    database_url: str  # what the checker reads (direct)
    worker_database_url: str  # what the workers use (through the proxy for db-outage)
    proxy: TcpProxy | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    workers: list[Worker] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = f"chaos-{self.run_id}"
        self.ledger_prefix = f"{self.prefix}-ledger"
        self.queue = f"chaos-{self.run_id}"
        self.provider = ProviderStub()
        self.ledger = redis.Redis.from_url(self.opts.redis_url)
        self.leases = redis.Redis.from_url(self.lease_redis_url)
        self.client = Celery(
            "chaos-client", broker=self.opts.broker_url, backend=self.opts.redis_url
        )
        self.store = Store(self.database_url)
        self.lease_store = LeaseStore(self.leases, prefix=self.prefix)

    # -- lifecycle -------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {
            "CHAOS_BROKER_URL": self.opts.broker_url,
            "CHAOS_BACKEND_URL": self.opts.redis_url,
            "CHAOS_REDIS_URL": self.lease_redis_url,
            "CHAOS_LEDGER_URL": self.opts.redis_url,
            "CHAOS_DATABASE_URL": self.worker_database_url,
            "CHAOS_PREFIX": self.prefix,
            "CHAOS_LEDGER_PREFIX": self.ledger_prefix,
            "CHAOS_QUEUE": self.queue,
            "CHAOS_TTL": str(self.opts.ttl),
            "CHAOS_MAX_ATTEMPTS": str(self.opts.max_attempts),
            "CHAOS_UNFENCED": "1" if self.opts.unfenced else "0",
            "CHAOS_UNSETTLED": "1" if self.opts.unsettled else "0",
            "CHAOS_PROVIDER_URL": self.provider.url,
            "CHAOS_REMOTE_TIMEOUT": str(self.opts.remote_timeout),
        }

    def start(self) -> None:
        self.provider.start()
        if self.proxy is not None:
            self.proxy.up()
        self.store.create_schema()  # before the workers: nobody races for it
        app_metadata.create_all(self.store.engine)  # the app's own table (app-write)
        if self.name in OWN_WORKERS:
            return
        started = [self.start_worker(str(i)) for i in range(self.opts.workers)]
        for w in started:
            w.wait_ready()

    def start_worker(self, label: str, **env: str) -> Worker:
        """Start one more worker on this scenario's queue (``env`` overrides ``CHAOS_*``)."""
        name = f"chaos-{self.name}-{label}-{self.run_id}"
        env = {**self.env(), **env}
        worker = Worker(name=name, queue=self.queue, env=env, log_dir=self.workdir)
        self.workers.append(worker.start())
        return worker

    def stop_worker(self, worker: Worker) -> None:
        worker.stop()
        self.workers.remove(worker)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        # what a worker left in the queue (e.g. the control arm's endless re-sends)
        with contextlib.suppress(Exception), self.client.connection_for_write() as conn:
            conn.default_channel.queue_purge(self.queue)
        self.provider.stop()
        if self.proxy is not None:
            self.proxy.down()
        with contextlib.suppress(Exception):
            for k in self.leases.scan_iter(f"{self.prefix}:*", count=1000):
                self.leases.delete(k)
            for k in self.ledger.scan_iter(f"{self.ledger_prefix}:*", count=1000):
                self.ledger.delete(k)
        self.store.dispose()
        self.client.close()

    # -- helpers for the scenarios ---------------------------------------------------------------

    def key(self, run: int, label: str = "") -> str:
        return f"{self.prefix}:{self.name}:{run}{':' + label if label else ''}"

    def send(self, job: Job, *, options: dict[str, Any] | None = None, **kwargs: Any) -> str:
        """Send the job's message (task kwargs ``kwargs``; Celery ``options`` such as
        ``time_limit`` or ``expires``)."""
        result = self.client.send_task(
            TASK_NAME, args=[job.key], kwargs=kwargs, queue=self.queue, **(options or {})
        )
        job.task_ids.append(result.id)
        return str(result.id)

    def queued(self) -> int:
        """Messages of this scenario's queue the broker holds (ready, plus delivered and not
        yet acked on the Redis transport)."""
        with self.client.connection_for_write() as conn:
            channel: Any = conn.default_channel
            if conn.transport.driver_type != "redis":
                return int(channel.queue_declare(queue=self.queue, passive=True).message_count)
            lists = {channel._q_for_pri(self.queue, p) for p in channel.priority_steps}
            ready = sum(int(channel.client.llen(name)) for name in lists)
            unacked = 0
            for raw in channel.client.hvals(channel.unacked_key):
                with contextlib.suppress(ValueError, TypeError):
                    unacked += json.loads(raw)[2] == self.queue
            return ready + unacked

    def claims(self, key: str) -> int:
        """Generations claimed in Redis for ``key`` (its counter)."""
        return int(self.leases.get(self.lease_store.keys_for(key).generation) or 0)

    def events(self, key: str | None = None) -> list[dict[str, Any]]:
        raw = self.ledger.lrange(f"{self.ledger_prefix}:events", 0, -1)
        entries = [json.loads(r) for r in raw]
        return [e for e in entries if key is None or e["key"] == key]

    def wait_event(self, key: str, ev: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [
                e
                for e in self.events(key)
                if e["ev"] == ev
                and all(m(e) if callable(m) else e.get(k) == m for k, m in match.items())
            ]
            return bool(found)

        if not wait_until(seen, timeout, interval=0.05):
            raise TimeoutError(f"no {ev!r} event for {key} in {timeout}s")
        return found[0]

    def worker_of(self, pid: int) -> Worker:
        for w in self.workers:
            if w.owns(pid):
                return w
        raise LookupError(f"pid {pid} belongs to no worker of this scenario")

    def flush_leases(self) -> None:
        """Lose the lease store: restart the harness's own Redis, or delete every lease key and
        generation counter under this scenario's prefix."""
        if self.own_redis is not None:
            self.own_redis.restart()
            return
        keys = list(self.leases.scan_iter(f"{self.prefix}:*", count=1000))
        if keys:
            self.leases.delete(*keys)

    def _finished(self, job: Job) -> bool:
        return all(self.client.AsyncResult(t).ready() for t in job.task_ids)

    def converge(self, jobs: Sequence[Job], since: float) -> float:
        """Wait until every job is terminal, every message finished and every committed effect
        delivered (bounded by ``--converge-timeout``); return the seconds since ``since``."""
        last_sweep = time.monotonic()

        def done() -> bool:
            nonlocal last_sweep
            for job in jobs:
                record = self.store.get(job.key)
                if record is None or record.status not in ("completed", "dead"):
                    return False
                if not self._finished(job):
                    return False
                if any(r.status == "pending" for r in self.store.outbox.rows(key=job.key)):
                    if time.monotonic() - last_sweep > 3.0:  # the beat a real deployment runs
                        self.client.send_task(SWEEP_TASK, queue=self.queue)
                        last_sweep = time.monotonic()
                    return False
            return True

        try:
            converged = wait_until(done, self.opts.converge_timeout, interval=0.1)
        except Exception as exc:  # e.g. the database itself answered an error: check what we can
            print(
                f"  converge check failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                file=sys.stderr,
            )
            converged = False
        elapsed = time.monotonic() - since
        for job in jobs:
            job.finished = self._finished(job)
            job.states = [str(self.client.AsyncResult(t).state) for t in job.task_ids]
        self.jobs.extend(jobs)
        for w in self.workers:  # whatever happened, no worker stays stopped
            w.signal(signal.SIGCONT)
        return elapsed if converged else max(elapsed, self.opts.converge_timeout)


# -- the scenarios: each run returns (faults injected, seconds to converge) ------------------------

Run = Callable[[Scenario, int, random.Random], tuple[int, float]]


def run_pause(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """SIGSTOP the worker running the job past its TTL, let a newer attempt take over, SIGCONT.

    Runs cycle through four bodies: with or without ``guard()`` before the side effect, with or
    without an outbox effect. Run 0 has neither, so only the store's generation fence stands
    between the stale attempt and a stale write."""
    ttl = s.opts.ttl
    job = Job(s.key(i))
    check, notify = ((False, False), (True, True), (False, True), (True, False))[i % 4]
    s.send(job, sleep=ttl * 2.5, check=check, notify=notify)
    first = s.wait_event(job.key, "start")
    a = s.worker_of(first["pid"])
    time.sleep(rng.uniform(0.05, ttl * 0.5))
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(ttl * rng.uniform(1.2, 1.6))  # A's lease expires in Redis: nobody renews it
    s.send(job, sleep=0.1, check=True)
    s.wait_event(job.key, "start", gen=lambda e: e["gen"] > first["gen"])
    if rng.random() < 0.5:  # resume after the newer attempt completed, or while it works
        wait_until(lambda: (r := s.store.get(job.key)) is not None and r.status == "completed", 30)
    a.signal(signal.SIGCONT)
    return 1, s.converge([job], paused_at)


def run_app_write(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """SIGSTOP the worker inside its ``fence.transaction()`` block (entered, not yet written) past
    its TTL, let a newer attempt take over and write its own row, SIGCONT.

    On PostgreSQL the server ends the paused block's session after one TTL idle; on SQLite the
    paused block holds the database's write lock, so the newer attempt cannot register until the
    first one resumes: the harness resumes it once the newer attempt started or two TTLs passed.
    Odd runs also stage an outbox effect."""
    ttl = s.opts.ttl
    job = Job(s.key(i))
    s.send(job, app_write=True, block_sleep=ttl * 2.5, check=False, notify=i % 2 == 1)
    entered = s.wait_event(job.key, "tx")
    a = s.worker_of(entered["pid"])
    time.sleep(rng.uniform(0.05, ttl * 0.3))
    a.signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    time.sleep(ttl * rng.uniform(1.2, 1.6))  # A's lease expires in Redis: nobody renews it
    s.send(job, app_write=True, sleep=0.1, check=False, notify=i % 2 == 1)
    with contextlib.suppress(TimeoutError):
        s.wait_event(job.key, "start", timeout=ttl * 2, gen=lambda e: e["gen"] > entered["gen"])
        if rng.random() < 0.5:  # resume after the newer attempt completed, or while it works
            wait_until(
                lambda: (r := s.store.get(job.key)) is not None and r.status == "completed",
                ttl * 4,
            )
    a.signal(signal.SIGCONT)
    return 1, s.converge([job], paused_at)


def run_kill(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """SIGKILL the pool process in each window: before the side effect, after it but before the
    completion commit, after the commit but before the ack (one job per window, at once)."""
    jobs = []
    windows = list(KILL_WINDOWS)
    rng.shuffle(windows)
    for window in windows:
        job = Job(s.key(i, window), expect_starts=1 if window == "after_commit" else None)
        s.ledger.set(f"{s.ledger_prefix}:kill:{window}:{job.key}", 1)
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
    return copies - 1, s.converge([job], time.monotonic())


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
    return 1, s.converge([job], lost_at)


def run_db_outage(s: Scenario, i: int, rng: random.Random) -> tuple[int, float]:
    """The database unreachable (the harness's TCP proxy in front of PostgreSQL refuses and cuts
    every connection) while the bodies finish and try to complete; then back."""
    assert s.proxy is not None
    jobs = [Job(s.key(i, str(n))) for n in range(2)]
    for job in jobs:
        s.send(job, sleep=rng.uniform(0.2, 0.5), check=rng.random() < 0.5)
    for job in jobs:
        s.wait_event(job.key, "start")
    s.proxy.down()
    down_at = time.monotonic()
    time.sleep(rng.uniform(0.5, 2.0))
    s.proxy.up()
    return 1, s.converge(jobs, down_at)


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
    kills = sum(1 for e in s.events(killer.key) if e["ev"] == "kill")
    return 1 + kills, elapsed


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
    s.ledger.set(f"{s.ledger_prefix}:overrun:{once.key}", 1)
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
    s.ledger.set(f"{s.ledger_prefix}:fail:{retried.key}", 1)
    sent_at = time.time()
    s.send(busy, sleep=0.1, options={"expires": expires})
    s.send(retried, sleep=rng.uniform(1.7, 2.1), options={"expires": expires})
    elapsed = s.converge([retried, busy], time.monotonic())
    late = [e for e in s.events(retried.key) if e["ev"] == "fail" and e["t"] > sent_at + expires]
    return 1 + len(late), elapsed


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
    if not wait_until(lambda: bad.exited or " ready." in bad.log(), 90, 0.1):
        raise TimeoutError("the misconfigured worker neither exited nor started in 90s")
    if not bad.exited:  # it started: plain Celery fails each task (and acks it)
        for job in jobs:
            job.observed.append(f"a worker with fence_renew_interval={interval:.3f} started")
        # until it has taken and acked all of them (a message it has not acked yet would go
        # back to the queue when it stops)
        wait_until(lambda: all(s._finished(j) for j in jobs) and s.queued() == 0, 15)
    s.stop_worker(bad)
    taken = len(jobs) - s.queued()
    if taken:
        for job in jobs:
            job.observed.append(f"the misconfigured worker took {taken} of {len(jobs)} messages")
    good = s.start_worker(f"good-{i}")
    good.wait_ready()
    elapsed = s.converge(jobs, started_at)
    s.stop_worker(good)
    return 1, elapsed


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
    return 1, elapsed


RUNS: dict[str, Run] = {
    "pause": run_pause,
    "app-write": run_app_write,
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
}


# -- databases ---------------------------------------------------------------------------------


def _pg_database(opts: Options, scenario: str) -> tuple[str, str] | str:
    """(URL, name to drop afterwards or "") of the PostgreSQL database ``scenario`` runs against:
    ``--database-url`` when it is PostgreSQL, else a fresh one made through ``--pg-admin-url``;
    or the reason there is none."""
    if opts.database_url and opts.database_url.startswith("postgresql"):
        return opts.database_url, ""
    name = f"celery_fence_chaos_{uuid.uuid4().hex[:10]}"
    try:
        admin = sa.create_engine(opts.pg_admin_url, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        admin.dispose()
    except Exception as exc:
        return f"{scenario} needs PostgreSQL (--pg-admin-url): {type(exc).__name__}: {exc}"[:300]
    url = sa.engine.make_url(opts.pg_admin_url).set(database=name)
    return url.render_as_string(hide_password=False), name


def _drop_database(opts: Options, name: str) -> None:
    admin = sa.create_engine(opts.pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def _proxied(url: str, proxy: TcpProxy) -> str:
    return (
        sa.engine.make_url(url)
        .set(host="127.0.0.1", port=proxy.port)
        .render_as_string(hide_password=False)
    )


# -- one scenario --------------------------------------------------------------------------------


def run_scenario(
    name: str, opts: Options, workdir: Path, own_redis: RedisServer | None, rng: random.Random
) -> ScenarioResult:
    result = ScenarioResult(scenario=name)
    lease_url = own_redis.url if own_redis is not None else opts.redis_url
    proxy = None
    drop: str | None = None
    if name in POSTGRESQL_ONLY:
        found = _pg_database(opts, name)
        if isinstance(found, str):
            result.skipped = found
            return result
        database_url, drop = found
        worker_url = database_url
        if name == "db-outage":
            upstream = sa.engine.make_url(database_url)
            proxy = TcpProxy(upstream.host or "127.0.0.1", upstream.port or 5432)
            worker_url = _proxied(database_url, proxy)
    else:
        database_url = opts.database_url or f"sqlite:///{workdir / f'{name}.sqlite3'}"
        worker_url = database_url
    if drop:
        register_closer(lambda: _drop_database(opts, drop))
    s = Scenario(name, opts, workdir, lease_url, own_redis, database_url, worker_url, proxy)
    try:
        s.start()
        for i in range(opts.runs):
            try:
                faults, elapsed = RUNS[name](s, i, rng)
            except Exception as exc:  # a harness step timed out: report it, check what ran
                result.error = f"run {i + 1} aborted: {type(exc).__name__}: {exc}"[:500]
                for w in s.workers:
                    w.signal(signal.SIGCONT)
                break
            result.runs += 1
            result.faults += faults
            result.max_converge_s = max(result.max_converge_s, elapsed)
            if not opts.quiet:
                print(
                    f"  {name} run {i + 1}/{opts.runs}: {faults} faults, {elapsed:.2f}s", flush=True
                )
        time.sleep(0.5)  # let the last writes and ledger entries land
        ledger = checker.parse_ledger(s.ledger.lrange(f"{s.ledger_prefix}:events", 0, -1))
        checker.check(result, s.jobs, s.store, ledger, s.provider.stats())
    finally:
        s.stop()
        if drop:
            with contextlib.suppress(Exception):
                _drop_database(opts, drop)
    return result


def run(opts: Options) -> list[ScenarioResult]:
    install_handlers()
    rng = random.Random(opts.seed)
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="celery-fence-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    own_redis = RedisServer(workdir).start() if opts.own_redis else None
    results = []
    try:
        for name in opts.scenarios:
            if not opts.quiet:
                print(f"scenario {name} ...", flush=True)
            results.append(run_scenario(name, opts, workdir, own_redis, rng))
    finally:
        cleanup()
    if not opts.workdir and all(r.safe for r in results):
        shutil.rmtree(workdir, ignore_errors=True)
    elif not opts.quiet:
        print(f"worker logs kept in {workdir}", flush=True)
    return results


# -- the command line ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> Options:
    p = argparse.ArgumentParser(
        prog="python -m celery_fence.chaos",
        description="Inject faults into real celery-fence workers and check the history.",
    )
    p.add_argument(
        "--scenario",
        action="append",
        default=None,
        metavar="NAME|all",
        help=f"one of {', '.join(SCENARIOS)} or all (repeatable; default all)",
    )
    p.add_argument("--runs", type=int, default=3, help="runs per scenario (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random timings (default 0)")
    p.add_argument(
        "--redis-url",
        default=Options.redis_url,
        help="Redis for leases, the ledger and results (default %(default)s)",
    )
    p.add_argument("--broker-url", default=Options.broker_url, help="default %(default)s")
    p.add_argument(
        "--database-url",
        default=None,
        help="the result store (default: a fresh SQLite file per scenario)",
    )
    p.add_argument(
        "--pg-admin-url",
        default=Options.pg_admin_url,
        help="where db-outage creates a throwaway PostgreSQL database when "
        "--database-url is not PostgreSQL (default %(default)s)",
    )
    p.add_argument(
        "--ttl",
        type=float,
        default=Options.ttl,
        help="fence_lease_ttl in seconds (renewal every ttl/3; default %(default)s)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=Options.max_attempts,
        help="fence_max_attempts (default %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=Options.workers,
        help="worker processes per scenario, each -c 1 (default %(default)s, min 2)",
    )
    p.add_argument(
        "--unfenced",
        action="store_true",
        help="DEMONSTRATION ONLY: fence_unfenced=True turns off the store's "
        "generation fence (fence.transaction() becomes guard() + a plain transaction); "
        "expect stale writes",
    )
    p.add_argument(
        "--unsettled",
        action="store_true",
        help="DEMONSTRATION ONLY: fence_unsettled=True leaves Celery's own exits "
        "(hard time limit, expires, bad settings, refused arguments) as plain Celery "
        "handles them; expect lost jobs",
    )
    p.add_argument(
        "--own-redis",
        action="store_true",
        help="start a redis-server for the lease store; redis-loss restarts it",
    )
    p.add_argument(
        "--converge-timeout",
        type=float,
        default=Options.converge_timeout,
        help="seconds a run may take to converge (default %(default)s)",
    )
    p.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="also write the results as JSON",
    )
    p.add_argument("--workdir", default=None, help="keep worker logs and SQLite files here")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    names = a.scenario or ["all"]
    scenarios: list[str] = []
    for n in names:
        for part in n.split(","):
            if part == "all":
                scenarios.extend(s for s in SCENARIOS if s not in scenarios)
            elif part in SCENARIOS:
                if part not in scenarios:
                    scenarios.append(part)
            else:
                p.error(f"unknown scenario {part!r}: choose from {', '.join(SCENARIOS)} or all")
    if a.runs < 1:
        p.error("--runs must be at least 1")
    if a.workers < 2:
        p.error("--workers must be at least 2 (pause needs a second worker to take over)")
    if a.ttl <= 0:
        p.error("--ttl must be positive")
    return Options(
        scenarios=scenarios,
        runs=a.runs,
        seed=a.seed,
        redis_url=a.redis_url,
        broker_url=a.broker_url,
        database_url=a.database_url,
        pg_admin_url=a.pg_admin_url,
        ttl=a.ttl,
        max_attempts=a.max_attempts,
        workers=a.workers,
        unfenced=a.unfenced,
        unsettled=a.unsettled,
        own_redis=a.own_redis,
        converge_timeout=a.converge_timeout,
        json_path=a.json_path,
        workdir=a.workdir,
        quiet=a.quiet,
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    started = time.monotonic()
    try:
        results = run(opts)
    except KeyboardInterrupt:
        print("interrupted; every process the harness started was stopped", file=sys.stderr)
        return 130
    table = checker.render(results)
    ok = all(r.safe for r in results)
    errors = [f"{r.scenario}: {r.error}" for r in results if r.error]
    print(table)
    for r in results:
        if r.skipped:
            print(f"{r.scenario}: skipped: {r.skipped}")
        if r.error:
            print(f"{r.scenario}: HARNESS ERROR: {r.error}")
        for v in r.violations[:20]:
            print(f"{r.scenario}: {v}")
    total = sum(r.faults for r in results)
    arms = "".join(
        f", {arm}" for arm, on in (("UNFENCED", opts.unfenced), ("UNSETTLED", opts.unsettled)) if on
    )
    print(
        f"{total} faults injected in {time.monotonic() - started:.0f}s "
        f"(seed {opts.seed}, ttl {opts.ttl}s{arms}): "
        + ("every safety column is zero" if ok else "SAFETY VIOLATIONS")
    )
    if opts.json_path:
        Path(opts.json_path).write_text(
            json.dumps(
                {
                    "ok": ok and not errors,
                    "errors": errors,
                    "argv": list(sys.argv[1:] if argv is None else argv),
                    "seed": opts.seed,
                    "ttl": opts.ttl,
                    "unfenced": opts.unfenced,
                    "unsettled": opts.unsettled,
                    "faults": total,
                    "safety_columns": list(checker.SAFETY_COLUMNS),
                    "scenarios": [r.as_dict() for r in results],
                    "table": table,
                },
                indent=2,
            )
        )
    if not ok:
        return 1
    return 2 if errors else 0
