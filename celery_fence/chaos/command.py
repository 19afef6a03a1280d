"""``python -m celery_fence.chaos``: the command line, the results table and the JSON report.

See the package docstring (:mod:`celery_fence.chaos`) for the options and the columns."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from celery_fence.chaos import checker
from celery_fence.chaos.options import SCENARIOS, Options
from celery_fence.chaos.runner import run

#: RabbitMQ for ``--broker amqp`` when ``FENCE_TEST_AMQP_URL`` is not set (the tests' default).
AMQP_DEFAULT = "amqp://guest:guest@127.0.0.1:5672//"


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
        "--rows", type=int, default=10_000, help="rows the export scenario exports (10000)"
    )
    p.add_argument(
        "--redis-url",
        default=Options.redis_url,
        help="Redis for leases, the ledger and results (default %(default)s)",
    )
    p.add_argument("--broker-url", default=Options.broker_url, help="default %(default)s")
    p.add_argument(
        "--broker",
        choices=("redis", "amqp"),
        default=None,
        help="amqp: RabbitMQ at FENCE_TEST_AMQP_URL (or the tests' default, guest at "
        "127.0.0.1:5672) instead of --broker-url",
    )
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
        help="DEMONSTRATION ONLY: the workers' store has no generation fence "
        "(fence.transaction() becomes guard() + a plain transaction); expect stale writes",
    )
    p.add_argument(
        "--unsettled",
        action="store_true",
        help="DEMONSTRATION ONLY: a task base that leaves Celery's own exits "
        "(hard time limit, expires, bad settings, refused arguments) as plain Celery "
        "handles them; expect lost jobs",
    )
    p.add_argument(
        "--rerun-finished",
        action="store_true",
        help="DEMONSTRATION ONLY: the workers' registration takes a completed or dead job's row "
        "again (its terminal-state term dropped, in the workload's task only); expect body "
        "re-runs after completion",
    )
    p.add_argument(
        "--unwatched",
        action="store_true",
        help="DEMONSTRATION ONLY: nobody watches the body's writes on other connections "
        "(celery_fence.chaos.arms.UnwatchedTask: a write beside a fenced block is neither "
        "refused nor flagged); expect stale app-table writes in beside-block",
    )
    p.add_argument(
        "--async-endings",
        action="store_true",
        help="DEMONSTRATION ONLY: the workers' store commits a job's endings (completion, retry, "
        "dead) as it commits a registration, without waiting for their WAL flush "
        "(synchronous_commit off); expect lost jobs in store-crash",
    )
    p.add_argument(
        "--unfenced-steps",
        action="store_true",
        help="DEMONSTRATION ONLY: fence.run_step() is a plain call (nothing stored, no boundary "
        "check: celery_fence.chaos.arms.UnfencedStepsTask); expect stale writes and unexpected "
        "outcomes in steps",
    )
    p.add_argument(
        "--provider-not-idempotent",
        dest="provider_idempotent",
        action="store_false",
        help="DEMONSTRATION ONLY: the provider stub ignores Idempotency-Key and performs every "
        "request; expect duplicate external effects",
    )
    p.add_argument(
        "--ttl-lock",
        action="store_true",
        help="DEMONSTRATION ONLY: unique jobs guarded by a celery-once-style Redis lock with a "
        "timeout instead of the store's unique index (celery_fence.chaos.arms.TTLLockTask); "
        "expect lost jobs in unique (a killed holder's lock discards the later sends)",
    )
    p.add_argument(
        "--stock-beat",
        action="store_true",
        help="DEMONSTRATION ONLY: the beat scenario's replicas run Celery's stock "
        "PersistentScheduler; expect duplicate completions (every replica sends every tick)",
    )
    p.add_argument(
        "--no-group-limit",
        action="store_true",
        help="DEMONSTRATION ONLY: the group scenario's task has its fence_group but no "
        "fence_group_limit (only Celery's per-worker concurrency bounds it); expect limits "
        "broken in group",
    )
    p.add_argument(
        "--celery-rate-limit",
        action="store_true",
        help="DEMONSTRATION ONLY: the rate scenario's task has Celery's own rate_limit (per "
        "worker) instead of fence_rate_limit; expect limits broken in rate (N workers: N times "
        "the rate)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=Options.duration,
        help="seconds the rate scenario measures its rate over (default %(default)s)",
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
    if a.duration < 5:
        p.error("--duration must be at least 5 seconds (the rate is measured over it)")
    return Options(
        scenarios=scenarios,
        runs=a.runs,
        seed=a.seed,
        redis_url=a.redis_url,
        broker_url=os.environ.get("FENCE_TEST_AMQP_URL", AMQP_DEFAULT)
        if a.broker == "amqp"
        else a.broker_url,
        database_url=a.database_url,
        pg_admin_url=a.pg_admin_url,
        ttl=a.ttl,
        max_attempts=a.max_attempts,
        workers=a.workers,
        unfenced=a.unfenced,
        unsettled=a.unsettled,
        rerun_finished=a.rerun_finished,
        unwatched=a.unwatched,
        unfenced_steps=a.unfenced_steps,
        rows=a.rows,
        async_endings=a.async_endings,
        provider_idempotent=a.provider_idempotent,
        ttl_lock=a.ttl_lock,
        stock_beat=a.stock_beat,
        duration=a.duration,
        no_group_limit=a.no_group_limit,
        celery_rate_limit=a.celery_rate_limit,
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
    ok = not any(r.violated for r in results)
    not_run = [r.scenario for r in results if r.skipped or r.runs == 0]
    errors = [f"{r.scenario}: {r.error}" for r in results if r.error]
    print(table)
    for r in results:
        if r.skipped:
            print(f"{r.scenario}: skipped: {r.skipped}")
        if r.error:
            print(f"{r.scenario}: HARNESS ERROR: {r.error}")
        for v in r.violations[:20]:
            print(f"{r.scenario}: {v}")
        if r.measured:
            print(f"{r.scenario}: measured: {json.dumps(r.measured)}")
    total = sum(r.faults for r in results)
    arms = "".join(
        f", {arm}"
        for arm, on in (
            ("UNFENCED", opts.unfenced),
            ("UNSETTLED", opts.unsettled),
            ("RERUN FINISHED", opts.rerun_finished),
            ("UNWATCHED", opts.unwatched),
            ("UNFENCED STEPS", opts.unfenced_steps),
            ("ASYNC ENDINGS", opts.async_endings),
            ("PROVIDER NOT IDEMPOTENT", not opts.provider_idempotent),
            ("NO GROUP LIMIT", opts.no_group_limit),
            ("CELERY RATE LIMIT", opts.celery_rate_limit),
        )
        if on
    )
    if not ok:
        verdict = "SAFETY VIOLATIONS"
    elif errors or not_run:
        verdict = "NOT EVERYTHING WAS CHECKED: " + "; ".join(
            [f"not run: {', '.join(not_run)}"] * bool(not_run)
            + [f"harness errors in {', '.join(r.scenario for r in results if r.error)}"]
            * bool(errors)
        )
    else:
        verdict = "every safety column is zero"
    print(
        f"{total} faults injected in {time.monotonic() - started:.0f}s "
        f"(seed {opts.seed}, ttl {opts.ttl}s{arms}): {verdict}"
    )
    if opts.json_path:
        Path(opts.json_path).write_text(
            json.dumps(
                {
                    "ok": ok and not errors and not not_run,
                    "errors": errors,
                    "not_run": not_run,
                    "argv": list(sys.argv[1:] if argv is None else argv),
                    "seed": opts.seed,
                    "ttl": opts.ttl,
                    "unfenced": opts.unfenced,
                    "unsettled": opts.unsettled,
                    "rerun_finished": opts.rerun_finished,
                    "unwatched": opts.unwatched,
                    "unfenced_steps": opts.unfenced_steps,
                    "async_endings": opts.async_endings,
                    "provider_idempotent": opts.provider_idempotent,
                    "no_group_limit": opts.no_group_limit,
                    "celery_rate_limit": opts.celery_rate_limit,
                    "duration": opts.duration,
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
    return 2 if errors or not_run else 0
