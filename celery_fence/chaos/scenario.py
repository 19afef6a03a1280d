"""One scenario's world: its workers, queue, key prefix, database, ledger and provider, and the
helpers its runs use (send, wait for a ledger event, converge)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from celery_fence.chaos import TASK_NAME, app_metadata
from celery_fence.chaos.checker import Job
from celery_fence.chaos.options import OWN_WORKERS, WORKERS_RECOVER, Options
from celery_fence.leases.lease import LeaseStore
from celery_fence.ops.outbox import SWEEP_TASK
from celery_fence.store import Store
from celery_fence.testing.broker import delete_queues, queued
from celery_fence.testing.postgres_server import PostgresCluster
from celery_fence.testing.processes import RedisServer, Worker, poll_until
from celery_fence.testing.provider import ProviderStub
from celery_fence.testing.proxy import TcpProxy

#: What the scenario's workers run (``celery -A``): the workload app.
WORKLOAD_APP = "celery_fence.chaos.workload"
#: Seconds a scenario's worker may take to start (several start at once on a busy machine).
WORKER_READY_TIMEOUT = 90.0


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
    #: The harness's own PostgreSQL cluster (store-crash), which a run crashes and restarts.
    cluster: PostgresCluster | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    workers: list[Worker] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    #: Every job a run sent, converged or not (an aborted run's jobs are still checked).
    sent: list[Job] = field(default_factory=list)
    #: What the limit scenarios' runs measured, for :mod:`.checker_limits` (one entry a run).
    measures: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefix = f"chaos-{self.run_id}"
        self.ledger_prefix = f"{self.prefix}-ledger"
        self.queue = f"chaos-{self.run_id}"
        self.provider = ProviderStub(idempotent=self.opts.provider_idempotent)
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
            "CHAOS_RERUN_FINISHED": "1" if self.opts.rerun_finished else "0",
            "CHAOS_UNWATCHED": "1" if self.opts.unwatched else "0",
            "CHAOS_UNFENCED_STEPS": "1" if self.opts.unfenced_steps else "0",
            "CHAOS_ASYNC_ENDINGS": "1" if self.opts.async_endings else "0",
            "CHAOS_TTL_LOCK": "1" if self.opts.ttl_lock else "0",
            "CHAOS_PROVIDER_URL": self.provider.url,
            "CHAOS_REMOTE_TIMEOUT": str(self.opts.remote_timeout),
            "CHAOS_RECOVER_INTERVAL": "default"
            if self.name in WORKERS_RECOVER and not self.opts.ttl_lock
            else "0",
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

    def start_worker(
        self, label: str, *, pool: str = "prefork", concurrency: int = 1, **env: str
    ) -> Worker:
        """Launch one more worker of the workload on this scenario's queue (``env`` overrides
        ``CHAOS_*``) and return it at once: the caller waits with :meth:`Worker.wait_ready`, or
        watches the start itself (a worker that is meant to refuse to start)."""
        worker = Worker(
            WORKLOAD_APP,
            env={**self.env(), **env},
            queue=self.queue,
            name=f"chaos-{self.name}-{label}-{self.run_id}",
            log_dir=self.workdir,
            pool=pool,
            concurrency=concurrency,
            ready_timeout=WORKER_READY_TIMEOUT,
        )
        self.workers.append(worker.launch())
        return worker

    def stop_worker(self, worker: Worker) -> None:
        worker.stop()
        self.workers.remove(worker)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        # what a worker left in the queue (e.g. the control arm's endless re-sends), and on Redis
        # kombu's binding keys of the queue
        with contextlib.suppress(Exception):
            delete_queues(self.client, [self.queue])
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
        if not any(j is job for j in self.sent):
            self.sent.append(job)
        return str(result.id)

    def queued(self) -> int:
        """Messages of this scenario's queue the broker holds (ready, plus delivered and not
        yet acked on the Redis transport). On AMQP only the ready ones: a message a worker holds
        unacked counts as taken (which is what the misconfig scenario asks: did the bad worker
        take any)."""
        return queued(self.client, self.queue, held_by_workers=False)

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

        if not poll_until(seen, timeout, interval=0.05):
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
                if any(r.status == "pending" for r in self.store.outbox_rows.rows(key=job.key)):
                    if time.monotonic() - last_sweep > 3.0:  # the beat a real deployment runs
                        self.client.send_task(SWEEP_TASK, queue=self.queue)
                        last_sweep = time.monotonic()
                    return False
            return True

        try:
            converged = poll_until(done, self.opts.converge_timeout, interval=0.1)
        except Exception as exc:  # e.g. the database itself answered an error: check what we can
            print(
                f"  converge check failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                file=sys.stderr,
            )
            converged = False
        elapsed = time.monotonic() - since
        self._collect(jobs)
        for w in self.workers:  # whatever happened, no worker stays stopped
            w.signal(signal.SIGCONT)
        return elapsed if converged else max(elapsed, self.opts.converge_timeout)

    def _collect(self, jobs: Sequence[Job]) -> None:
        """What each job's messages ended with (state, and the value a SUCCESS returned)."""
        for job in jobs:
            job.finished = self._finished(job)
            results = [self.client.AsyncResult(t) for t in job.task_ids]
            job.states = [str(r.state) for r in results]
            job.results = [r.result for r in results if r.state == "SUCCESS"]
            if not any(j is job for j in self.jobs):
                self.jobs.append(job)

    def abandon(self) -> None:
        """A run aborted: its jobs are checked as they are (a job left unfinished is lost)."""
        for w in self.workers:
            w.signal(signal.SIGCONT)
        self._collect([j for j in self.sent if not any(j is k for k in self.jobs)])


def superseded(s: Scenario, key: str, attempt: str) -> int:
    """1 when the fault acted on ``attempt`` (the paused or held one), from the ledger: it
    learnt it had lost its lease (``lost``), or it reached the store (an ``outcome``) after an
    attempt of a newer generation had started; else 0."""
    events = s.events(key)
    own = [e for e in events if e.get("attempt") == attempt]
    if any(e["ev"] == "lost" for e in own):
        return 1
    gen = next((e["gen"] for e in own if e["ev"] == "start"), None)
    newer = [
        e["t"]
        for e in events
        if e["ev"] == "start" and e.get("attempt") != attempt and (e.get("gen") or 0) > (gen or 0)
    ]
    reached = [e["t"] for e in own if e["ev"] == "outcome"]
    return int(bool(newer and reached and max(reached) > min(newer)))
