"""``celery -A proj fence ...``: the operator's view of fenced jobs.

Registered as a Celery sub-command through the ``celery.commands`` entry point; the app (and so
the settings) comes from ``celery -A proj``. The CLI talks to the store and the lease store only,
never to a task. Every failure — unknown key, bad option value, unreachable database, Redis or
broker — ends with one line on stderr and a non-zero exit code (2 for usage errors, 1 otherwise),
never a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import click
import sqlalchemy as sa
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from celery.exceptions import CeleryCommandException

from . import migrate, recovery, signals
from .config import FenceConfig
from .errors import FenceError, StaleGeneration
from .lease import LeaseStore, make_redis_client
from .schema import COMPLETED, DEAD, STATUSES
from .store import UNFINISHED, JobRecord, Store, Transition, store_for

EX_FAILURE = 1
EX_USAGE = 2


class FenceCLIError(CeleryCommandException):
    """One line on stderr (``Error: ...``) and a non-zero exit."""

    def __init__(self, message: str, exit_code: int = EX_FAILURE) -> None:
        # one line, whatever the cause printed
        super().__init__(message=" ".join(message.split()), exit_code=exit_code)


def describe(exc: BaseException) -> str:
    """A one-line description of an error from the store, Redis or the broker (no payloads)."""
    import kombu.exceptions
    import redis.exceptions

    if isinstance(exc, FenceError):
        return str(exc)
    if isinstance(exc, sa.exc.DBAPIError):
        detail = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else ""
        if "no such table" in detail or "does not exist" in detail:
            return f"the celery-fence tables are missing ({detail}): run 'celery fence init-db'"
        return f"database error ({type(exc.orig).__name__}): {detail}"
    if isinstance(exc, sa.exc.SQLAlchemyError):
        return f"database error ({type(exc).__name__}): {str(exc).splitlines()[0]}"
    if isinstance(exc, redis.exceptions.RedisError):
        return f"Redis error ({type(exc).__name__}): {exc}"
    if isinstance(exc, kombu.exceptions.OperationalError):
        return f"broker error ({type(exc).__name__}): {exc}"
    return f"{type(exc).__name__}: {exc}"


class FenceGroup(click.Group):
    """Turns every error of a sub-command, including its option parsing, into one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, FenceCLIError):
            raise
        except click.UsageError as exc:
            raise FenceCLIError(exc.format_message(), EX_USAGE) from None
        except click.ClickException as exc:
            raise FenceCLIError(exc.format_message(), exc.exit_code) from None
        except Exception as exc:
            raise FenceCLIError(describe(exc)) from None


@click.group(cls=FenceGroup, name="fence")
@click.pass_context
@handle_preload_options
def fence(ctx: click.Context, **kwargs: Any) -> None:
    """celery-fence: inspect, recover, requeue and purge fenced jobs; create the schema."""


def _config(ctx: click.Context) -> FenceConfig:
    return FenceConfig.from_app(ctx.obj.app)


def _store(ctx: click.Context) -> Store:
    return store_for(_config(ctx))


def _safe_url(url: str) -> str:
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<invalid url>"


def _when(value: dt.datetime | None) -> str:
    if value is None:
        return "-"
    if value.tzinfo is None:  # SQLite hands back naive UTC
        value = value.replace(tzinfo=dt.timezone.utc)
    return value.astimezone(dt.timezone.utc).isoformat(timespec="seconds")


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else _when(value)


def _record_json(record: JobRecord) -> dict[str, Any]:
    return {
        "key": record.key,
        "task": record.task_name,
        "status": record.status,
        "generation": record.generation,
        "attempt_id": record.attempt_id,
        "attempts": record.attempts,
        "error_type": record.error_type,
        "error_message": record.error_message,
        "created_at": _iso(record.created_at),
        "updated_at": _iso(record.updated_at),
        "finished_at": _iso(record.finished_at),
        "retry_at": _iso(record.retry_at),
    }


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=False)]
    lines = [header, *rows]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=False)).rstrip()
        for line in lines
    )


def _command(name: str) -> Callable[[Callable[..., Any]], click.Command]:
    return fence.command(name=name, cls=CeleryCommand)


# -- init-db -----------------------------------------------------------------------------------


@_command("init-db")
@click.pass_context
def init_db(ctx: click.Context) -> None:
    """Create or upgrade the celery-fence tables (Alembic; stamps tables made by create_all)."""
    url = _config(ctx).database_url
    action = migrate.upgrade(url)
    ctx.obj.echo(f"{action}: celery-fence schema at {_safe_url(url)} is at {migrate.head()}")


# -- check ---------------------------------------------------------------------------------------


@_command("check")
@click.pass_context
def check(ctx: click.Context) -> None:
    """Check the settings of every fenced task, ping Redis and the database, and say whether the
    schema is current. Exits non-zero on the first problem, with one line naming it and the fix."""
    from .task import FencedTask

    app = ctx.obj.app
    app.loader.import_default_modules()
    config = _config(ctx)
    tasks = sorted(t.name for t in app.tasks.values() if isinstance(t, FencedTask))
    for name in tasks:
        app.tasks[name].fence_config()  # raises ConfigurationError naming the setting
    ctx.obj.echo(f"settings: ok ({len(tasks)} fenced task{'s' * (len(tasks) != 1)})")
    make_redis_client(config).ping()
    ctx.obj.echo("redis: ok")
    url = config.database_url
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
            f"database {_safe_url(url)}: tables missing ({', '.join(missing)}); run: "
            "celery -A <app> fence init-db"
        )
    if stamped and migrate.head() not in stamped:
        raise FenceCLIError(
            f"database {_safe_url(url)}: schema at {', '.join(stamped)}, not {migrate.head()}; "
            "run: celery -A <app> fence init-db"
        )
    ctx.obj.echo(f"database: ok ({_safe_url(url)}, schema current)")


# -- ls ------------------------------------------------------------------------------------------


@_command("ls")
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
    help="With --stuck: seconds without movement (default: fence_recover_after, 10 x lease TTL).",
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
    as_json: bool,
) -> None:
    """List jobs, most recently updated first (--stuck: stranded jobs, oldest first)."""
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
        config = _config(ctx)
        threshold = config.recover_after_seconds if older_than is None else older_than
        with recovery.lease_store(config) as leases:
            records = recovery.stranded_jobs(
                store_for(config), leases, older_than=threshold, limit=limit, task_name=task
            )
        if status is not None:
            records = [r for r in records if r.status == status]
    else:
        records = _store(ctx).list(status=status, task_name=task, limit=limit)
    if as_json:
        ctx.obj.echo(json.dumps([_record_json(r) for r in records]))
        return
    if not records:
        ctx.obj.echo("no stranded jobs" if stuck else "no jobs")
        return
    rows = [
        (
            r.key,
            r.task_name,
            r.status,
            str(r.attempts),
            str(r.generation),
            _when(r.updated_at),
            (r.error_type or "").rsplit(".", 1)[-1] or "-",
        )
        for r in records
    ]
    header = ("KEY", "TASK", "STATUS", "ATTEMPTS", "GEN", "UPDATED", "ERROR")
    ctx.obj.echo(_table(rows, header))


# -- show ----------------------------------------------------------------------------------------


def _lease(config: FenceConfig, key: str) -> tuple[float | None, int | None]:
    client = make_redis_client(config)
    try:
        return LeaseStore(client, prefix=config.key_prefix).remaining(key)
    finally:
        close = getattr(client, "close", None)
        if close is not None:
            close()


def _transition_json(t: Transition) -> dict[str, Any]:
    return {
        "at": _iso(t.at),
        "action": t.action,
        "generation": t.generation,
        "attempt_id": t.attempt_id,
        "reason": t.reason,
    }


@_command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
@click.pass_context
def show(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one job: its state, its lease in Redis and its transition history."""
    config = _config(ctx)
    store = store_for(config)
    record = store.get(key)
    if record is None:
        raise FenceCLIError(f"no job with key {key!r}")
    remaining, lease_generation = _lease(config, key)
    history = store.history(key)
    routing = recovery.routing_for(record, ctx.obj.app) if record.request else {}
    queue = routing.get("queue")
    if "routing_key" in routing:
        queue = f"exchange {routing['exchange']!r}, routing key {routing['routing_key']!r}"
    if as_json:
        doc = _record_json(record)
        doc.update(
            queue=routing.get("queue"),
            exchange=routing.get("exchange"),
            routing_key=routing.get("routing_key"),
            lease_remaining=remaining,
            lease_generation=lease_generation,
            history=[_transition_json(t) for t in history],
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
        ("status", record.status),
        ("generation", str(record.generation)),
        ("owner attempt", record.attempt_id),
        ("attempts", str(record.attempts)),
        ("last error", error),
        ("created", _when(record.created_at)),
        ("updated", _when(record.updated_at)),
        ("finished", _when(record.finished_at)),
        ("retry at", _when(record.retry_at)),
        ("lease", lease),
    ]
    lines = [f"{name + ':':<15}{value}" for name, value in fields]
    if history:
        lines.append("history:")
        rows = [
            (
                _when(t.at),
                t.action,
                "-" if t.generation is None else f"gen {t.generation}",
                t.attempt_id or "-",
                t.reason or "",
            )
            for t in history
        ]
        lines.extend(
            "  " + line
            for line in _table(rows, ("AT", "ACTION", "GEN", "ATTEMPT", "REASON")).splitlines()
        )
    else:
        lines.append("history:       none recorded")
    ctx.obj.echo("\n".join(lines))


# -- requeue, recover ----------------------------------------------------------------------------


@_command("requeue")
@click.argument("key")
@click.option(
    "--force",
    cls=CeleryOption,
    is_flag=True,
    help_group="Requeue Options",
    help="Also re-send a job that is not dead (running, retrying, pending) once no live lease "
    "holds it; its attempt count is kept.",
)
@click.pass_context
def requeue(ctx: click.Context, key: str, force: bool) -> None:
    """Re-send a dead job (same key, fresh attempt budget) to its queue.

    With --force, also an unfinished job that no live lease holds (a stranded one, without
    waiting for 'fence recover'). A completed job is never re-sent.
    """
    app = ctx.obj.app
    config = _config(ctx)
    store = store_for(config)
    record = store.get(key)
    if record is None:
        raise FenceCLIError(f"no job with key {key!r}")
    if record.status != DEAD:
        if record.status == COMPLETED or not force:
            raise FenceCLIError(
                f"job {key!r} is {record.status}, not dead: only dead jobs are requeued"
                + ("" if record.status == COMPLETED else " (--force re-sends an unfinished one)")
            )
        _force_requeue(ctx, config, store, record)
        return
    if not record.request:
        raise FenceCLIError(
            f"job {key!r} has no stored request (its arguments were not JSON): re-send it from "
            "your code"
        )
    before = store.requeue(key)  # durable first: the job is pending with a fresh budget
    try:
        task_id = recovery.send_stored(app, before)
    except Exception as exc:
        reason = f"send failed ({type(exc).__name__})"
        try:
            store.restore_dead(before, reason=reason)
        except StaleGeneration:
            raise FenceCLIError(
                f"could not confirm the send of {key!r} ({describe(exc)}), and an attempt has "
                "claimed it since: left as it is"
            ) from None
        raise FenceCLIError(
            f"could not send {key!r} ({describe(exc)}); it is dead again, retry the requeue"
        ) from None
    _requeued(ctx, before, task_id, "requeued by operator")


def _force_requeue(
    ctx: click.Context, config: FenceConfig, store: Store, record: JobRecord
) -> None:
    with recovery.lease_store(config) as leases:
        remaining, generation = leases.remaining(record.key)
    if remaining is not None:
        raise FenceCLIError(
            f"job {record.key!r} is {record.status} and a live lease holds it ({remaining:.1f}s "
            f"left, generation {generation}): it is running; not re-sent"
        )
    try:
        task_id = recovery.resend(ctx.obj.app, store, record, reason="forced requeue by operator")
    except recovery.NotResendable as exc:
        raise FenceCLIError(str(exc)) from None
    except Exception as exc:
        raise FenceCLIError(
            f"could not send {record.key!r} ({describe(exc)}); it is pending: retry the requeue, "
            f"or 'fence recover' sends it after {config.recover_after_seconds:g}s"
        ) from None
    if task_id is None:
        raise FenceCLIError(f"job {record.key!r} changed while it was requeued: look again")
    _requeued(ctx, record, task_id, "forced requeue by operator")


def _requeued(ctx: click.Context, record: JobRecord, task_id: str, reason: str) -> None:
    app = ctx.obj.app
    task_name = str((record.request or {}).get("task") or record.task_name)
    signals.emit(
        signals.job_retry_scheduled,
        app.tasks.get(task_name, task_name),
        key=record.key,
        attempt_id=None,
        generation=record.generation,
        reason=reason,
        countdown=0.0,
        attempts=0 if record.status == DEAD else record.attempts,
    )
    routing = recovery.routing_for(record, app)
    where = (
        f"exchange {routing['exchange']} with routing key {routing['routing_key']}"
        if "routing_key" in routing
        else f"queue {routing.get('queue') or '(routed)'}"
    )
    ctx.obj.echo(f"requeued {record.key}: {task_name} sent to {where} as {task_id}")


@_command("recover")
@click.option(
    "--older-than",
    cls=CeleryOption,
    type=click.FloatRange(min=0),
    default=None,
    help_group="Recover Options",
    help="Seconds an unfinished job must not have moved (default: fence_recover_after, "
    "10 x lease TTL).",
)
@click.option(
    "--dry-run",
    cls=CeleryOption,
    is_flag=True,
    help_group="Recover Options",
    help="Only list what would be re-sent.",
)
@click.option(
    "--limit",
    cls=CeleryOption,
    type=click.IntRange(min=1),
    default=recovery.DEFAULT_LIMIT,
    show_default=True,
    help_group="Recover Options",
    help="At most this many jobs in one run.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
@click.pass_context
def recover(
    ctx: click.Context, older_than: float | None, dry_run: bool, limit: int, as_json: bool
) -> None:
    """Re-send stranded jobs (unfinished, no live lease, not moved) under their own key.

    Each is taken by a compare-and-set before its send (two runs never both send it) and goes
    through the ordinary claim (a late original message cannot make a second completion).
    Exits 1 when a job could not be re-sent.
    """
    report = recovery.recover(ctx.obj.app, older_than=older_than, dry_run=dry_run, limit=limit)
    if as_json:
        ctx.obj.echo(
            json.dumps(
                {
                    **report.as_dict(),
                    "keys": {
                        "stranded": report.stranded,
                        "sent": report.sent,
                        "raced": report.raced,
                        "dead": report.dead,
                        "failed": report.failed,
                    },
                }
            )
        )
    else:
        for key in report.stranded:
            state = (
                "would re-send"
                if dry_run
                else "re-sent"
                if key in report.sent
                else "moved meanwhile, left"
                if key in report.raced
                else "no stored request: now dead"
                if key in report.dead
                else "FAILED"
            )
            ctx.obj.echo(f"{key}: {state}")
        verb = "would re-send" if dry_run else "re-sent"
        count = len(report.stranded) if dry_run else len(report.sent)
        ctx.obj.echo(f"{len(report.stranded)} stranded job(s); {verb} {count}")
    if report.failed:
        raise FenceCLIError(
            f"{len(report.failed)} stranded job(s) could not be re-sent (see the log): "
            + ", ".join(report.failed[:5])
        )


# -- purge ---------------------------------------------------------------------------------------

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_before(value: str, now: dt.datetime | None = None) -> dt.datetime:
    """An ISO 8601 date or date-time (naive means UTC), or an age like ``30d``, ``12h``."""
    text = value.strip()
    age = _AGE.match(text)
    if age:
        seconds = float(age.group(1)) * _UNITS[age.group(2)]
        return (now or dt.datetime.now(dt.timezone.utc)) - dt.timedelta(seconds=seconds)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise FenceCLIError(
            f"bad date {value!r}: use ISO 8601 (2024-05-01 or 2024-05-01T12:00:00+00:00) or an "
            "age (30d, 12h, 45m)",
            exit_code=EX_USAGE,
        ) from None
    if when.tzinfo is None:
        return when.replace(tzinfo=dt.timezone.utc)
    return when.astimezone(dt.timezone.utc)  # stored times are UTC (SQLite compares text)


@_command("purge")
@click.option(
    "--completed-before",
    "before",
    cls=CeleryOption,
    required=True,
    help_group="Purge Options",
    help="Delete jobs finished before this date (ISO 8601, naive = UTC) or age (30d).",
)
@click.option(
    "--include-dead",
    cls=CeleryOption,
    is_flag=True,
    help_group="Purge Options",
    help="Also delete dead jobs finished before the date (kept by default for inspection).",
)
@click.pass_context
def purge(ctx: click.Context, before: str, include_dead: bool) -> None:
    """Delete finished jobs and their history, and outbox rows delivered before the date.

    Outbox rows are written when a job completes, so a row delivered before the date belongs to
    a job completed before it; rows not delivered yet (pending, dead) are kept whatever their age.
    """
    when = parse_before(before)
    statuses = (COMPLETED, DEAD) if include_dead else (COMPLETED,)
    store = _store(ctx)
    count = store.purge(finished_before=when, statuses=statuses)
    delivered = store.outbox.purge(delivered_before=when)
    ctx.obj.echo(
        f"purged {count} {' and '.join(statuses)} job(s) finished and {delivered} outbox row(s) "
        f"delivered before {_when(when)}"
    )
