"""The story of a stale worker and a retried export, end to end, with real worker processes.

``python -m example_project.demo`` (or ``scripts/demo``):

1. Worker A takes a report job and an export job (generation 1); the export writes its file.
2. A is paused (SIGSTOP) past its lease. The jobs are handed out again; worker B claims them
   (generation 2), re-runs the export — replacing the same object — and completes both.
3. The "report ready" notification and the export email go through the outbox. The email's first
   delivery times out after the provider did the work; the outbox retries with the same
   idempotency key and the provider replays its answer: delivered twice, performed once.
4. A resumes (SIGCONT). Its report write to the app's table (``self.fence.transaction()``) is
   refused — the table keeps generation 2's row — and its completions with generation 1 are
   rejected by the store.
5. A new export after new data: a new input version, a new object.

Runs on the embedded default: a SQLite file of its own, Redis at 127.0.0.1:6379 (or a
``redis-server`` it starts on a free port), the provider stub in this process. Every process it
starts is stopped at the end, on Ctrl-C too. ``--summary FILE`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import redis

from celery_fence.testing import processes

ROOT = Path(__file__).resolve().parents[1]
DEMO_REDIS_DB = 3  # the tests use 1 and 2


class DemoError(Exception):
    pass


# -- processes -------------------------------------------------------------------------------------


class Worker(processes.Worker):
    """A real ``celery worker`` on the example app, in its own process group (SIGSTOP reaches its
    pool children): the project's one process module, :mod:`celery_fence.testing.processes`."""

    def __init__(self, name: str, env: dict[str, str], workdir: Path, queue: str) -> None:
        super().__init__(
            "example_project.app",
            env=env,
            queue=queue,
            name=f"demo-{name}-{uuid.uuid4().hex[:6]}",
            log_dir=workdir,
            concurrency=2,
            cwd=ROOT,
        )


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}")


@contextlib.contextmanager
def redis_server(
    url: str | None, workdir: Path, say: Callable[[str], None], *, own: bool = False
) -> Iterator[str]:
    """A Redis URL that answers: the given one, the local default, or a server started here."""
    candidate = url or f"redis://127.0.0.1:6379/{DEMO_REDIS_DB}"
    if url and not own and not _pings(url):
        raise DemoError(f"Redis at {url} does not answer")
    if (own or not _pings(candidate)) and shutil.which("redis-server") is None:
        raise DemoError(
            "no Redis answers on 127.0.0.1:6379 and there is no redis-server to start: install "
            "Redis (e.g. apt-get install redis-server) or pass --redis-url redis://host:port/db"
        )
    with processes.redis_url_or_server(candidate, workdir, own=own) as (answering, server):
        if server is not None:
            reason = "as asked (--own-redis)" if own else "no Redis answers on 127.0.0.1:6379"
            pid = server.proc.pid if server.proc is not None else "?"
            say(f"{reason}: started redis-server on port {server.port} (pid {pid})")
        yield answering


def _pings(url: str) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        with contextlib.closing(client):
            return bool(client.ping())
    except redis.RedisError:
        return False


# -- the story -------------------------------------------------------------------------------------


class Demo:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.started = time.monotonic()
        self.workers: list[Worker] = []
        self.worker_pids: list[int] = []
        self.run_id = uuid.uuid4().hex[:6]

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:5.1f}s] {text}", flush=True)

    def configure(self, redis_url: str, provider_url: str) -> dict[str, str]:
        """The environment of the workers and of this process (read by example_project.settings)."""
        env = {
            "EXAMPLE_BROKER_URL": redis_url,
            "EXAMPLE_FENCE_REDIS_URL": redis_url,
            "EXAMPLE_DATABASE_URL": f"sqlite:///{self.workdir / 'demo.sqlite3'}",
            "EXAMPLE_KEY_PREFIX": f"fence-demo-{self.run_id}",
            "EXAMPLE_QUEUE": f"fence-demo-{self.run_id}",
            "EXAMPLE_LEASE_TTL": str(self.args.lease_ttl),
            "EXAMPLE_RENEW_INTERVAL": str(self.args.lease_ttl / 4),
            "EXAMPLE_PROVIDER_URL": provider_url,
            "EXAMPLE_PROVIDER_TIMEOUT": "1.0",
            "EXAMPLE_OBJECTS_DIR": str(self.workdir / "objects"),
            "EXAMPLE_WORK_SECONDS": str(self.args.work_seconds),
        }
        os.environ.update(env)  # before example_project.settings is imported below
        return {**os.environ, **env, "PYTHONPATH": str(ROOT)}

    def start_worker(self, name: str, env: dict[str, str], queue: str) -> Worker:
        worker = Worker(name, env, self.workdir, queue)
        self.workers.append(worker)
        try:
            worker.start()
        except (RuntimeError, processes.WaitTimeout) as exc:
            raise DemoError(f"worker {name} did not start: {exc}") from None
        self.worker_pids.append(worker.pid)
        self.say(f"worker {name} ready (pid {worker.pid})")
        return worker

    def run(self, redis_url: str) -> dict[str, Any]:
        from celery_fence.testing import ProviderStub

        provider = ProviderStub()
        provider_url = provider.start()
        try:
            return self._story(redis_url, provider, self.configure(redis_url, provider_url))
        finally:
            provider.stop()

    def _story(self, redis_url: str, provider: Any, env: dict[str, str]) -> dict[str, Any]:
        from celery_fence import enqueue, get_store, idempotency_key

        from . import db, storage
        from .app import app
        from .settings import QUEUE
        from .tasks import build_report, generate_export

        store = get_store(app)
        store.create_schema()
        db.create_tables()
        db.add_orders(
            [{"customer": f"customer-{i % 4}", "amount_cents": 1000 + 250 * i} for i in range(10)]
        )
        report_id = "2026-q3"
        report_key = f"report:{report_id}"
        # The export request and its job commit together: the job cannot be lost between them.
        with db.engine().begin() as conn:
            export_id = db.store_export(conn, "alice@example.com")
            export_job = enqueue(conn, generate_export, args=(export_id,))
        export = db.get_export(export_id)
        assert export is not None
        export_key = export_job.key
        # The provider will do the first email's work, then answer too late for the client.
        provider.delay_next(2.5, path="/emails")
        self.say(f"store {env['EXAMPLE_DATABASE_URL']}, redis {redis_url}, provider {provider.url}")
        self.say(
            f"export request {export.id} stored with its job (enqueue, one transaction): "
            f"input version {export.input_version}"
        )

        # 1. A takes both jobs (generation 1); the export writes its object.
        a = self.start_worker("A", env, QUEUE)
        report_msg = build_report.delay(report_id)
        for key in (report_key, export_key):
            record = wait_for(partial(_running, store, key, 1), 30, f"A to claim {key}")
            self.say(f"A claimed {key}: generation 1, attempt {_short(record.attempt_id)}")
        first_write = wait_for(lambda: storage.writes(), 30, "the export's first upload")[0]
        self.say(f"A uploaded {first_write['object_key']} (generation 1)")

        # 2. A pauses past its lease; B claims the jobs again (generation 2) and completes them.
        a.pause()
        paused_at = time.monotonic()
        self.say(f"A paused (SIGSTOP) mid-job; its leases run out in {self.args.lease_ttl:g}s")
        b = self.start_worker("B", env, QUEUE)
        time.sleep(max(0.0, self.args.lease_ttl + 0.3 - (time.monotonic() - paused_at)))
        self.say("the jobs are handed out again (as a broker redelivers an unacked message)")
        build_report.apply_async((report_id,), task_id=report_msg.id)
        generate_export.apply_async((export.id,), task_id=export_job.task_id)
        for key in (report_key, export_key):
            record = wait_for(partial(_completed, store, key), 40, f"B to complete {key}")
            self.say(
                f"B completed {key}: generation {record.generation}, attempt "
                f"{_short(record.attempt_id)}"
            )
        for key in (report_key, export_key):
            wait_for(partial(_delivered, store, key), 40, f"the outbox to deliver {key}'s effect")
        self.say("outbox delivered the notification and the email (the email needed a retry)")

        # 3. A resumes; its completions are rejected as stale.
        a.resume()
        self.say("A resumed (SIGCONT) and tries to complete its jobs with generation 1")
        for key in (report_key, export_key):
            stale = wait_for(partial(_stale, store, key), 40, f"A's rejection on {key}")
            self.say(f"store rejected {key} from generation 1 (attempt {_short(stale.attempt_id)})")
        row = wait_for(lambda: db.get_report(report_id), 10, "the report's row in the app table")
        refused = _refusals(store, report_key, 1)
        self.say(
            f"store history of {report_key}, generation 1 after its claim: "
            + (", ".join(f"{t['action']} ({t['reason']})" for t in refused) or "nothing")
        )
        self.say(
            f"app table example_reports: {report_id} holds generation {row['generation']}'s row "
            f"(attempt {_short(row['attempt_id'])})"
        )

        # 4. New data, new export request: a new input version, a new object.
        db.add_orders([{"customer": "customer-new", "amount_cents": 99_00}])
        with db.engine().begin() as conn:
            export2_id = db.store_export(conn, "alice@example.com")
            export2_key = enqueue(conn, generate_export, args=(export2_id,)).key
        export2 = db.get_export(export2_id)
        assert export2 is not None
        wait_for(lambda: _completed(store, export2_key), 40, f"{export2_key} to complete")
        wait_for(lambda: _delivered(store, export2_key), 40, f"{export2_key}'s email")
        self.say(f"new export {export2.id}: input version {export2.input_version}, new object")

        # Let A's own messages finish (they converge on B's results) before stopping workers.
        time.sleep(0.5)
        for worker in (a, b):
            worker.stop()
        self.workers.clear()
        stats = provider.stats()
        return self._summary(
            store=store,
            storage=storage,
            stats=stats,
            keys={"report": report_key, "export": export_key, "export_v2": export2_key},
            report_row=db.get_report(report_id),
            exports={"export": export, "export_v2": export2},
            idempotency_key=idempotency_key,
            env=env,
            redis_url=redis_url,
        )

    def _summary(
        self,
        *,
        store: Any,
        storage: Any,
        stats: dict[str, Any],
        keys: dict[str, str],
        exports: dict[str, Any],
        idempotency_key: Callable[[str, str], str],
        env: dict[str, str],
        redis_url: str,
        report_row: dict[str, Any] | None,
    ) -> dict[str, Any]:
        jobs: dict[str, Any] = {}
        for name, key in keys.items():
            record = store.get(key)
            jobs[name] = {
                "key": key,
                "status": record.status,
                "generation": record.generation,
                "attempt_id": record.attempt_id,
                "result": record.result,
                "stale": [
                    {"generation": t.generation, "attempt_id": t.attempt_id}
                    for t in store.transitions.history(key)
                    if t.action == "stale"
                ],
                "refused": _refusals(store, key, 1),
            }
            if name in exports:
                request = exports[name]
                object_key = record.result["object_key"]
                jobs[name].update(
                    export_id=request.id,
                    input_version=request.input_version,
                    object_key=object_key,
                    object_writes=[
                        {"generation": w["generation"], "attempt_id": w["attempt_id"]}
                        for w in storage.writes()
                        if w["object_key"] == object_key
                    ],
                )
        deliveries = []
        for key in keys.values():
            for row in store.outbox_rows.rows(key=key):
                at_provider = stats["by_key"].get(row.idempotency_key, {})
                deliveries.append(
                    {
                        "key": key,
                        "effect": row.name,
                        "idempotency_key": row.idempotency_key,
                        "status": row.status,
                        "deliveries": row.attempts,
                        "provider_requests": at_provider.get("requests", 0),
                        "provider_performed": at_provider.get("performed", 0),
                    }
                )
        return {
            "workdir": str(self.workdir),
            "database_url": env["EXAMPLE_DATABASE_URL"],
            "redis_url": redis_url,
            "key_prefix": env["EXAMPLE_KEY_PREFIX"],
            "objects_dir": env["EXAMPLE_OBJECTS_DIR"],
            "jobs": jobs,
            "report_row": report_row,
            "deliveries": deliveries,
            "objects": storage.keys(),
            "worker_pids": self.worker_pids,
            "provider": {"requests": stats["requests"], "performed": stats["performed"]},
            "elapsed_seconds": round(time.monotonic() - self.started, 1),
        }

    def cleanup(self, redis_url: str | None) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.stop()
        self.workers.clear()
        if redis_url:  # leases, counters and the queue of this run
            with contextlib.suppress(redis.RedisError):
                r = redis.Redis.from_url(redis_url, socket_timeout=2)
                name = f"fence-demo-{self.run_id}"
                for key in r.scan_iter(f"*{name}*", count=1000):
                    r.delete(key)


def _running(store: Any, key: str, generation: int) -> Any:
    record = store.get(key)
    ok = record and record.status == "running" and record.generation == generation
    return record if ok else None


def _completed(store: Any, key: str) -> Any:
    record = store.get(key)
    return record if record and record.status == "completed" else None


def _delivered(store: Any, key: str) -> bool:
    rows = store.outbox_rows.rows(key=key)
    return bool(rows) and all(r.status == "delivered" for r in rows)


def _stale(store: Any, key: str) -> Any:
    return next((t for t in store.transitions.history(key) if t.action == "stale"), None)


def _refusals(store: Any, key: str, generation: int) -> list[dict[str, Any]]:
    """What the store recorded for ``generation`` of ``key`` after its claim (as read back)."""
    return [
        {"action": str(t.action), "reason": t.reason, "attempt_id": t.attempt_id}
        for t in store.transitions.history(key)
        if t.generation == generation and t.action != "claimed"
    ]


def _short(attempt_id: str) -> str:
    return attempt_id[:8]


def print_summary(summary: dict[str, Any]) -> None:
    jobs = summary["jobs"]
    report, export, export2 = jobs["report"], jobs["export"], jobs["export_v2"]
    print("\nWhat happened")
    for job in (report, export):
        stale = ", ".join(
            f"generation {s['generation']} (attempt {_short(s['attempt_id'])})"
            for s in job["stale"]
        )
        print(
            f"  {job['key']:<22} completed by generation {job['generation']} (attempt "
            f"{_short(job['attempt_id'])}); rejected as stale: {stale or 'none'}"
        )
    row = summary["report_row"]
    refused = ", ".join(f"{t['action']} ({t['reason']})" for t in report["refused"]) or "nothing"
    print(
        f"  {'report table row':<22} example_reports[{row['id']}] by generation "
        f"{row['generation']} (attempt {_short(row['attempt_id'])}); the store recorded for "
        f"generation 1 after its claim: {refused}"
    )
    writes = ", ".join(f"generation {w['generation']}" for w in export["object_writes"])
    print(
        f"  {'export object':<22} {export['object_key']} written {len(export['object_writes'])}x "
        f"({writes}): the re-run replaced the same object"
    )
    print(
        f"  {'new input version':<22} version {export2['input_version']} (was "
        f"{export['input_version']}) -> new object {export2['object_key']}"
    )
    for d in summary["deliveries"]:
        print(
            f"  {d['effect'] + ' ' + d['key'][:14]:<22} delivered {d['deliveries']}x, performed "
            f"{d['provider_performed']}x at the provider "
            f"(Idempotency-Key {d['idempotency_key'][:14]}…)"
        )
    print(
        f"  {'objects in the bucket':<22} {len(summary['objects'])}; provider performed "
        f"{summary['provider']['performed']} of {summary['provider']['requests']} requests"
    )
    print(f"\nFinished in {summary['elapsed_seconds']}s. Files: {summary['workdir']}")


def _caused_by_interrupt(exc: BaseException | None) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m example_project.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--redis-url",
        help="Redis for the leases, the broker and the ledger (default: 127.0.0.1:6379, db 3; "
        "or a redis-server the demo starts on a free port when none answers there)",
    )
    parser.add_argument("--workdir", type=Path, help="where the SQLite file, objects, logs go")
    parser.add_argument("--summary", type=Path, help="also write the summary as JSON here")
    parser.add_argument("--lease-ttl", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--work-seconds", type=float, default=3.0, help="length of each job")
    parser.add_argument("--own-redis", action="store_true", help="start a redis-server of its own")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="celery-fence-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    demo = Demo(args, workdir)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    print("celery-fence demo: a paused worker, a stale attempt, and effects delivered twice\n")
    redis_url: str | None = None
    try:
        with redis_server(args.redis_url, workdir, demo.say, own=args.own_redis) as redis_url:
            try:
                summary = demo.run(redis_url)
            finally:
                demo.cleanup(redis_url)
    except DemoError as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1
    except BaseException as exc:
        # Ctrl-C can land inside an import, where Python wraps the KeyboardInterrupt (a class
        # body's __set_name__ re-raises it as the cause of a RuntimeError): look down the chain.
        if not _caused_by_interrupt(exc):
            raise
        demo.cleanup(redis_url)
        print("\ninterrupted: every process the demo started was stopped", file=sys.stderr)
        return 130
    print_summary(summary)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
