"""The verbs that only look: ``check`` (settings, Redis, schema, and a write probe rolled back),
``ls`` and ``show``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click
import sqlalchemy as sa
from celery.bin.base import CeleryOption

from celery_fence import migrate
from celery_fence.leases.lease import make_redis_client
from celery_fence.ops import recovery
from celery_fence.ops.cli.common import (
    EFFECT_HEADER,
    EX_USAGE,
    FenceCLIError,
    celery_command,
    command,
    effect_cells,
    effect_json,
    locate,
    record_json,
    safe_url,
    scope_of,
    table,
    utc,
    utc_iso,
    utc_text,
)
from celery_fence.schema import CHECKPOINT, PENDING, STATUSES
from celery_fence.settings import DJANGO_STORE_UNSET, read_setting
from celery_fence.store import COMPLETED, UNFINISHED, JobRecord, Store, Transition, probe
from celery_fence.store.driver_errors import sqlstate
from celery_fence.store.records import never_claimed as unclaimed
from celery_fence.store.steps import StepRecord

# -- check ---------------------------------------------------------------------------------------


@command("check")
@click.pass_context
def check(ctx: click.Context) -> None:
    """Check the settings of every fenced task, ping Redis, say whether each store's schema is
    current, and run a fenced task's writes and reads on each store in a transaction rolled back.
    Exits non-zero on the first problem, with one line naming it and the fix."""
    with scope_of(ctx) as scope:  # reads every fenced task's settings: raises on a bad one
        tasks = scope.fenced_tasks()
        if _django_store_unset(ctx.obj.app):  # before any store is opened (no file is made)
            raise FenceCLIError(DJANGO_STORE_UNSET)
        ctx.obj.echo(f"settings: ok ({len(tasks)} fenced task{'s' * (len(tasks) != 1)})")
        redises = scope.redis_configs()
        for config in redises:
            make_redis_client(config.redis).ping()
        ctx.obj.echo("redis: ok" + (f" ({len(redises)} servers)" if len(redises) > 1 else ""))
        databases = list(scope.databases())
        for database in databases:
            _check_schema(ctx, database.url)
        for database in databases:
            _check_writes(ctx, database.store)


#: The Django app whose settings name the store.
DJANGO_APP = "celery_fence.contrib.django"


def _django_store_unset(app: Any) -> bool:
    """A Django project (its settings configured, :data:`DJANGO_APP` installed) that names no
    store: neither ``CELERY_FENCE_DATABASE`` nor ``CELERY_FENCE_DATABASE_URL`` (any spelling) in
    its settings or the app's configuration."""
    django_conf = sys.modules.get("django.conf")
    if django_conf is None:
        return False
    settings = django_conf.settings
    try:
        if not (settings.configured or os.environ.get("DJANGO_SETTINGS_MODULE")):
            return False
        if DJANGO_APP not in settings.INSTALLED_APPS:
            return False
        names = [n for n in dir(settings) if n.startswith(("CELERY_FENCE_", "FENCE_"))]
        named = any(
            n.endswith(("FENCE_DATABASE", "FENCE_DATABASE_URL"))
            and getattr(settings, n) is not None
            for n in names
        )
    except Exception:  # settings that cannot be read: not judged here
        return False
    conf = app.conf
    return not named and all(read_setting(conf, n) is None for n in ("database", "database_url"))


def _check_schema(ctx: click.Context, url: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            tables = set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    missing = sorted(migrate.TABLES - tables)
    stamped = migrate.current(url)
    if missing:
        raise FenceCLIError(
            f"database {safe_url(url)}: tables missing ({', '.join(missing)}); run: "
            f"{celery_command(ctx)} fence init-db"
        )
    if stamped and migrate.head() not in stamped:
        raise FenceCLIError(
            f"database {safe_url(url)}: schema at {', '.join(stamped)}, not {migrate.head()}; "
            f"run: {celery_command(ctx)} fence init-db"
        )
    ctx.obj.echo(f"database: ok ({safe_url(url)}, schema current)")


def _check_writes(ctx: click.Context, store: Store) -> None:
    """The store's write probe (:func:`celery_fence.store.probe.write_probe`), or one line: the
    store, the error and the fix."""
    try:
        ran = probe.write_probe(store)
    except Exception as exc:
        raise FenceCLIError(
            f"store {safe_url(store.url)} cannot take a fenced task's writes: {exc}; "
            f"{_write_fix(exc, store, celery_command(ctx))}"
        ) from None
    ctx.obj.echo(f"store: ok ({safe_url(store.url)}: {ran})")


def _write_fix(exc: BaseException, store: Store, celery: str) -> str:
    """What to do about a store that refused the probe's writes."""
    cause = exc.__cause__ or exc
    code, text = sqlstate(cause), str(getattr(cause, "orig", cause)).lower()
    if code == "42501" or "permission denied" in text:
        return (
            "grant the database user of fence_database_url SELECT, INSERT, UPDATE and DELETE on "
            f"{', '.join(sorted(migrate.TABLES))} and USAGE on their sequences"
        )
    if code == "25006" or "read-only" in text or "readonly" in text:
        return (
            "the connection is read-only (a standby, default_transaction_read_only, or a "
            "read-only SQLite file): point fence_database_url at a writable database"
        )
    if code in ("42P01", "42703") or "no such table" in text or "no such column" in text:
        return f"the schema does not match this version: run: {celery} fence init-db"
    if store.dialect != "postgresql":
        return "check that the workers can write the SQLite file and its directory"
    other = "postgresql+psycopg2://" if store.db.driver == "psycopg" else "postgresql+psycopg://"
    return (
        f"the {store.db.driver} driver could not run a fenced task's statements on this "
        f"database: try the other driver ({other}...) in fence_database_url, and report this "
        "error to celery-fence"
    )


# -- ls ------------------------------------------------------------------------------------------


@command("ls")
@click.option(
    "--status",
    cls=CeleryOption,
    help_group="Filter Options",
    help=f"Only jobs in this status ({', '.join(STATUSES)}).",
)
@click.option("--task", cls=CeleryOption, help_group="Filter Options", help="Only this task name.")
@click.option(
    "--limit",
    cls=CeleryOption,
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help_group="Filter Options",
    help="At most this many jobs, most recently updated first.",
)
@click.option(
    "--stuck",
    cls=CeleryOption,
    is_flag=True,
    help_group="Filter Options",
    help="Only stranded jobs: unfinished, no live lease, not moved for --older-than seconds "
    "(what 'fence recover' re-sends), oldest first.",
)
@click.option(
    "--older-than",
    cls=CeleryOption,
    type=click.FloatRange(min=0),
    default=None,
    help_group="Filter Options",
    help="With --stuck: seconds without movement (default: none for a running job, its lease "
    "alone decides; each job's task's fence_recover_after, 3 x its lease TTL, for a retrying or "
    "re-sent one; fence_recover_pending_after for a never-claimed one).",
)
@click.option(
    "--never-claimed",
    cls=CeleryOption,
    is_flag=True,
    help_group="Filter Options",
    help="Only jobs enqueued and not yet claimed by any worker (pending, generation 0).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_context
def ls(
    ctx: click.Context,
    status: str | None,
    task: str | None,
    limit: int,
    stuck: bool,
    older_than: float | None,
    never_claimed: bool,
    as_json: bool,
) -> None:
    """List jobs, most recently updated first (--stuck: stranded jobs, oldest first). A job
    enqueued and not yet claimed shows as ``pending (never claimed)``."""
    if status is not None and status not in STATUSES:
        raise FenceCLIError(
            f"bad --status {status!r}: use one of {', '.join(STATUSES)}", exit_code=EX_USAGE
        )
    if older_than is not None and not stuck:
        raise FenceCLIError("--older-than goes with --stuck", exit_code=EX_USAGE)
    if stuck:
        if status is not None and status not in UNFINISHED:
            raise FenceCLIError(
                f"--stuck lists unfinished jobs ({', '.join(UNFINISHED)}), not {status}",
                exit_code=EX_USAGE,
            )
        with scope_of(ctx) as scope:  # filtered in the scan, before the limit cuts
            found = recovery.stranded_jobs(
                scope,
                older_than=older_than,
                limit=limit,
                task_name=task,
                resend_backoff=False,
                statuses=(status,) if status else (PENDING,) if never_claimed else UNFINISHED,
                where=unclaimed if never_claimed else None,
            )
        records = [r for _, r in found]
    else:
        with scope_of(ctx) as scope:
            listed = [
                r
                for db in scope.databases()
                for r in db.store.admin.list_jobs(
                    status=status, task_name=task, limit=limit, never_claimed=never_claimed
                )
            ]
        records = sorted(listed, key=lambda r: utc(r.updated_at), reverse=True)[:limit]
    if len(records) == limit:  # on stderr, so --json stays one array
        click.echo(f"fence ls: {limit} shown (--limit); more may match", err=True)
    if as_json:
        ctx.obj.echo(json.dumps([record_json(r) for r in records]))
        return
    if not records:
        ctx.obj.echo("no stranded jobs" if stuck else "no jobs")
        return
    rows = [
        (
            r.key,
            r.task_name,
            r.status + (" (never claimed)" if unclaimed(r) else ""),
            str(r.attempts),
            str(r.generation),
            utc_text(r.updated_at),
            (r.error_type or "").rsplit(".", 1)[-1] or "-",
        )
        for r in records
    ]
    header = ("KEY", "TASK", "STATUS", "ATTEMPTS", "GEN", "UPDATED", "ERROR")
    ctx.obj.echo(table(rows, header))


# -- show ----------------------------------------------------------------------------------------


def _transition_json(t: Transition) -> dict[str, Any]:
    return {
        "at": utc_iso(t.at),
        "action": t.action,
        "generation": t.generation,
        "attempt_id": t.attempt_id,
        "reason": t.reason,
    }


#: Characters of a stored result ``fence show`` prints as text (``--json`` prints it whole).
RESULT_TEXT_LENGTH = 2000


def _result_text(record: JobRecord) -> str:
    """The stored result as JSON text, shortened; ``-`` until the job completed."""
    if record.status != COMPLETED:
        return "-"
    text = json.dumps(record.result, default=repr)
    if len(text) > RESULT_TEXT_LENGTH:
        return f"{text[:RESULT_TEXT_LENGTH]}... ({len(text)} characters; --json prints it whole)"
    return text


def _step_json(step: StepRecord, values: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": step.name,
        "state": _step_state(step),
        "generation": step.generation,
        "attempt_id": step.attempt_id,
        "at": utc_iso(step.updated_at),
        "size": step.size,
    }
    if values:
        doc["value"] = step.value
    return doc


def _step_state(step: StepRecord) -> str:
    return "checkpoint" if step.name == CHECKPOINT else "done"


def _step_lines(steps: list[StepRecord], values: bool) -> list[str]:
    if not steps:
        return ["steps:         none"]
    rows = [
        (
            step.name,
            _step_state(step),
            f"gen {step.generation}",
            step.attempt_id,
            utc_text(step.updated_at),
            f"{step.size} B",
        )
        + ((json.dumps(step.value, default=repr),) if values else ())
        for step in steps
    ]
    header = ("NAME", "STATE", "GEN", "ATTEMPT", "AT", "SIZE") + (("VALUE",) if values else ())
    return ["steps:"] + ["  " + line for line in table(rows, header).splitlines()]


@command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
@click.option(
    "--values",
    is_flag=True,
    help="Also print the stored values of the job's steps and checkpoint (payloads).",
)
@click.pass_context
def show(ctx: click.Context, key: str, as_json: bool, values: bool) -> None:
    """Show one job: its state, its lease in Redis, its transition history, its outbox
    effects (name, state, attempts, last error, idempotency key; never their payloads) and its
    completed steps and checkpoint (name, generation, when, size; their values with
    ``--values``)."""
    with scope_of(ctx) as scope:
        store, record = locate(scope, key)
        remaining, lease_generation = scope.lease(record)
    history = store.transitions.history(key)
    steps = store.steps.rows(key, values=values)
    effects = store.outbox_rows.rows(key=key)
    routing = recovery.routing_for(record, ctx.obj.app) if record.request else {}
    queue = routing.get("queue")
    if "routing_key" in routing:
        queue = f"exchange {routing['exchange']!r}, routing key {routing['routing_key']!r}"
    if as_json:
        doc = record_json(record)
        doc.update(
            queue=routing.get("queue"),
            exchange=routing.get("exchange"),
            routing_key=routing.get("routing_key"),
            lease_remaining=remaining,
            lease_generation=lease_generation,
            result=record.result if record.status == COMPLETED else None,
            history=[_transition_json(t) for t in history],
            effects=[effect_json(e) for e in effects],
            steps=[_step_json(step, values) for step in steps],
        )
        ctx.obj.echo(json.dumps(doc))
        return
    error = "-"
    if record.error_type:
        error = f"{record.error_type}: {record.error_message or ''}".rstrip(": ")
    lease = "none (not held)"
    if remaining is not None:
        lease = f"{remaining:.3f}s left, generation {lease_generation}"
    fields = [
        ("key", record.key),
        ("task", record.task_name),
        ("queue", queue or "-"),
        ("status", record.status + (" (never claimed)" if record.generation == 0 else "")),
        ("generation", str(record.generation)),
        ("owner attempt", record.attempt_id),
        ("attempts", str(record.attempts)),
        ("last error", error),
        ("created", utc_text(record.created_at)),
        ("updated", utc_text(record.updated_at)),
        ("finished", utc_text(record.finished_at)),
        ("retry at", utc_text(record.retry_at)),
        ("lease", lease),
        ("result", _result_text(record)),
    ]
    if record.unique_key is not None:  # a unique job (enqueue(unique=...), fence_unique)
        fields.append(("unique key", record.unique_key))
    lines = [f"{name + ':':<15}{value}" for name, value in fields]
    if history:
        lines.append("history:")
        rows = [
            (
                utc_text(t.at),
                t.action,
                "-" if t.generation is None else f"gen {t.generation}",
                t.attempt_id or "-",
                t.reason or "",
            )
            for t in history
        ]
        lines.extend(
            "  " + line
            for line in table(rows, ("AT", "ACTION", "GEN", "ATTEMPT", "REASON")).splitlines()
        )
    else:
        lines.append("history:       none recorded")
    if effects:
        lines.append("effects:")
        cells = [effect_cells(e) for e in effects]
        lines.extend("  " + line for line in table(cells, EFFECT_HEADER).splitlines())
    else:
        lines.append("effects:       none")
    lines.extend(_step_lines(steps, values))
    ctx.obj.echo("\n".join(lines))
