"""The mutation check: break the fence on purpose, one breakage at a time, and show that the chaos
checker catches each one by name.

``python -m tests.mutations [--only NAME ...] [--ttl SECONDS] [--seed S] [-q]``, from a checkout
of the repository (the project's own check: it is not in the wheel).

For each breakage it copies the installed ``celery_fence`` package to a temporary directory
(never touching the working tree), applies one textual change to the copy, and runs the chaos
scenario that should catch it (``python -m celery_fence.chaos``) with that copy first on the
import path, for the harness and for the workers it starts. It prints, for each breakage, the
safety columns that fired (and the first violation), and exits 0 only when every breakage was
caught and the unbroken copy (``baseline``, run first against the same scenarios) kept every
safety column at zero. A breakage whose text is no longer found in the package is reported as
"not applied" and fails the check: update its text here when the code it breaks changes.

Each breakage and the scenario that catches it:

- ``completion-predicate``: the completion's ``WHERE`` loosened to ``key AND status = 'running'``
  — ``pause`` (a stale completion lands while the newer attempt still runs; the ledger's witness
  sees an attempt told "completed" after a newer generation started).
- ``registration-generation``: the ``generation < excluded.generation`` term dropped from the
  registration — ``redis-loss`` (Redis hands out generation 1 again; the store registers it for a
  second attempt: "generation claimed twice").
- ``registration-terminal``: the registration takes a completed job's row (its ``status NOT IN
  (completed, dead)`` term dropped) — ``kill`` (the message redelivered after the completion
  committed runs the body again: "body re-runs after completion").
- ``commit-check``: the commit-time ownership check skipped in ``fence.transaction()`` —
  ``app-write`` (the paused block commits its row after the newer attempt registered).
- ``release-token``: the lease release deletes the lease without comparing the token —
  ``pause`` (the stale attempt's release deletes the newer attempt's lease: it loses it, and the
  job takes a third attempt: an unexpected outcome).
- ``ack-early``: the message acked when it is received, before the settle step (``acks_late``
  off) — ``kill`` (a job killed before its completion has no message left: lost).
- ``outbox-outside``: the outbox rows inserted outside the completion's transaction (before it,
  whether or not it is accepted) — ``pause`` (a refused stale completion leaves its effect row:
  an outbox row no accepted completion wrote).
- ``guard``: ``guard()`` enters without checking the lease — ``pause`` (a side effect of a
  superseded generation: stale writes accepted).
- ``atomic-check``: the commit-time check skipped in ``fence.atomic()`` — ``django-write`` on
  PostgreSQL (stale app-table writes).
- ``enqueue-row``: ``enqueue()`` publishes without writing the job's durable row —
  ``enqueue-crash`` (the killed publish leaves nothing to recover: lost jobs).
- ``recovery-send``: recovery takes a stranded job for a re-send and never sends it —
  ``recovered-chain`` (lost jobs).
- ``outbox-claim``: delivery claims rows already delivered or claimed — ``duplicate`` with a
  provider that is not idempotent (each replay delivers again: duplicate external effects).

A breakage is caught only when the safety column it names (``Breakage.column``) fires: another
column firing is not this breakage caught.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

import celery_fence
from celery_fence.chaos.checker import COLUMNS, SAFETY_COLUMNS

PACKAGE = Path(celery_fence.__file__).resolve().parent  # the celery_fence package being checked


@dataclass(frozen=True)
class Breakage:
    name: str
    what: str
    path: str  # inside the package
    old: str
    new: str
    scenario: tuple[str, ...]  # the chaos command's arguments
    #: The safety column that must fire: another column firing is not this breakage caught.
    column: str
    postgresql: bool = False  # run against a throwaway PostgreSQL database
    #: How many times ``old`` is in the file (each replaced): a statement written once per
    #: dialect (queries.sql's ``register``) is broken in both.
    occurrences: int = 1


BREAKAGES = (
    Breakage(
        "completion-predicate",
        "completion predicate loosened to key AND status = 'running'",
        "store/queries.sql",
        "error_message = NULL\nWHERE key = :key AND generation = :generation AND "
        "attempt_id = :attempt_id AND status = 'running'\n",
        "error_message = NULL\nWHERE key = :key AND status = 'running'\n",
        ("--scenario", "pause", "--runs", "2"),
        column="stale_writes",
    ),
    Breakage(
        "registration-generation",
        "generation term dropped from the registration",
        "store/queries.sql",
        "WHERE fence_jobs.status NOT IN ('completed', 'dead')\n"
        "    AND fence_jobs.generation < excluded.generation\n"
        "RETURNING key, generation, attempt_id, attempts,\n",
        "WHERE fence_jobs.status NOT IN ('completed', 'dead')\n"
        "RETURNING key, generation, attempt_id, attempts,\n",
        ("--scenario", "redis-loss", "--runs", "2"),
        column="generations_claimed_twice",
        occurrences=2,
    ),
    Breakage(
        "registration-terminal",
        "registration takes a completed job's row (the terminal-state term dropped)",
        "store/queries.sql",
        "WHERE fence_jobs.status NOT IN ('completed', 'dead')\n"
        "    AND fence_jobs.generation < excluded.generation\n"
        "RETURNING key, generation, attempt_id, attempts,\n",
        "WHERE 1 = 1\n"
        "    AND fence_jobs.generation < excluded.generation\n"
        "RETURNING key, generation, attempt_id, attempts,\n",
        ("--scenario", "kill", "--runs", "1"),
        column="reruns_after_completion",
        occurrences=2,
    ),
    Breakage(
        "commit-check",
        "commit-time check skipped in fence.transaction()",
        "body/transaction.py",
        "        owner = store.blocks.owner(conn, fence)  # LeaseLost: paused past the lease in the"
        " block\n",
        "        owner = True  # broken: the commit-time check skipped\n",
        ("--scenario", "app-write", "--runs", "2"),
        column="stale_app_writes",
        postgresql=True,
    ),
    Breakage(
        "release-token",
        "lease release without the token compare",
        "leases/lua/release.lua",
        "if value and (value == expected\n"
        "    or (string.sub(expected, -1) == ':' and string.sub(value, 1, #expected) == expected))"
        " then",
        "if value then",
        ("--scenario", "pause", "--runs", "2"),
        column="unexpected_outcomes",
    ),
    Breakage(
        "ack-early",
        "message acked before the settle step (acks_late off)",
        "adapters/task.py",
        "    acks_late = True\n",
        "    acks_late = False\n",
        ("--scenario", "kill", "--runs", "1", "--converge-timeout", "20"),
        column="lost_jobs",
    ),
    Breakage(
        "outbox-outside",
        "outbox insert outside the completion's transaction",
        "store/fenced.py",
        "        if own_tx:\n"
        "            cursor.execute(session_sql.BEGIN_IMMEDIATE)\n"
        "        try:\n"
        "            cursor.execute(statement, params)\n",
        "        for e in effects:  # broken: outside the completion's transaction\n"
        "            cursor.execute(\n"
        '                self.statements["outbox_insert"],\n'
        '                {"key": params["key"], "name": e.name,\n'
        '                 "idempotency_key": e.idempotency_key,\n'
        '                 "payload": json.dumps(e.payload), "now": stamp},\n'
        "            )\n"
        "        effects = ()\n"
        "        if own_tx:\n"
        "            cursor.execute(session_sql.BEGIN_IMMEDIATE)\n"
        "        try:\n"
        "            cursor.execute(statement, params)\n",
        ("--scenario", "pause", "--runs", "3"),
        column="stale_writes",
    ),
    Breakage(
        "guard",
        "guard() enters without checking the lease",
        "body/fence.py",
        "        self.check()\n        yield self\n\n    def transaction(",
        "        yield self  # broken: no check\n\n    def transaction(",
        ("--scenario", "pause", "--runs", "2"),
        column="stale_writes",
    ),
    Breakage(
        "atomic-check",
        "commit-time check skipped in fence.atomic()",
        "contrib/django/atomic.py",
        "        owner = store.blocks.owner_cursor(cursor, fence)",
        "        owner = True  # broken: the commit-time check skipped",
        ("--scenario", "django-write", "--runs", "2"),
        column="stale_app_writes",
        postgresql=True,
    ),
    Breakage(
        "enqueue-row",
        "enqueue() publishes without writing the job's durable row",
        "durable/__init__.py",
        "    created, status, stored = target.insert(key, task.name, request, due)\n",
        '    created, status, stored = True, "pending", None  # broken: no durable row\n',
        ("--scenario", "enqueue-crash", "--runs", "1"),
        column="lost_jobs",
    ),
    Breakage(
        "recovery-send",
        "recovery takes a stranded job for a re-send and never sends it",
        "ops/recovery.py",
        "    return send_stored(app, taken, takeover=takeover_header(record))\n",
        "    return taken.key  # broken: taken for a re-send, never sent\n",
        ("--scenario", "recovered-chain", "--runs", "1"),
        column="lost_jobs",
    ),
    Breakage(
        "outbox-claim",
        "outbox delivery claims rows already delivered or claimed (each replay delivers again)",
        "store/outbox_sql.py",
        "        (outbox.c.status == OutboxStatus.PENDING.value)\n"
        "        & (outbox.c.available_at <= now)\n"
        "        & (outbox.c.claimed_until.is_(None) | (outbox.c.claimed_until < now))\n",
        "        outbox.c.available_at <= now  # broken: delivered and claimed rows are due\n",
        ("--scenario", "duplicate", "--runs", "1", "--provider-not-idempotent"),
        column="duplicate_external_effects",
    ),
)
HEADERS = dict(COLUMNS)


@dataclass
class MutationRun:
    """One breakage applied and run: which columns of the checker fired."""

    name: str
    what: str
    scenario: str
    applied: bool
    fired: dict[str, int]
    first_violation: str
    exit_status: int
    seconds: float
    error: str = ""

    #: The column the breakage names: only that column firing counts as caught.
    expected: str = ""

    @property
    def caught(self) -> bool:
        return self.applied and self.fired.get(self.expected, 0) > 0


def mutant(root: Path, breakage: Breakage | None) -> bool:
    """Copy the package under ``root`` and apply ``breakage``; False when its text is not found
    exactly ``breakage.occurrences`` times (the code changed: the breakage must be updated)."""
    target = root / "celery_fence"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    if breakage is None:
        return True
    path = target / breakage.path
    text = path.read_text()
    if text.count(breakage.old) != breakage.occurrences:
        return False
    path.write_text(text.replace(breakage.old, breakage.new))
    return True


def run_chaos(root: Path, args: Sequence[str], common: Sequence[str]) -> tuple[int, dict, str]:
    """Run the chaos command with the copy under ``root`` first on the import path (the harness
    and every worker it starts run there, and inherit the variable)."""
    report = root / "report.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "celery_fence.chaos", *args, *common, "-q", "--json", str(report)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr


@contextlib.contextmanager
def pg_database(admin_url: str) -> Iterator[str]:
    """A throwaway PostgreSQL database (dropped afterwards), as a URL."""
    name = f"celery_fence_mutant_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield sa.engine.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def check(
    breakage: Breakage | None,
    scenario: Sequence[str],
    common: Sequence[str],
    *,
    postgresql: bool,
    pg_admin_url: str,
) -> MutationRun:
    name = breakage.name if breakage else "baseline"
    what = breakage.what if breakage else "the package as it is"
    expected = breakage.column if breakage else ""
    label = " ".join(scenario) + (" (PostgreSQL)" if postgresql else "")
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"fence-{name}-")))
        if not mutant(root, breakage):
            return MutationRun(name, what, label, False, {}, "", -1, 0.0, expected=expected)
        args = list(scenario)
        if postgresql:
            args += ["--database-url", stack.enter_context(pg_database(pg_admin_url))]
        rc, data, output = run_chaos(root, args, common)
    fired: dict[str, int] = {}
    first = ""
    for row in data.get("scenarios", []):
        for column in SAFETY_COLUMNS:
            if row.get(column):
                fired[column] = fired.get(column, 0) + int(row[column])
        if not first and row.get("violations"):
            first = str(row["violations"][0])
    error = "; ".join(data.get("errors", [])) if data else output.strip().splitlines()[-1:][0]
    return MutationRun(
        name,
        what,
        label,
        True,
        fired,
        first,
        rc,
        time.monotonic() - started,
        error,
        expected=expected,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.mutations",
        description="Break the fence on purpose, one breakage at a time; every one must be caught.",
    )
    names = [b.name for b in BREAKAGES]
    p.add_argument("--only", action="append", choices=names, help="run only these breakages")
    p.add_argument("--ttl", type=float, default=1.0, help="lease TTL of the runs (default 1.0)")
    p.add_argument("--seed", type=int, default=1, help="seed of the runs (default 1)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unbroken run")
    p.add_argument(
        "--pg-admin-url",
        default="postgresql+psycopg2://postgres@127.0.0.1:5432/postgres",
        help="where the PostgreSQL breakages create a throwaway database (default %(default)s)",
    )
    p.add_argument("--redis-url", help="the chaos runs' Redis (default: the chaos command's)")
    p.add_argument("--broker-url", help="the chaos runs' broker (default: the chaos command's)")
    p.add_argument("-q", "--quiet", action="store_true")
    a = p.parse_args(argv)
    chosen = [b for b in BREAKAGES if not a.only or b.name in a.only]
    common: tuple[str, ...] = ("--ttl", str(a.ttl), "--seed", str(a.seed))
    if a.redis_url:
        common += ("--redis-url", a.redis_url)
    if a.broker_url:
        common += ("--broker-url", a.broker_url)
    started = time.monotonic()
    outcomes: list[MutationRun] = []
    for postgresql in (False, True) * (not a.no_baseline):
        # the same scenarios, unbroken: every safety column must stay zero
        scenarios = sorted({b.scenario[1] for b in chosen if b.postgresql == postgresql})
        if not scenarios:
            continue
        runs = str(max(int(b.scenario[3]) for b in chosen if b.postgresql == postgresql))
        base = check(
            None,
            ("--scenario", ",".join(scenarios), "--runs", runs),
            common,
            postgresql=postgresql,
            pg_admin_url=a.pg_admin_url,
        )
        outcomes.append(base)
        if not a.quiet:
            _print(base, baseline=True)
    for b in chosen:
        outcome = check(b, b.scenario, common, postgresql=b.postgresql, pg_admin_url=a.pg_admin_url)
        outcomes.append(outcome)
        if not a.quiet:
            _print(outcome)
    broken = [o for o in outcomes if o.name != "baseline"]
    missed = [o.name for o in broken if not o.caught]
    baseline_dirty = [o for o in outcomes if o.name == "baseline" and (o.fired or o.exit_status)]
    print(
        f"{sum(o.caught for o in broken)} of {len(broken)} breakages caught in "
        f"{time.monotonic() - started:.0f}s (ttl {a.ttl}s, seed {a.seed})"
        + (f"; NOT CAUGHT: {', '.join(missed)}" if missed else "")
        + ("; THE UNBROKEN PACKAGE FAILED THE SAME SCENARIOS" if baseline_dirty else "")
    )
    return 1 if missed or baseline_dirty else 0


def _print(o: MutationRun, *, baseline: bool = False) -> None:
    if not o.applied:
        print(f"- {o.name}: NOT APPLIED (its text is not in the package any more): {o.what}")
        return
    columns = ", ".join(f"{HEADERS[c]} {n}" for c, n in o.fired.items()) or "nothing"
    if baseline:
        verdict = (
            "clean" if not o.fired and o.exit_status == 0 else f"NOT CLEAN (exit {o.exit_status})"
        )
        print(f"- baseline ({o.scenario}): {verdict}; fired: {columns} [{o.seconds:.0f}s]")
    else:
        verdict = "caught" if o.caught else f"NOT CAUGHT by {HEADERS[o.expected]!r}"
        print(
            f"- {o.name}: {o.what}\n    {o.scenario}: {verdict}; "
            f"fired: {columns} [{o.seconds:.0f}s]"
        )
    if o.first_violation:
        print(f"    e.g. {o.first_violation[:200]}")
    if o.error:
        print(f"    harness: {o.error[:200]}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
