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
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import click
import sqlalchemy as sa
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options
from celery.exceptions import CeleryCommandException

from . import migrate, signals
from .config import FenceConfig
from .errors import FenceError, StaleGeneration
from .lease import LeaseStore, make_redis_client
from .schema import COMPLETED, DEAD, STATUSES
from .store import JobRecord, Store, Transition, decode_request, store_for

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
    """celery-fence: inspect, requeue and purge fenced jobs; create the schema."""


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
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_context
def ls(ctx: click.Context, status: str | None, task: str | None, limit: int, as_json: bool) -> None:
    """List jobs, most recently updated first."""
    if status is not None and status not in STATUSES:
        raise FenceCLIError(
            f"bad --status {status!r}: use one of {', '.join(STATUSES)}", exit_code=EX_USAGE
        )
    records = _store(ctx).list(status=status, task_name=task, limit=limit)
    if as_json:
        ctx.obj.echo(json.dumps([_record_json(r) for r in records]))
        return
    if not records:
        ctx.obj.echo("no jobs")
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
    request = decode_request(record.request)
    queue = (request or {}).get("options", {}).get("queue") if request else None
    if as_json:
        doc = _record_json(record)
        doc.update(
            queue=queue,
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


# -- requeue -------------------------------------------------------------------------------------


def _key_is_task_id(app: Any, task_name: str) -> bool:
    """A task without ``fence_key`` uses its Celery task id as the key: re-send with that id."""
    task = app.tasks.get(task_name)
    return task is not None and getattr(task, "fence_key", None) is None


@_command("requeue")
@click.argument("key")
@click.pass_context
def requeue(ctx: click.Context, key: str) -> None:
    """Re-send a dead job (same key, fresh attempt budget) to its queue."""
    app = ctx.obj.app
    store = _store(ctx)
    record = store.get(key)
    if record is None:
        raise FenceCLIError(f"no job with key {key!r}")
    if record.status != DEAD:
        raise FenceCLIError(
            f"job {key!r} is {record.status}, not dead: only dead jobs are requeued"
        )
    request = dict(decode_request(record.request) or {})
    if not request:
        raise FenceCLIError(
            f"job {key!r} has no stored request (its arguments were not JSON): re-send it from "
            "your code"
        )
    before = store.requeue(key)  # durable first: the job is pending with a fresh budget
    task_name = str(request.get("task") or before.task_name)
    options = request.get("options") or {}
    queue = options.get("queue") or None
    task_id = key if _key_is_task_id(app, task_name) else uuid.uuid4().hex
    send: dict[str, Any] = {"task_id": task_id}
    if queue:
        send["queue"] = queue
    if options.get("priority") is not None:
        send["priority"] = options["priority"]
    try:
        app.send_task(
            task_name,
            args=list(request.get("args") or []),
            kwargs=dict(request.get("kwargs") or {}),
            **send,
        )
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
    signals.emit(
        signals.job_retry_scheduled,
        app.tasks.get(task_name, task_name),
        key=key,
        attempt_id=None,
        generation=before.generation,
        reason="requeued by operator",
        countdown=0.0,
        attempts=0,
    )
    ctx.obj.echo(f"requeued {key}: {task_name} sent to queue {queue or '(routed)'} as {task_id}")


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
    delivered = store.outbox_purge(delivered_before=when)
    ctx.obj.echo(
        f"purged {count} {' and '.join(statuses)} job(s) finished and {delivered} outbox row(s) "
        f"delivered before {_when(when)}"
    )
