"""Command line of the benchmark: ``python -m bench [mode] [options]`` (from a clone's root).

Modes (default: throughput):

- ``python -m bench`` — plain Celery vs fenced (PostgreSQL, SQLite; with a Redis result backend
  too) vs what a user would pick instead (Celery's database result backend, python-redis-lock,
  celery-once), no-op and 50 ms tasks, alternately in rounds, with Redis commands and SQL
  statements per task counted by the servers and round trips per task counted in the worker
  (critical path vs background); the fenced variants also on ``celery_fence`` as of ``--rev``
  (before/after, in both orders), and only runs whose every task succeeded are reported;
- ``python -m bench --renewal`` — 50 concurrent long tasks on the threads pool: renewal round trips
  per interval (celery-fence: one per process; python-redis-lock: one per lock);
- ``python -m bench --memory`` — 100,000 fenced no-op tasks through one worker child, its RSS
  sampled as it goes;
- ``python -m bench --scale`` — register+complete latency with 10^3 .. 10^6 rows in fence_jobs,
  EXPLAIN of both statements, and purge keeping the table bounded;
- ``python -m bench --latency`` — per task, publish -> result stored at a steady rate well below
  saturation (50 ms tasks), plain vs fenced vs python-redis-lock: percentiles and added latency;
- ``python -m bench --enqueue`` — what a durable ``enqueue()`` costs the caller per job, beside
  ``delay()`` and commit-then-``delay()``;
- ``python -m bench --steps`` — what a fenced step (``fence.run_step``), a replayed step and a
  checkpoint cost the body per call, beside a fenced block with the same insert;
- ``python -m bench --takeover`` — time-to-takeover, fault (pause, kill the pool process, kill the
  worker, lost message) x broker (Redis, RabbitMQ), with real workers (:mod:`bench.takeover`;
  ``--takeover-before``: the settings this release replaced); uses the tests' services
  (``FENCE_TEST_*_URL``), starts none;
- ``python -m bench --experiment`` — the default mode plus ``fenced-pg-exp``: candidate hot-path
  changes (:mod:`bench.experiments`, monkeypatched in a second worker only), same run.

Every mode starts its own servers (two redis-servers, one PostgreSQL cluster with
pg_stat_statements) on free ports and stops them after; ``--json PATH`` also writes the results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--renewal", action="store_true", help="renewal traffic mode")
    mode.add_argument("--memory", action="store_true", help="worker RSS over many tasks")
    mode.add_argument("--scale", action="store_true", help="store latency at 10^3..10^6 rows")
    mode.add_argument("--enqueue", action="store_true", help="caller cost of a durable enqueue")
    mode.add_argument("--steps", action="store_true", help="body cost of a step, a checkpoint")
    mode.add_argument(
        "--latency", action="store_true", help="publish -> result stored per task, steady rate"
    )
    mode.add_argument(
        "--takeover", action="store_true", help="time-to-takeover, fault x broker (real workers)"
    )
    p.add_argument("--takeover-ttl", type=float, default=2.0, help="--takeover: lease TTL (2)")
    p.add_argument(
        "--takeover-faults",
        default="pause,kill-child,kill-worker,lost",
        help="--takeover: faults (default pause,kill-child,kill-worker,lost)",
    )
    p.add_argument(
        "--takeover-brokers", default="redis,amqp", help="--takeover: brokers (redis,amqp)"
    )
    p.add_argument(
        "--takeover-before",
        action="store_true",
        help="--takeover: the old settings (10 TTLs, no worker check, beat every 2 TTLs)",
    )
    p.add_argument(
        "--latency-rate", type=float, default=20.0, help="--latency: tasks a second (default 20)"
    )
    p.add_argument(
        "--latency-tasks", type=int, default=200, help="--latency: tasks a variant a round (200)"
    )
    p.add_argument(
        "--latency-sleep", type=float, default=0.05, help="--latency: body seconds (default 0.05)"
    )
    p.add_argument("--enqueue-jobs", type=int, default=500, help="--enqueue: jobs a round (500)")
    p.add_argument("--steps-ops", type=int, default=300, help="--steps: calls a variant a round")
    p.add_argument(
        "--rounds",
        type=int,
        help="rounds of every variant (default 6 in the throughput mode: 3 in each order; else 5)",
    )
    p.add_argument("--tasks", type=int, default=3000, help="no-op tasks per run (default 3000)")
    p.add_argument("--sleep-tasks", type=int, default=400, help="50 ms tasks per run (default 400)")
    p.add_argument(
        "--trace-tasks", type=int, default=300, help="tasks per traced run (default 300)"
    )
    p.add_argument("--concurrency", type=int, default=4, help="prefork processes (default 4)")
    p.add_argument("--loglevel", default="WARNING", help="worker -l (default WARNING)")
    p.add_argument("--leases", type=int, default=50, help="--renewal: concurrent tasks (50)")
    p.add_argument("--memory-tasks", type=int, default=100_000, help="--memory: tasks (100000)")
    p.add_argument(
        "--scale-sizes",
        default="1000,10000,100000,1000000",
        help="--scale: fence_jobs sizes (default 1000,10000,100000,1000000)",
    )
    p.add_argument("--scale-samples", type=int, default=500, help="--scale: timed jobs per size")
    p.add_argument("--broker-url", help="use this Redis as broker (default: a private one)")
    p.add_argument(
        "--pg-admin-url",
        help="use this PostgreSQL server (a database is created and dropped; default: a private "
        "cluster with pg_stat_statements)",
    )
    p.add_argument(
        "--experiment",
        action="store_true",
        help="also run fenced-pg-exp and fenced-sqlite-exp: candidate hot-path changes "
        "(bench/experiments.py) on a second worker",
    )
    p.add_argument(
        "--experiment-rev",
        metavar="REV",
        help="with --experiment: run fenced-pg-exp on celery_fence as of this git revision "
        "(e.g. HEAD~1), so its row compares that revision with the working tree in one run",
    )
    p.add_argument(
        "--rev",
        metavar="REV",
        help="before/after (default mode): also run the fenced variants on celery_fence as of "
        "this git revision, as <name>@old in the same rounds (default: the newest tag, else "
        f"{BASELINE_REV}, {BASELINE_WHY})",
    )
    p.add_argument("--no-rev", action="store_true", help="no before/after: the working tree alone")
    p.add_argument(
        "--variants",
        metavar="NAMES",
        help="comma-separated variants to run (their baselines are added); default: all",
    )
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    other_mode = (
        args.renewal or args.memory or args.scale or args.enqueue or args.latency or args.steps
    )
    if args.rounds is None:
        args.rounds = 5 if other_mode else 6
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give at least 1 (an even number runs both orders)")
    if args.rev and args.no_rev:
        p.error("--rev and --no-rev contradict each other: give one")
    if args.rev and other_mode:
        p.error(
            "--rev is the throughput mode's before/after (python -m bench --rev REV); "
            + ("with --latency use --experiment-rev REV" if args.latency else "drop it here")
        )
    return args


#: The "before" of a before/after when the repository has no tag: named, so a figure says what it
#: is compared with.
BASELINE_REV = "58aaa76"
BASELINE_WHY = "the last commit before 0.4.0's speed work (no release is tagged)"


def default_rev() -> str:
    """The newest tag reachable from HEAD, else :data:`BASELINE_REV`."""
    described = subprocess.run(
        ["git", "describe", "--tags", "--abbrev=0"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    tag = described.stdout.strip()
    return tag if described.returncode == 0 and tag else BASELINE_REV


def export_revision(rev: str, into: Path) -> str:
    """``celery_fence/`` as of git revision ``rev``, unpacked under ``into``; returns ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", rev, "celery_fence"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        raise SystemExit(f"revision {rev}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return str(into)


def main(argv: list[str] | None = None) -> int:
    from bench.throughput import TasksFailed

    try:
        return _main(argv)
    except TasksFailed as exc:
        print(f"python -m bench: FAILED, {exc}", file=sys.stderr)
        return 1


def _main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.takeover:  # the tests' services: RabbitMQ is no private server here
        from bench import takeover

        figures = takeover.run(
            ttl=args.takeover_ttl,
            faults_=args.takeover_faults.split(","),
            brokers=args.takeover_brokers.split(","),
            before=args.takeover_before,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        return 0
    from bench.harness import services

    with (
        tempfile.TemporaryDirectory(prefix="fence-bench-") as tmp,
        services(Path(tmp), broker_url=args.broker_url, pg_admin_url=args.pg_admin_url) as svc,
    ):
        result: dict[str, Any]
        if args.renewal:
            from bench import renewal

            result = renewal.run(svc, leases=args.leases, loglevel=args.loglevel, out=sys.stdout)
        elif args.memory:
            from bench import memory

            result = memory.run(
                svc, tasks=args.memory_tasks, loglevel=args.loglevel, out=sys.stdout
            )
        elif args.enqueue:
            from bench import enqueue

            result = enqueue.run(svc, jobs=args.enqueue_jobs, rounds=args.rounds, out=sys.stdout)
        elif args.steps:
            from bench import steps

            result = steps.run(svc, ops=args.steps_ops, rounds=args.rounds, out=sys.stdout)
        elif args.latency:
            from bench import latency

            result = latency.run(
                svc,
                rounds=args.rounds,
                tasks=args.latency_tasks,
                rate=args.latency_rate,
                sleep=args.latency_sleep,
                concurrency=args.concurrency,
                loglevel=args.loglevel,
                out=sys.stdout,
                experiment_fence_path=(
                    export_revision(args.experiment_rev, Path(tmp) / "experiment-rev")
                    if args.experiment_rev
                    else None
                ),
                only=frozenset(args.variants.split(",")) if args.variants else None,
            )
        elif args.scale:
            from bench import scale

            sizes = [int(s) for s in args.scale_sizes.split(",") if s]
            result = scale.run(svc, sizes=sizes, samples=args.scale_samples, out=sys.stdout)
        else:
            from bench import throughput

            rev = None if args.no_rev else (args.rev or default_rev())
            rev_path = export_revision(rev, Path(tmp) / "rev") if rev else None
            fence_path = None
            if args.experiment_rev:
                fence_path = export_revision(args.experiment_rev, Path(tmp) / "experiment-rev")
            result = throughput.run(
                svc,
                rounds=args.rounds,
                tasks=args.tasks,
                sleep_tasks=args.sleep_tasks,
                trace_tasks=args.trace_tasks,
                concurrency=args.concurrency,
                loglevel=args.loglevel,
                out=sys.stdout,
                experiment=args.experiment or bool(fence_path),
                experiment_fence_path=fence_path,
                only=frozenset(args.variants.split(",")) if args.variants else None,
                rev=rev,
                rev_fence_path=rev_path,
            )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0
